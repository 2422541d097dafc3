"""Past collector states, one per round, so a branch can restart a collector where it stood at a step.

``collect/position.py`` keeps only where a collector stands now. A branch of a run at step N
(``runs/branch_online.py``) needs where each collector stood when its shard held exactly the rows
the learner's checkpoint of step N recorded (``checkpoints/step_N.json``, ``buffer_rows``): the prompt
position, id counters, sampling RNG and the pacing counts of the collect loop. This module keeps
those states: one object per committed round, keyed by the shard's ``next_row`` once the round was
written::

    collector/shard-0000.history/row_000000000064.pt    {"format": 1, "next_row": 64,
                                                          "committed": state, "loop": {...}}

Each entry is written whole (the run store's atomic write: a file renamed into place, or one PUT),
so a ``kill -9`` mid-append leaves the entry there or not, never a part; a missing entry is written
again by the next start (:meth:`CollectorPosition.load` records the state it resumes from, which is
the state after the newest written round). Writing the same entry twice writes the same state.

Kept on the checkpoint schedule: once the kept checkpoints change (looked at after each append),
entries are deleted unless a kept checkpoint recorded their row count, or they are at or past the
newest checkpoint's (a later checkpoint may record them). So a run keeps a few KB per kept
checkpoint plus the rounds since the newest.
Entries load with ``weights_only=True`` (``files/state_files.py``), like the position file.

The weights its rounds sampled with. A paced round samples with the version pacing names for it
(``coordination/pacing.py``), which may be older than the learner's at a checkpoint; the learner
prunes old versions long before a branch is made. So in a run directory the history also keeps a
hard link to the weights file of each version a kept state held (``policy_*`` beside the entries):
for a kept checkpoint of step N, versions from the one its collector held at its rows up to N (the
rounds after those rows sampled with versions in between, until the learner's later ones), and
every version from the one the state at the newest checkpoint's rows held on. A hard link costs no
space while the learner keeps the file; afterwards a version stays while a checkpoint needs it.
At a URL (no hard links) the same versions are kept as server-side copies of the run's weights
objects (``policy_<version>.<suffix>`` beside the entries; S3's CopyObject, no bytes through this
machine), copied once per version a state held and pruned by the same rule.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlhf_pipeline.files.run_store import LocalRunStore, RunStore
from rlhf_pipeline.files.state_files import load_state_bytes

HISTORY_FORMAT = 1
HISTORY_SUFFIX = ".history"
_ENTRY = re.compile(r"row_(\d{12})\.pt$")
_KEPT_WEIGHTS = re.compile(r"^policy_(\d{8})(\.safetensors|\.pt)?$")  # a link (a run directory) or a copy (a URL)
_WEIGHTS_PREFIX = "policy_"  # + the version (8 digits): a hard link to the run's weights file


def history_key(position_key: str) -> str:
    """The history's key prefix beside the position file ``collector/shard-0000.pt``."""
    stem = position_key[:-3] if position_key.endswith(".pt") else position_key
    return stem + HISTORY_SUFFIX


