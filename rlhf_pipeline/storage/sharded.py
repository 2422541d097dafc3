"""A read-only union of several stores: how several collectors feed one learner.

Why one file: the union's positions are its shards' lengths as of one refresh; refreshing,
locating, reading and sharing a refresh with another reader all keep that one state consistent.

:class:`ShardedStoreReader` reads a buffer of ``shard-NNNN`` stores (one per collector, each with one
writer; a directory, or a URL prefix listed through fsspec) as one read-only ``TrajectoryStore``: its
positions are the shards' positions one after the other, and ``refresh()`` picks up new rows and shards.

Design: docs/storage.md#a-union-of-shards.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from rlhf_pipeline.schema import StoreSchema, TrajectoryBatch
from rlhf_pipeline.storage.base import (
    NotAStoreError,
    ReadOnlyStoreError,
    StoreClosedError,
    StoreCorruptedError,
    StoreStats,
    TrajectoryStore,
)
from rlhf_pipeline.storage.buffers import (  # noqa: F401 - the shard helpers, re-exported
    SHARD_PREFIX,
    combine_stats,
    is_sharded_buffer,
    is_url,
    join_shard,
    list_shards,
    shard_index,
    shard_key_of,
    shard_location,
    shard_name,
    shard_path,
)
from rlhf_pipeline.storage.padded_rows import LocatedRows


RELIST_S = 1.0  # a local buffer directory whose mtime did not change is listed at most this often
# requests in flight at once when refreshing (or opening) the shards of a buffer at a URL: each
# thread mostly waits on a GET that runs on zarr's event loop, so more threads than cores is right;
# local shards refresh from the page cache in microseconds and stay on the calling thread
REMOTE_REFRESH_THREADS = 32


def refresh_now(store: TrajectoryStore) -> int:
    """``store`` refreshed now, past a throttle of its own: the union (or a branch's continued shard)
    decides when to refresh, and a shard's own throttle, started a moment after, would otherwise skip
    every other refresh. Only a throttled store (``refresh_interval_s`` > 0: a Zarr reader at a URL, a
    continued shard over one) takes ``force=``."""
    if store.refresh_interval_s:
        return store.refresh(force=True)
    return store.refresh()


class ShardedStoreReader(TrajectoryStore):
    """Read-only union of the stores ``<location>/shard-*`` (docs/storage.md#a-union-of-shards)."""

    backend_name = "sharded"
    supports_field_subset = True

    def __init__(self, location: str | Path, *, refresh_interval_s: float | None = None,
                 refresh_threads: int | None = None, shards: list[tuple[int, str]] | None = None,
                 records: dict[str, dict[str, Any]] | None = None, **open_options: Any) -> None:
        """``refresh_threads``: shards refreshed (or opened) at once; default
        ``REMOTE_REFRESH_THREADS`` at a URL, 1 (one after another) on a local file system.
        ``shards``: the buffer's listing (:func:`list_shards`) when the caller just made it: the first
        refresh does not list again. ``records``: shard name -> commit record, as another reader of
        this buffer at a URL read them (``learn.shard_rows.published_view``): the reader opens in that
        view (:meth:`adopt_records`), sending no request."""
        super().__init__()
        self._path = str(location).rstrip("/") if is_url(location) else Path(location)
        self._open_options = open_options
        if refresh_interval_s is None:
            from rlhf_pipeline.storage.zarr.object_store import default_refresh_interval_s

            refresh_interval_s = default_refresh_interval_s(str(location))
        if not refresh_interval_s >= 0:
            raise ValueError(f"refresh_interval_s must be >= 0 seconds, got {refresh_interval_s!r}")
        self.refresh_interval_s = float(refresh_interval_s)
        if is_url(location):  # every shard at a URL is a Zarr store: it throttles its own record GETs
            self._open_options = {**open_options, "refresh_interval_s": self.refresh_interval_s}
        if refresh_threads is None:
            refresh_threads = REMOTE_REFRESH_THREADS if is_url(location) else 1
        if refresh_threads < 1:
            raise ValueError(f"refresh_threads must be >= 1, got {refresh_threads!r}")
        self._pool = ThreadPoolExecutor(refresh_threads, thread_name_prefix="shard-refresh") \
            if refresh_threads > 1 else None
        self._refreshed_at: float | None = None
        self._listing: tuple[tuple[int, int], float] | None = None  # (directory's (inode, mtime), when listed)
        self._shards: dict[int, TrajectoryStore] = {}
        self._names: dict[int, str] = {}  # shard index -> its name under the buffer (shard-0007, 70-shard-0007)
        self._skipped: dict[str, str] = {}  # shard name -> why it is not open (yet)
        self._order: list[int] = []
        self._lengths = torch.zeros(0, dtype=torch.int64)
        self._starts = torch.zeros(0, dtype=torch.int64)
        self._closed = False
        self._listed = shards  # used by the first discovery, instead of listing again
        try:
            if records is not None:
                self.adopt_records(records)
            else:
                self.refresh()
        except BaseException:
            self.close()
            raise
        if not self._shards:
            self.close()
            why = "; ".join(f"{k}: {v}" for k, v in self._skipped.items())
            raise NotAStoreError(
                f"{self._path} holds no readable shard store (shard-NNNN directories)"
                + (f": {why}" if why else "")
            )

    # ================================================================ shards
    @property
    def shards(self) -> dict[int, TrajectoryStore]:
        """The open shard stores by shard index (a copy)."""
        return dict(self._shards)

    @property
    def shard_names(self) -> dict[int, str]:
        """The open shards' names under the buffer by shard index (``shard-0007``, or at an object-store
        URL ``70-shard-0007``): each shard's key in row names and in the run's pacing file."""
        return {index: self._names[index] for index in self._order}

    def _discover(self) -> set[int]:
        """Opens the shards that appeared since the last listing; returns their indices."""
        if self._listing_current():
            return set()
        listed, self._listed = self._listed, None
        if listed is None:
            listed = list_shards(self._path, self._open_options.get("storage_options"))
        return self._open_shards([(index, path) for index, path in listed if index not in self._shards])

    def _open_shards(self, new: list[tuple[int, str]], records: dict[str, dict[str, Any]] | None = None) -> set[int]:
        """Opens the shards ``(index, location)`` together (from ``records[name]`` where given: no
        request); one still being created is skipped for now. Returns the indices opened."""
        from rlhf_pipeline.storage.backends import open_store
        from rlhf_pipeline.storage.zarr.from_record import open_reader

        reader_options = {key: value for key, value in self._open_options.items()
                          if key in ("cache_bytes", "storage_options", "refresh_interval_s")}

        def open_shard(item: tuple[int, str]) -> TrajectoryStore | Exception:
            index, path = item
            try:
                if records is not None and shard_key_of(path) in records:
                    return open_reader(path, records[shard_key_of(path)], **reader_options)
                return open_store(path, mode="r", **self._open_options)
            except Exception as exc:  # raised below, once every shard opened alongside is closed
                return exc

        opened = self._map(open_shard, new)
        failed = next((x for x in opened if isinstance(x, Exception) and not isinstance(x, NotAStoreError)), None)
        if failed is not None:
            for store in opened:
                if not isinstance(store, Exception):
                    store.close()
            raise failed
        for (index, path), store in zip(new, opened):
            if isinstance(store, NotAStoreError):
                # a shard being created by a collector right now (no metadata yet): try again later.
                # A damaged shard raises StoreCorruptedError: the union never reads silently shorter
                self._skipped[shard_key_of(path)] = str(store)
                continue
            if self._shards:
                expected = next(iter(self._shards.values())).schema
                if store.schema != expected:
                    for other in opened:
                        if not isinstance(other, Exception) and other not in self._shards.values():
                            other.close()
                    raise StoreCorruptedError(
                        f"shard {path} stores fields {store.schema.field_names}, the other shards of "
                        f"{self._path} store {expected.field_names}: every shard of a buffer needs one schema"
                    )
            self._skipped.pop(shard_key_of(path), None)
            self._shards[index] = store
            self._names[index] = shard_key_of(path)
        self._order = sorted(self._shards)
        return {index for (index, _), store in zip(new, opened) if not isinstance(store, Exception)}

    def _listing_current(self) -> bool:
        """Whether the last listing of a local buffer directory still holds: a learner polling for
        rows refreshes every millisecond or two, and listing the directory was half of that cost.
        A new shard directory changes the directory's mtime; a coarse mtime (whole seconds on
        some file systems) could hide one made in the same tick as the listing, so the directory
        is listed again at least every ``RELIST_S`` anyway, and always while a shard is still
        being created (it exists, but has no metadata yet)."""
        if is_url(self._path) or self._skipped:
            return False
        try:
            stat = self._path.stat()
        except OSError:
            return False
        now, seen = time.monotonic(), (stat.st_ino, stat.st_mtime_ns)
        if self._listing is not None and self._listing[0] == seen and now - self._listing[1] < RELIST_S:
            return True
        self._listing = (seen, now)  # taken before listing: a shard made meanwhile changes the mtime
        return False

    def refresh(self, *, force: bool = False) -> int:
        """Lists new shards and refreshes every shard, unless the last refresh was less than
        ``refresh_interval_s`` ago (``force`` refreshes anyway); returns the rows held."""
        if self._closed:
            raise StoreClosedError(f"{self._path}: the sharded reader is closed; open the buffer again")
        now = time.monotonic()
        if (not force and self._refreshed_at is not None and self._shards
                and now - self._refreshed_at < self.refresh_interval_s):
            return int(self._lengths.sum())
        self._refreshed_at = now
        opened = self._discover()  # each read its record just now: not read again

        def refreshed(index: int) -> int:
            shard = self._shards[index]
            return shard.next_row - shard.first_row if index in opened else refresh_now(shard)

        lengths = self._map(refreshed, self._order)
        self._lengths = torch.tensor(lengths, dtype=torch.int64)
        self._starts = torch.cumsum(self._lengths, 0) - self._lengths
        return int(self._lengths.sum())

    # ================================================================ one refresh, several readers
    def adopt_records(self, records: dict[str, dict[str, Any]]) -> None:
        """Takes ``records`` (shard name -> commit record, read by another reader's refresh of this
        buffer) as this reader's view: no LIST and no record GET. Shards not named keep the record
        they had. A shard not open here yet is opened from its record: no request either."""
        if self._closed:
            raise StoreClosedError(f"{self._path}: the sharded reader is closed; open the buffer again")
        indices = {name: shard_index(name) for name in records}
        if None in indices.values() or len(set(indices.values())) < len(indices):
            raise ValueError(f"{self._path}: the records' keys {sorted(records)} are not the names of distinct "
                             f"shards (shard-NNNN): pass learn.shard_rows.published_view()'s records as they are")
        by_index = {indices[name]: record for name, record in records.items()}
        missing = [(index, join_shard(self._path, name)) for name, index in indices.items() if index not in self._shards]
        if missing:
            self._open_shards(missing, records)
            unopened = [shard_key_of(path) for shard, path in missing if shard not in self._shards]
            if unopened:
                raise StoreCorruptedError(f"{self._path}: shards {unopened} hold no store, yet another reader of this "
                                          f"buffer read their commit records: {self._skipped}")
        for index, record in by_index.items():
            self._shards[index].adopt_record(record)
        self._refreshed_at = time.monotonic()
        self._lengths = torch.tensor([self._shards[i].next_row - self._shards[i].first_row for i in self._order],
                                     dtype=torch.int64)
        self._starts = torch.cumsum(self._lengths, 0) - self._lengths

    def _map(self, function: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
        """``[function(item) for item in items]``, on the refresh threads when there are several."""
        items = list(items)
        if self._pool is None or len(items) < 2:
            return [function(item) for item in items]
        return list(self._pool.map(function, items))

    def locate(self, positions: torch.Tensor | Sequence[int] | int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(shard index, local position)`` of each union position (as of the last refresh)."""
        positions = torch.as_tensor(positions, dtype=torch.int64).reshape(-1)
        slot = self._slots_of(positions)
        order = torch.tensor(self._order, dtype=torch.int64)
        return order[slot], positions - self._starts[slot]

    def shard_ranges(self) -> list[tuple[int, TrajectoryStore, int, int]]:
        """``(shard index, shard store, first union position, rows)`` per shard, as of the last refresh."""
        return [(index, self._shards[index], int(start), int(length))
                for index, start, length in zip(self._order, self._starts.tolist(), self._lengths.tolist())]

    def _slots_of(self, positions: torch.Tensor) -> torch.Tensor:
        ends = self._starts + self._lengths
        return torch.searchsorted(ends, positions, right=True)

    # ================================================================ contract
    @property
    def schema(self) -> StoreSchema:
        return self._shards[self._order[0]].schema

    @property
    def location(self) -> str:
        return str(self._path)

    @property
    def writable(self) -> bool:
        return False

    @property
    def first_row(self) -> int:
        return sum(s.first_row for s in self._shards.values())

    @property
    def next_row(self) -> int:
        return sum(s.next_row for s in self._shards.values())

    @property
    def supports_eviction(self) -> bool:
        return any(s.supports_eviction for s in self._shards.values())

    def _published_len(self) -> int:
        return int(self._lengths.sum())

    def append(self, batch: TrajectoryBatch | None, *, writer_state: bytes | None = None) -> torch.Tensor:
        raise ReadOnlyStoreError(
            f"{self._path} is a read-only union of shards; each collector appends to its own shard "
            f"(open_store('{shard_location(self._path, 0)}', mode='a') for shard 0)"
        )

    def _append_validated(self, batch, writer_state) -> None:  # pragma: no cover - append raises first
        raise ReadOnlyStoreError(f"{self._path} is a read-only union of shards")

    def read(self, positions: torch.Tensor | list[int] | int, *,
             fields: Sequence[str] | None = None) -> TrajectoryBatch:
        positions = self._checked_positions(positions)
        fields = self._checked_fields(fields)
        parts = [(shard.read(local, fields=fields), where) for shard, local, where in self._split(positions)]
        if len(parts) == 1:
            return parts[0][0]  # one shard: already in the requested order
        # rows come grouped by shard; put them back in the requested order
        inverse = torch.empty(positions.numel(), dtype=torch.int64)
        inverse[torch.cat([where for _, where in parts])] = torch.arange(positions.numel())
        return TrajectoryBatch.cat([rows for rows, _ in parts]).select(inverse)

    @property
    def supports_fused_padding(self) -> bool:
        return all(s.supports_fused_padding for s in self._shards.values())

    def _locate_rows(self, global_ids: torch.Tensor) -> LocatedRows:
        positions = global_ids - self.first_row
        parts = [(where.numpy(), shard._locate_rows(local + shard.first_row))
                 for shard, local, where in self._split(positions)]
        if len(parts) == 1:
            return parts[0][1]
        return LocatedRows.merge(parts, positions.numel(), self.schema)

    def _split(self, positions: torch.Tensor) -> list[tuple[TrajectoryStore, torch.Tensor, torch.Tensor]]:
        """Per shard holding some of ``positions`` (checked): (shard, its local positions, where they were)."""
        slots = self._slots_of(positions)
        used = torch.unique(slots).tolist() if positions.numel() else [0]
        parts = []
        for slot in used:
            mask = slots == slot
            parts.append((self._shards[self._order[slot]], positions[mask] - self._starts[slot],
                          torch.nonzero(mask).reshape(-1)))
        return parts

    def _read_global(self, global_ids: torch.Tensor, fields: Sequence[str] | None = None) -> TrajectoryBatch:
        # union "global ids" are positions offset by first_row (valid until the next refresh)
        return self.read(global_ids - self.first_row, fields=fields)

    def unit_bounds(self) -> list[tuple[int, int]]:
        """Each shard's units, shifted to the shard's place in the union (shards in index order)."""
        bounds = []
        for slot, index in enumerate(self._order):
            offset, length = int(self._starts[slot]), int(self._lengths[slot])
            bounds += [(offset + a, offset + min(b, length)) for a, b in self._shards[index].unit_bounds()
                       if a < length]
        return bounds

    def empty_shards(self) -> list[str]:
        """Names of the shards that hold no rows (as of the last refresh): collectors not yet heard from."""
        return [self._names[i] for i, n in zip(self._order, self._lengths.tolist()) if n == 0]

    def newest_positions(self, count: int) -> torch.Tensor:
        """Positions of the ``count`` newest rows: an even split across shards (ascending)."""
        lengths = self._lengths.tolist()
        take = [0] * len(lengths)
        remaining = min(max(count, 0), sum(lengths))
        while remaining > 0:
            active = [i for i, n in enumerate(lengths) if take[i] < n]
            share = max(1, remaining // len(active))
            for i in active:
                t = min(share, lengths[i] - take[i], remaining)
                take[i] += t
                remaining -= t
                if remaining == 0:
                    break
        parts = [torch.arange(int(self._starts[i]) + lengths[i] - take[i], int(self._starts[i]) + lengths[i])
                 for i in range(len(lengths)) if take[i]]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)

    def close(self) -> None:
        for store in self._shards.values():
            store.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._closed = True

    def stats(self) -> StoreStats:
        self.refresh(force=True)
        out = combine_stats(self.location, [self._shards[i].stats() for i in self._order], list(self.schema.optional))
        if self._skipped:
            out.extra["shards_not_open"] = "; ".join(f"{k}: {v}" for k, v in sorted(self._skipped.items()))
        return out

    def snapshot_to(self, path: str) -> None:
        """Copies every shard to ``<path>/<its name>`` (a sharded buffer again)."""
        Path(path).mkdir(parents=True, exist_ok=True)
        for index in self._order:
            self._shards[index].snapshot_to(str(Path(path) / self._names[index]))

    # ================================================================ resume checks
    def state_dict(self) -> dict[str, Any]:
        shards = {self._names[i]: self._shards[i].state_dict() for i in self._order}
        return {**super().state_dict(), "shards": shards}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Checks that every shard a saved state saw still holds at least the rows it saw."""
        self.refresh(force=True)
        if "shards" not in state_dict:
            super().load_state_dict(state_dict)
            return
        for name, saved in state_dict["shards"].items():
            index = shard_index(name)
            index = -1 if index is None else index
            if index not in self._shards:
                raise StoreCorruptedError(
                    f"{self._path}: the saved state saw shard {name}, which is no longer there"
                )
            self._shards[index].load_state_dict(saved)

    def __repr__(self) -> str:
        return (f"ShardedStoreReader({self.location!r}, shards={len(self._shards)}, "
                f"rows={self._published_len()})")
