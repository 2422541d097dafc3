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

Kept on the checkpoint schedule: after each append, entries are deleted unless a kept checkpoint
recorded their row count, or they are at or past the newest checkpoint's (a later checkpoint may
record them). So a run keeps a few KB per kept checkpoint plus the rounds since the newest.
Entries load with ``weights_only=True`` (``files/state_files.py``), like the position file.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from rlhf_pipeline.files.run_store import RunStore
from rlhf_pipeline.files.state_files import load_state_bytes

HISTORY_FORMAT = 1
HISTORY_SUFFIX = ".history"
_ENTRY = re.compile(r"row_(\d{12})\.pt$")


def history_key(position_key: str) -> str:
    """The history's key prefix beside the position file ``collector/shard-0000.pt``."""
    stem = position_key[:-3] if position_key.endswith(".pt") else position_key
    return stem + HISTORY_SUFFIX


class PositionHistory:
    """The committed states of one collector by the shard's row count (module docstring).

    ``kept_rows()``: the row counts the kept checkpoints recorded for this collector's shard,
    oldest checkpoint first (None: no checkpoint yet, nothing is pruned)."""

    def __init__(self, run_store: RunStore, prefix: str,
                 kept_rows: Callable[[], list[int] | None] = lambda: None) -> None:
        self._store = run_store
        self._prefix = prefix.strip("/")
        self._kept_rows = kept_rows

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
        self._store.write(self._key(next_row), lambda f: torch.save(payload, f), fence=False)
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
        return {"committed": payload["committed"], "loop": dict(payload.get("loop") or {})}

    def prune(self) -> list[int]:
        """Deletes the entries no kept checkpoint needs; returns their row counts."""
        kept = self._kept_rows()
        if not kept:
            return []
        needed, newest = set(kept), max(kept)
        gone = [row for row in self.rows() if row < newest and row not in needed]
        for row in gone:
            self._store.delete(self._key(row))
        return gone
