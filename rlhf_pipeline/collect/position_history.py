"""Past collector states, one per append (:class:`PositionHistory`), so a branch can restart a collector
where it stood at a step (``runs/branch_online.py``): each entry is the ``writer_state`` published with
the shard's rows up to a row count, kept while a kept checkpoint recorded that count. The weights
versions a branch samples with are the learner's to keep (``learn/learner.py``); a history made before
that keeps links to them (:meth:`PositionHistory.weights_key`).
Design: docs/branching.md#continuing-online.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from rlhf_pipeline.coordination.branch_weights import held_version
from rlhf_pipeline.files.run_store import RunStore
from rlhf_pipeline.storage import writer_state as writer_states

_ENTRY = re.compile(r"row_(\d{12})\.pt$")
# the weights of a version a history made before the learner kept them held: a link (a run directory) or a copy (a URL)
_KEPT_WEIGHTS = re.compile(r"^policy_(\d{8})(\.safetensors|\.pt)?$")


def history_key(position_key: str) -> str:
    """The history's key prefix beside the position file ``collector/shard-0000.pt``."""
    return position_key.removesuffix(".pt") + ".history"


class PositionHistory:
    """The committed states of one collector by the shard's row count.

    A shard's store keeps only its last ``writer_state``; a branch at step N needs the one published
    with the rows the checkpoint of step N recorded (``buffer_rows``). Each entry is that state, byte for
    byte, keyed by the shard's ``next_row`` (``collector/shard-0000.history/row_000000000064.pt``),
    written whole by the run store (a missing one is written again by the next start) and loaded with
    ``weights_only=True``. Entries are pruned once no kept checkpoint recorded their row count (those at
    or past the newest checkpoint's stay).

    ``kept()``: the row count each kept checkpoint recorded for this collector's shard (None: no
    checkpoint yet, nothing is pruned)."""

    def __init__(self, run_store: RunStore, prefix: str, kept: Callable[[], list[int] | None] = lambda: None) -> None:
        self._store = run_store
        self._prefix = prefix.strip("/")
        self._kept = kept
        self._pruned_for: list[int] | None = None  # entries become prunable only when this changes

    def _key(self, next_row: int) -> str:
        return f"{self._prefix}/row_{int(next_row):012d}.pt"

    def rows(self) -> list[int]:
        """The row counts an entry is kept for, ascending (partial writes are not entries)."""
        return sorted(int(m.group(1)) for name in self._store.list(self._prefix)
                      if (m := _ENTRY.search(name)))

    def record(self, next_row: int, writer_state: bytes) -> None:
        """Keeps ``writer_state`` (the store's, published with its rows up to ``next_row``) as where the
        collector stood at ``next_row``; then prunes what no kept checkpoint needs."""
        self._store.write(self._key(next_row), writer_state, fence=False)
        self.prune()

    def has(self, next_row: int) -> bool:
        return self._store.exists(self._key(next_row))

    def state_at(self, next_row: int) -> dict[str, Any] | None:
        """``{"committed": collector state, "loop": its runner's state, "pending_rows": rows of groups
        not whole yet in its write path}`` at ``next_row``, or None when none is kept."""
        key = self._key(next_row)
        if (data := self._store.read(key)) is None:
            return None
        published = writer_states.decode(data, self._store.describe(key), remedy=(
            "a branch cannot then continue online from the step it was kept for: branch from another kept step, "
            "or continue offline with rlhf-pipeline replay"))
        committed = dict(published["writer"] or {})
        loop = dict(committed.pop("runner", None) or {})
        pending = sum(int(p["rows"]["group_id"].numel()) for p in published["write_path"]
                      if isinstance(p, dict) and p.get("rows") is not None)
        return {"committed": committed, "loop": loop, "pending_rows": pending}

    def weights_key(self, version: int) -> str | None:
        """The key of the weights of ``version`` a history made before the learner kept them holds, or None."""
        for name in self._store.list(self._prefix):
            match = _KEPT_WEIGHTS.match(name)
            if match and int(match.group(1)) == int(version):
                return f"{self._prefix}/{name}"
        return None

    def held_at(self, next_row: int) -> int | None:
        """The policy version the state at ``next_row`` held (None: no such state, or it does not say)."""
        state = self.state_at(next_row)
        return None if state is None else held_version(state["committed"])

    def prune(self) -> list[int]:
        """Deletes the entries no kept checkpoint needs, and the weights links of an older history that
        no entry left needs; returns the entries' row counts."""
        kept = self._kept()
        if not kept or kept == self._pruned_for:
            return []
        self._pruned_for = list(kept)
        names = self._store.list(self._prefix)
        rows = sorted(int(m.group(1)) for name in names if (m := _ENTRY.search(name)))
        gone = [row for row in rows if row < max(kept) and row not in kept]
        for row in gone:
            self._store.delete(self._key(row))
        self._prune_links(names, [row for row in rows if row not in gone], kept)
        return gone

    def _prune_links(self, names: list[str], rows: list[int], kept: list[int]) -> None:
        """A branch from an entry's rows samples first with the version that entry held: the links of a
        history made before the learner kept versions (:meth:`weights_key`) older than every version an
        entry left held are needed by none. A kept row without its entry, or an entry that does not say
        or cannot be read, keeps them all."""
        links = {int(m.group(1)): name for name in names if (m := _KEPT_WEIGHTS.match(name))}
        if not links or not set(kept) <= set(rows):
            return
        held = []
        for row in rows:
            try:
                version = self.held_at(row)
            except ValueError:  # damaged (StateFileError) or of another format: what it held is unknown
                return
            if version is None:
                return
            held.append(version)
        for version, name in links.items():
            if version < min(held):
                self._store.delete(f"{self._prefix}/{name}")
