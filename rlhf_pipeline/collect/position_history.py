"""Past collector states, one per append (:class:`PositionHistory`), so a branch can restart a collector
where it stood at a step (``runs/branch_online.py``): each entry is the ``writer_state`` published with
the shard's rows up to a row count, kept while a kept checkpoint recorded that count, beside the weights
versions those states held (the learner prunes old weights long before a branch is made).
Design: docs/branching.md#continuing-online.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from rlhf_pipeline.files.run_store import LocalRunStore, RunStore
from rlhf_pipeline.storage import writer_state as writer_states

HISTORY_SUFFIX = ".history"
_ENTRY = re.compile(r"row_(\d{12})\.pt$")
_KEPT_WEIGHTS = re.compile(r"^policy_(\d{8})(\.safetensors|\.pt)?$")  # a link (a run directory) or a copy (a URL)
_WEIGHTS_PREFIX = "policy_"  # + the version (8 digits) and its file's suffix: the run's weights of it, kept


def history_key(position_key: str) -> str:
    """The history's key prefix beside the position file ``collector/shard-0000.pt``."""
    stem = position_key[:-3] if position_key.endswith(".pt") else position_key
    return stem + HISTORY_SUFFIX


class PositionHistory:
    """The committed states of one collector by the shard's row count.

    A shard's store keeps only its last ``writer_state``; a branch at step N needs the one published
    with the rows the checkpoint of step N recorded (``buffer_rows``). Each entry is that state, byte for
    byte, keyed by the shard's ``next_row`` (``collector/shard-0000.history/row_000000000064.pt``),
    written whole by the run store (a missing one is written again by the next start) and loaded with
    ``weights_only=True``. Entries are pruned once no kept checkpoint recorded their row count (those at
    or past the newest checkpoint's stay). The versions their states held are kept beside them
    (``policy_<version>``: a hard link to the weights file in a run directory, a server-side copy of the
    object at a URL), pruned by the same rule.

    ``kept()``: ``(rows, policy_version)`` of each kept checkpoint: the row count it recorded for
    this collector's shard and its policy version (None: no checkpoint yet, nothing is pruned).
    ``weights_file(version)``: the run's weights file of a version (a run directory), whose hard
    link the history keeps; None keeps none. ``weights_object(version)``: at a URL, the keys the
    run's weights object of a version may have, likeliest first (the history copies the first that
    exists; none: gone)."""

    def __init__(self, run_store: RunStore, prefix: str,
                 kept: Callable[[], list[tuple[int, int]] | None] = lambda: None,
                 weights_file: Callable[[int], Path] | None = None,
                 weights_object: Callable[[int], Iterable[str]] | None = None) -> None:
        self._store = run_store
        self._prefix = prefix.strip("/")
        self._kept = kept
        self._weights_file = weights_file if isinstance(run_store, LocalRunStore) else None
        self._weights_object = None if isinstance(run_store, LocalRunStore) else weights_object
        self._copied: set[int] = set()  # versions this process kept already
        self._held: dict[int, int | None] = {}  # row count -> the version its state held (read once)
        self._pruned_for: list[tuple[int, int]] | None = None  # entries become prunable only when this changes

    def _key(self, next_row: int) -> str:
        return f"{self._prefix}/row_{int(next_row):012d}.pt"

    def rows(self) -> list[int]:
        """The row counts an entry is kept for, ascending (partial writes are not entries)."""
        return sorted(int(m.group(1)) for name in self._store.list(self._prefix)
                      if (m := _ENTRY.search(name)))

    def record(self, next_row: int, writer_state: bytes) -> None:
        """Keeps ``writer_state`` (the store's, published with its rows up to ``next_row``) as where the
        collector stood at ``next_row``; then prunes what no kept checkpoint needs."""
        held = held_version(self._decode(writer_state, self._key(next_row))["committed"])
        if held is not None and held not in self._copied:
            self._keep_weights(held)  # first: the entry is what needs it
        self._store.write(self._key(next_row), writer_state, fence=False)
        self._held[int(next_row)] = held
        self.prune()

    def has(self, next_row: int) -> bool:
        return self._store.exists(self._key(next_row))

    def state_at(self, next_row: int) -> dict[str, Any] | None:
        """``{"committed": collector state, "loop": its runner's state, "pending_rows": rows of groups
        not whole yet in its write path}`` at ``next_row``, or None when none is kept."""
        data = self._store.read(self._key(next_row))
        return None if data is None else self._decode(data, self._key(next_row))

    def _decode(self, data: bytes, key: str) -> dict[str, Any]:
        published = writer_states.decode(data, self._store.describe(key))
        committed = dict(published["writer"] or {})
        loop = dict(committed.pop("runner", None) or {})
        pending = sum(int(p["rows"]["group_id"].numel()) for p in published["write_path"]
                      if isinstance(p, dict) and p.get("rows") is not None)
        return {"committed": committed, "loop": loop, "pending_rows": pending}

    def weights_key(self, version: int) -> str | None:
        """The key of the kept weights object of ``version`` in the history's store (a run at a URL), or None."""
        for name in self._store.list(self._prefix):
            match = _KEPT_WEIGHTS.match(name)
            if match and int(match.group(1)) == int(version):
                return f"{self._prefix}/{name}"
        return None

    def _keep_weights(self, version: int) -> None:
        """The run's weights of ``version`` kept beside the entries (``RunStore.copy``: a hard link in a
        run directory, a server-side copy at a URL); nothing when the learner pruned them first."""
        if self._weights_file is not None:
            path = self._weights_file(version)
            source, keys = LocalRunStore(path.parent), [path.name]
        elif self._weights_object is not None:
            source, keys = self._store, self._weights_object(version)
        else:
            return
        for key in keys:
            suffix = Path(key).suffix if Path(key).suffix in (".safetensors", ".pt") else ""
            target = f"{self._prefix}/{_WEIGHTS_PREFIX}{int(version):08d}{suffix}"
            try:
                # a link replaces its target before it is made: one kept already is not risked on a pruned
                # source. A server-side copy replaces it only once made, so at a URL no HEAD goes first
                if self._weights_file is None or not self._store.exists(target):
                    self._store.copy(key, target, source=source)
            except FileNotFoundError:
                continue  # not under this name, or pruned by the learner before this round was committed
            self._copied.add(int(version))
            return

    def held_at(self, next_row: int) -> int | None:
        """The policy version the state at ``next_row`` held (None: no such state, or it does not say)."""
        if next_row not in self._held:
            state = self.state_at(next_row)
            self._held[next_row] = None if state is None else held_version(state["committed"])
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


def held_version(state: dict[str, Any] | None) -> int | None:
    """The policy version a collector state (or a checkpoint's record) says it held, else None."""
    version = (state or {}).get("policy_version")
    return int(version) if isinstance(version, int) and not isinstance(version, bool) else None
