"""Durable pending-group state: rows of incomplete GRPO groups that survive a crash.

Layout: ``<buffer dir>/pending/state.pt``, one compact snapshot (tensors only: token
fields as values + offsets, text as UTF-8 bytes + offsets, never pickled objects),
replaced atomically on each change: write ``state.pt.partial``, fsync, ``os.replace``,
fsync the directory. A reader after ``kill -9`` sees the old or the new snapshot, whole.
It is rewritten only when the pending set changes: a collector that writes whole
groups per ``extend`` never touches it.

Where a run keeps its state at a URL (``run --home s3://...``), the snapshot is the object
``<directory>/state.pt`` of the run's :class:`~rlhf_pipeline.files.run_store.RunStore`
(``run_store=``; ``directory`` is then a key prefix such as ``collector/pending-shard-0000``), so
a collector restarted on another machine, with an empty local cache, finds it. The store gives
the same guarantees as the file: one whole-object PUT (atomic), fenced like the collector's
position (a predecessor still running is refused at its next write instead of putting its older
snapshot over its successor's), and read back with ``weights_only=True``
(:func:`~rlhf_pipeline.files.state_files.load_state_bytes`): loading it runs no code.

The ordering problem. A group completes inside the transform, but the buffer appends
it only after the transform returns. Dropping its earlier-pending rows from the
snapshot before the append could lose them (crash in between); keeping them could
write the group twice. So the snapshot keeps those rows as *held*, with the store's
``next_row`` at the time (``inflight_start``). Appends are atomic, so afterwards:

* ``store.next_row > inflight_start``: the append happened; held rows are dropped
  (on reload this is checked: the held groups' ids must be in the rows written there);
* ``store.next_row == inflight_start``: it did not (crash, or a later transform or the
  store's validation raised); held rows become pending again and the group completes
  when the rows of the failed ``extend`` are sent again.

This check runs at the start of the next write (the marker spans one ``extend``) and
on reload. Rows of the ``extend`` that was interrupted are not acknowledged and may be
absent; a resuming collector asks the store and :meth:`PendingGroups.trajectory_ids`
what is already held and sends only the rest.
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from rlhf_pipeline.schema.ragged import RaggedTensor
from rlhf_pipeline.schema import FIELDS_BY_NAME, TrajectoryBatch
from rlhf_pipeline.storage.base import StoreCorruptedError, TrajectoryStore
from rlhf_pipeline.files.run_store import LocalRunStore, RunStore
from rlhf_pipeline.files.state_files import load_state_bytes

FORMAT_VERSION = 1
STATE_FILE = "state.pt"


class PendingGroups:
    """Rows of incomplete groups (``rows``) plus rows handed to the buffer but unconfirmed (``held``)."""

    def __init__(self, *, store: TrajectoryStore | None = None, directory: str | os.PathLike | None = None,
                 durable: bool = True, run_store: RunStore | None = None) -> None:
        self.store = store
        self.durable = durable
        self.rows: TrajectoryBatch | None = None
        self.held: TrajectoryBatch | None = None
        self.inflight_start: int | None = None
        self.inflight_rows = 0
        # metrics counters saved with the snapshot; the owning transform shares this dict
        self.counters: dict[str, int] = {}
        self._dirty = False
        # where the snapshot lives: a directory (a LocalRunStore over it), or a key in a run's store
        self._state: RunStore | None = None
        self._key = STATE_FILE
        if run_store is not None:
            if directory is None or not str(directory).strip("/"):
                raise ValueError("run_store= needs directory=, the key prefix of the pending groups in that store "
                                 "(such as collector/pending-shard-0000)")
            self._state, self._key = run_store, f"{str(directory).strip('/')}/{STATE_FILE}"
        else:
            if directory is None and store is not None:
                location = Path(store.location)
                if not location.is_dir():
                    raise ValueError(
                        f"store location {store.location!r} is not a local directory; pass pending_dir= "
                        "(and, for a run at a URL, pending_store=) to keep the pending groups somewhere durable")
                directory = location / "pending"
            if directory is not None:
                self._state = LocalRunStore(directory)
        self.location: str | None = None if self._state is None else self._state.describe(self._key)
        """Where the snapshot lives (a path or a URL), for messages; None when it is kept in memory only."""
        if self._state is not None:
            data = self._state.read(self._key)  # at a URL, also what the next fenced write replaces
            if data is not None:
                self.load_payload(self._decode(data))

    # ------------------------------------------------------------------ views
    @property
    def num_rows(self) -> int:
        return 0 if self.rows is None else len(self.rows)

    @property
    def num_groups(self) -> int:
        return 0 if self.rows is None else int(torch.unique(self.rows["group_id"]).numel())

    @property
    def num_trajectories(self) -> int:
        return 0 if self.rows is None else int(torch.unique(self.rows["trajectory_id"]).numel())

    def trajectory_ids(self) -> torch.Tensor:
        """Trajectory ids held pending (a resuming collector must not send these again)."""
        if self.rows is None:
            return torch.zeros(0, dtype=torch.int64)
        return torch.unique(self.rows["trajectory_id"])

    # ------------------------------------------------------------------ mutation
    def add(self, rows: TrajectoryBatch, *, persist: bool = True) -> None:
        self.rows = rows if self.rows is None else TrajectoryBatch.cat([self.rows, rows])
        self._dirty = True
        if persist:
            self.persist_if_dirty()

    def settle(self, *, done_groups: torch.Tensor, written_groups: torch.Tensor, num_out_rows: int) -> None:
        """Old pending rows of ``done_groups`` leave pending; those of ``written_groups`` are held."""
        if self.rows is None or done_groups.numel() == 0:
            return
        gid = self.rows["group_id"]
        leaving = torch.isin(gid, done_groups)
        held = torch.isin(gid, written_groups) if self.store is not None else torch.zeros_like(leaving)
        if bool(held.any()) and num_out_rows:
            self.held = self.rows.select(torch.nonzero(held).squeeze(1))
            self.inflight_start = self.store.next_row
            self.inflight_rows = num_out_rows
        keep = torch.nonzero(~leaving).squeeze(1)
        self.rows = self.rows.select(keep) if keep.numel() else None
        self._dirty = True

    def reconcile(self) -> None:
        """Settles the previous write's held rows against the store (see the module docstring)."""
        if self.held is None:
            return
        next_row = self.store.next_row
        if next_row > self.inflight_start:
            # appended; the snapshot on disk still lists them with the marker, which a
            # reload settles the same way, so no rewrite is needed now
            self.held, self.inflight_start = None, None
        elif next_row == self.inflight_start:
            self.rows = self.held if self.rows is None else TrajectoryBatch.cat([self.rows, self.held])
            self.held, self.inflight_start = None, None
            self._dirty = True
            self.persist_if_dirty()
        else:
            raise StoreCorruptedError(
                f"{self.store.location} has {next_row} rows but {self.inflight_start} were written before "
                "the last extend: the store was truncated or replaced under a running collector")

    # ------------------------------------------------------------------ persistence
    def persist_if_dirty(self) -> None:
        if not self._dirty or self._state is None:
            return
        payload = self.to_payload()
        # a directory: the same *.partial + rename (+ fsyncs) as ever; a URL: one fenced PUT
        self._state.write(self._key, lambda f: torch.save(payload, f), durable=self.durable)
        self._dirty = False

    def _decode(self, data: bytes) -> Mapping[str, Any]:
        if isinstance(self._state, LocalRunStore):
            return torch.load(io.BytesIO(data), weights_only=True)
        return load_state_bytes(data, what="pending-group state", where=self.location)

    def to_payload(self) -> dict[str, Any]:
        parts = [b for b in (self.rows, self.held) if b is not None]
        rows = TrajectoryBatch.cat(parts) if len(parts) > 1 else (parts[0] if parts else None)
        held_groups = (torch.unique(self.held["group_id"]) if self.held is not None
                       else torch.zeros(0, dtype=torch.int64))
        return {
            "format_version": FORMAT_VERSION,
            "rows": None if rows is None else encode_batch(rows),
            "held_groups": held_groups,
            "inflight_start": -1 if self.inflight_start is None else int(self.inflight_start),
            "inflight_rows": int(self.inflight_rows),
            "counters": dict(self.counters),
        }

    def load_state_payload(self, payload: Mapping[str, Any]) -> None:
        """``set_extra_state`` path (``rb.load_state_dict``): the on-disk state, when there is one, wins.

        The side store is rewritten on every change, so it is never older than a
        checkpoint; loading an older checkpoint over it could bring back groups that
        were completed and written since (a duplicate). A checkpoint therefore fills
        only a transform that has no pending state on disk (or none at all).
        """
        if self._state is not None and self._state.exists(self._key):
            ours = set(self.trajectory_ids().tolist())
            theirs = set() if payload["rows"] is None else \
                set(payload["rows"]["trajectory_id"].tolist())
            if ours != theirs:
                warnings.warn(
                    f"kept the pending groups in {self.location} ({len(ours)} trajectories) over the state_dict's "
                    f"({len(theirs)}): the on-disk state is the newer one", stacklevel=3)
            return
        self.load_payload(payload)

    def load_payload(self, payload: Mapping[str, Any]) -> None:
        version = payload.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(f"pending-group state has format version {version}; this code reads {FORMAT_VERSION}")
        self.counters.update({k: int(v) for k, v in payload.get("counters", {}).items()})
        rows = None if payload["rows"] is None else decode_batch(payload["rows"])
        held_groups = payload["held_groups"]
        self.held, self.inflight_start = None, None
        if rows is not None and held_groups.numel():
            is_held = torch.isin(rows["group_id"], held_groups)
            held = rows.select(torch.nonzero(is_held).squeeze(1))
            rest = torch.nonzero(~is_held).squeeze(1)
            rows = rows.select(rest) if rest.numel() else None
            if self.store is None:
                raise ValueError(
                    f"this pending state has groups {held_groups.tolist()} in flight to a buffer; load it "
                    "into a GroupAdvantage built with store= so they can be checked against that buffer")
            start, count = int(payload["inflight_start"]), int(payload["inflight_rows"])
            if not self._held_was_written(held_groups, start, count):
                rows = held if rows is None else TrajectoryBatch.cat([rows, held])
        self.rows = rows
        self._dirty = True
        self.persist_if_dirty()

    def _held_was_written(self, held_groups: torch.Tensor, start: int, count: int) -> bool:
        self.store.refresh()
        next_row = self.store.next_row
        if next_row == start:
            return False
        if next_row < start:
            raise StoreCorruptedError(
                f"{self.store.location} has {next_row} rows but the pending state recorded {start} before its "
                "last write: the store was truncated or replaced")
        # the held groups went into the append that started at ``start``; check they are there
        window = torch.arange(start, min(next_row, start + count))
        written = self.store.read_global(window)["group_id"]
        missing = held_groups[~torch.isin(held_groups, written)]
        if missing.numel():
            raise StoreCorruptedError(
                f"pending state says groups {missing.tolist()} were appended at row {start} of "
                f"{self.store.location}, but they are not there; the store does not match this pending state")
        return True