class PositionHistory:
    """The committed states of one collector by the shard's row count (module docstring).

    ``kept()``: ``(rows, policy_version)`` of each kept checkpoint: the row count it recorded for
    this collector's shard and its policy version (None: no checkpoint yet, nothing is pruned).
    ``weights_file(version)``: the run's weights file of a version (a run directory), whose hard
    link the history keeps; None keeps none. ``weights_object(version)``: at a URL, the key of the
    run's weights object of a version (None: gone), which the history copies. ``pending()``: the shard's
    pending-groups snapshot (``transforms/pending_groups.py``; None when there is none), kept with each
    state as it was at the commit: rows of groups not whole yet, which a branch's collector would need too."""

    def __init__(self, run_store: RunStore, prefix: str,
                 kept: Callable[[], list[tuple[int, int]] | None] = lambda: None,
                 weights_file: Callable[[int], Path] | None = None,
                 pending: Callable[[], bytes | None] | None = None,
                 weights_object: Callable[[int], str | None] | None = None) -> None:
        self._store = run_store
        self._pending = pending
        self._prefix = prefix.strip("/")
        self._kept = kept
        self._weights_file = weights_file if isinstance(run_store, LocalRunStore) else None
        self._weights_object = None if isinstance(run_store, LocalRunStore) else weights_object
        self._copied: set[int] = set()  # versions this process copied already (a URL)
        self._held: dict[int, int | None] = {}  # row count -> the version its state held (read once)
        self._pruned_for: list[tuple[int, int]] | None = None  # entries become prunable only when this changes

    def _key(self, next_row: int) -> str:
        return f"{self._prefix}/row_{int(next_row):012d}.pt"

    def rows(self) -> list[int]:
        """The row counts an entry is kept for, ascending (partial writes are not entries)."""
        return sorted(int(m.group(1)) for name in self._store.list(self._prefix)
                      if (m := _ENTRY.search(name)))

    def record(self, next_row: int, state: dict[str, Any], loop: dict[str, Any] | None) -> None:
        """Keeps ``state`` (and the loop's pacing counts) as where the collector stood at ``next_row``;
        then prunes what no kept checkpoint needs."""
        import torch

        payload = {"format": HISTORY_FORMAT, "next_row": int(next_row), "committed": state,
                   "loop": dict(loop or {})}
        snapshot = None if self._pending is None else self._pending()
        if snapshot is not None:
            payload["pending"] = snapshot
        held = _held_version(state)
        if held is not None and self._weights_file is not None:
            self._link_weights(held)  # first: the entry is what needs it
        elif held is not None and self._weights_object is not None and held not in self._copied:
            self._copy_weights(held)
        self._store.write(self._key(next_row), lambda f: torch.save(payload, f), fence=False)
        self._held[int(next_row)] = held
        self.prune()

    def has(self, next_row: int) -> bool:
        return self._store.exists(self._key(next_row))

    def state_at(self, next_row: int) -> dict[str, Any] | None:
        """``{"committed": state, "loop": {...}}`` at ``next_row``, or None when none is kept."""
        data = self._store.read(self._key(next_row))
        if data is None:
            return None
        payload = load_state_bytes(data, what="collector position history",
                                   where=self._store.describe(self._key(next_row)))
        return {"committed": payload["committed"], "loop": dict(payload.get("loop") or {}),
                "pending": payload.get("pending")}

    def weights(self, version: int) -> Path | None:
        """The kept weights file of ``version``, or None."""
        if not isinstance(self._store, LocalRunStore):
            return None
        path = self._store.path(f"{self._prefix}/{_WEIGHTS_PREFIX}{int(version):08d}")
        return path if path.is_file() else None

    def weights_key(self, version: int) -> str | None:
        """The key of the kept weights object of ``version`` in the history's store (a run at a URL), or None."""
        for name in self._store.list(self._prefix):
            match = _KEPT_WEIGHTS.match(name)
            if match and int(match.group(1)) == int(version):
                return f"{self._prefix}/{name}"
        return None

    def _copy_weights(self, version: int) -> None:
        source = self._weights_object(version)
        if source is None:
            return  # pruned by the learner before this round was committed
        try:
            self._store.copy(source, f"{self._prefix}/{source.rsplit('/', 1)[-1]}")
        except FileNotFoundError:
            return  # pruned between the listing and the copy
        self._copied.add(int(version))

    def _link_weights(self, version: int) -> None:
        import os
        import shutil

        target = self._store.path(f"{self._prefix}/{_WEIGHTS_PREFIX}{int(version):08d}")
        source = self._weights_file(version)
        if target.exists() or not source.is_file():
            return  # kept already, or pruned by the learner before this round was committed
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".partial")
        partial.unlink(missing_ok=True)
        try:
            os.link(source, partial)
        except FileNotFoundError:
            return
        except OSError:  # no hard links here: a copy
            shutil.copyfile(source, partial)
        partial.replace(target)

    def held_at(self, next_row: int) -> int | None:
        """The policy version the state at ``next_row`` held (None: no such state, or it does not say)."""
        if next_row not in self._held:
            state = self.state_at(next_row)
            self._held[next_row] = None if state is None else _held_version(state["committed"])
        return self._held[next_row]

    def prune(self) -> list[int]:
        """Deletes the entries (and weights links) no kept checkpoint needs; returns the entries' row counts."""
        kept = self._kept()
        if not kept or kept == self._pruned_for:
            return []
        self._pruned_for = list(kept)
        needed, newest = {rows for rows, _ in kept}, max(rows for rows, _ in kept)
        gone = [row for row in self.rows() if row < newest and row not in needed]
        for row in gone:
            self._store.delete(self._key(row))
            self._held.pop(row, None)
        if self._weights_file is not None or self._weights_object is not None:
            self._prune_weights(kept, newest)
        return gone

    def _prune_weights(self, kept: list[tuple[int, int]], newest: int) -> None:
        spans = [(held, version) for rows, version in kept if (held := self.held_at(rows)) is not None]
        tail = [held for row in self.rows() if row >= newest and (held := self.held_at(row)) is not None]
        since = min(tail) if tail else None
        for name in self._store.list(self._prefix):
            if (match := _KEPT_WEIGHTS.match(name)) is None:
                continue
            version = int(match.group(1))
            if not (any(low <= version <= high for low, high in spans) or (since is not None and version >= since)):
                self._store.delete(f"{self._prefix}/{name}")
                self._copied.discard(version)


def _held_version(state: dict[str, Any] | None) -> int | None:
    version = (state or {}).get("policy_version")
    return int(version) if isinstance(version, int) and not isinstance(version, bool) else None
