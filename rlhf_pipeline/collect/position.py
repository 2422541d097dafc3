"""Where a collector stands, saved so that a crash at any moment neither repeats nor skips a round.

A round has two durable effects: rows appended to the collector's store (one atomic
append) and the collector's state (prompt position, id counters, sampling RNG). They
cannot be written in one step, and either order alone is wrong after ``kill -9``
between the two: state first loses the round (its prompts are skipped), rows first
writes the round twice on restart (its prompts are trained twice).

So the state file records the round in flight. Before the rows go to the store, it
is rewritten with the state *after* the round and the store's ``next_row`` at that
moment (``store_next_row``); after the append it holds just the new state. The
collector is the store's only writer (the store's lock), and an append is atomic, so
on reload:

* ``store.next_row > store_next_row``: the round was written; resume after it;
* otherwise it was not (crash before or during the append): resume before it, and
  the same prompts are sampled again with the same RNG state and ids.

A round whose rows were all dropped before the store (e.g. every group had zero reward
variance and dynamic sampling dropped it) leaves ``next_row`` unchanged and is collected
again on restart; nothing was stored, so nothing is trained twice.

File format: ``{"format": 1, "committed": state | None, "inflight": {...} | None}``
written with :func:`~rlhf_pipeline.files.atomic.save_torch_atomic`; a bare state dict
(older runs) reads as committed. It holds tensors and plain values only and loads with
``weights_only=True`` (``rlhf_pipeline/files/state_files.py``), so a file planted in a shared run
directory cannot run code in the collector.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rlhf_pipeline.files.atomic import save_torch_atomic
from rlhf_pipeline.files.state_files import load_state

FORMAT_VERSION = 1


class CollectorPosition:
    """The state file of one collector writing one store (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, store: Any) -> None:
        self.path = Path(path)
        self.store = store
        self._committed: dict[str, Any] | None = None
        self.resumed_inflight_round = False  # load() found the round in flight written

    def load(self) -> dict[str, Any] | None:
        """The collector state to resume from, or None for a fresh collector."""
        if not self.path.exists():
            return None
        payload = load_state(self.path, what="collector position")
        if "format" not in payload:  # a bare state dict
            self._committed = payload
            return payload
        self._committed = payload["committed"]
        inflight = payload.get("inflight")
        if inflight is not None and self.store.next_row > int(inflight["store_next_row"]):
            self._committed = inflight["state"]
            self.resumed_inflight_round = True
        return self._committed

    def before_write(self, state_after_round: dict[str, Any]) -> None:
        """Records the round about to be appended; call right before the append."""
        save_torch_atomic({
            "format": FORMAT_VERSION,
            "committed": self._committed,
            "inflight": {"state": state_after_round, "store_next_row": int(self.store.next_row)},
        }, self.path)

    def after_write(self, state: dict[str, Any]) -> None:
        """The round is in the store: ``state`` is where the collector now stands."""
        self._committed = state
        save_torch_atomic({"format": FORMAT_VERSION, "committed": state, "inflight": None}, self.path)