# ============================================================================ encoding
def encode_batch(batch: TrajectoryBatch) -> dict[str, torch.Tensor]:
    """A batch as a flat dict of tensors (safe for ``torch.load(weights_only=True)``)."""
    out: dict[str, torch.Tensor] = {}
    for name in batch.field_names:
        col = batch[name]
        if isinstance(col, RaggedTensor):
            out[f"{name}.values"], out[f"{name}.offsets"] = col.values, col.offsets
        elif isinstance(col, torch.Tensor):
            out[name] = col
        else:
            encoded = [s.encode("utf-8") for s in col]
            lengths = torch.tensor([len(b) for b in encoded], dtype=torch.int64)
            blob = b"".join(encoded)
            out[f"{name}.bytes"] = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else \
                torch.zeros(0, dtype=torch.uint8)
            out[f"{name}.offsets"] = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return out


def decode_batch(data: Mapping[str, torch.Tensor]) -> TrajectoryBatch:
    columns: dict[str, Any] = {}
    names = {key.split(".", 1)[0] for key in data}
    for name in names:
        kind = FIELDS_BY_NAME[name].kind
        if kind == "token":
            columns[name] = RaggedTensor(data[f"{name}.values"], data[f"{name}.offsets"])
        elif kind == "row":
            columns[name] = data[name]
        else:
            blob = data[f"{name}.bytes"].numpy().tobytes()
            offsets = data[f"{name}.offsets"].tolist()
            columns[name] = [blob[a:b].decode("utf-8") for a, b in zip(offsets[:-1], offsets[1:])]
    return TrajectoryBatch(columns)

