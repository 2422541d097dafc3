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

A streamed round (``stream_groups``: ``collect/streaming.py``) is several appends, each of whole
groups in request order. Before the first of them the file records the round's *start* state and
``next_row`` then (``round_start_row``); before the last, as above, the state after it. On reload,
when rows were appended since ``round_start_row`` but the round's last append is not known to have
landed, the collector resumes from the round's start state with ``resume_after_group_id``: the
largest ``group_id`` stored since then (groups are written in order, and a group dropped by dynamic
sampling never reaches the store, so the largest one stored says how far the round got). It
generates the round again from the same state (same prompts, seeds and ids) and writes only the
groups after that one: every trajectory is stored once, and the rows are the uninterrupted run's.

A round whose rows were all dropped before the store (e.g. every group had zero reward
variance and dynamic sampling dropped it) leaves ``next_row`` unchanged and is collected
again on restart; nothing was stored, so nothing is trained twice.

The caller's own state goes beside the collector's (``loop``: ``collect`` keeps its pacing counts
there, the rounds written with the current weights and the size of a round learned so far, so a
restarted collector paces its next rounds as the uninterrupted one would), with the same rule:
the loop state saved with the round in flight counts once that round is found written.

File format: ``{"format": 1, "committed": state | None, "loop": {...}, "inflight": {...} | None}``
written atomically through the run's store (``files/run_store.py``: a file replaced by rename, or at
a URL one fenced PUT, so a superseded collector cannot overwrite its successor's position); a bare state dict
(older runs) reads as committed. It holds tensors and plain values only and loads with
``weights_only=True`` (``rlhf_pipeline/files/state_files.py``), so a file planted in a shared run
directory cannot run code in the collector.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rlhf_pipeline.files.run_store import LocalRunStore, RunStore
from rlhf_pipeline.files.state_files import load_state, load_state_bytes

FORMAT_VERSION = 1


class CollectorPosition:
    """The state file of one collector writing one store (see the module docstring).

    ``store``: the run's store when the run lives at a URL; ``path`` is then the key in it."""

    def __init__(self, path: str | os.PathLike, store: Any, *, run_store: RunStore | None = None) -> None:
        self.path = path if run_store is not None else Path(path)
        self._run_store: RunStore = run_store if run_store is not None else LocalRunStore(Path(path).parent)
        self._key = str(path) if run_store is not None else Path(path).name
        self.store = store
        self._committed: dict[str, Any] | None = None
        self.resumed_inflight_round = False  # load() found the round in flight written
        self.inflight_rows = 0  # and that many rows were appended by it
        self.resumed_partial_round = 0  # load() found that many rows of a streamed round stored, not all of it
        self._round_start_row: int | None = None  # a streamed round's first append is done or under way
        self._round_start: dict[str, Any] | None = None  # and the collector's state before that round
        self.loop: dict[str, Any] = {}  # the caller's state that goes with the state load() returned
        # past committed states by row count (collect/position_history.py), for branches; None: not kept
        self.history: Any = None

    def load(self) -> dict[str, Any] | None:
        """The collector state to resume from, or None for a fresh collector."""
        if isinstance(self._run_store, LocalRunStore):
            if not Path(self.path).exists():
                return None
            payload = load_state(self.path, what="collector position")
        else:
            data = self._run_store.read(self._key)  # also what the next fenced write replaces
            if data is None:
                return None
            payload = load_state_bytes(data, what="collector position", where=self._run_store.describe(self._key))
        if "format" not in payload:  # a bare state dict
            self._committed = payload
            return payload
        self._committed = payload["committed"]
        self.loop = dict(payload.get("loop") or {})
        inflight = payload.get("inflight")
        if inflight is None:
            return self._committed
        if inflight["state"] is not None and self.store.next_row > int(inflight["store_next_row"]):
            self._committed = inflight["state"]
            self.loop = dict(inflight.get("loop") or {})
            self.resumed_inflight_round = True
            self.inflight_rows = int(self.store.next_row) - int(inflight.get("round_start_row",
                                                                              inflight["store_next_row"]))
        elif inflight.get("round_start_row") is not None and self.store.next_row > int(inflight["round_start_row"]):
            start = int(inflight["round_start_row"])
            stored = self.store.read_global(list(range(start, self.store.next_row)), fields=["group_id"])
            self._committed = {**inflight["round_start_state"],
                               "resume_after_group_id": int(stored["group_id"].max())}
            self.resumed_partial_round = self.store.next_row - start
            return self._committed  # cut inside a round: no history entry at a row count inside one
        self._keep_in_history(self._committed, self.loop, only_if_missing=True)  # a kill came before its entry?
        return self._committed

    def before_first_chunk(self, state_at_round_start: dict[str, Any]) -> None:
        """Records that a streamed round is about to be appended in several chunks; call right before
        the first. ``state_at_round_start``: the collector's state before the round (what a restart
        generates the round again from)."""
        self._round_start_row = int(self.store.next_row)
        self._save({
            "format": FORMAT_VERSION,
            "committed": self._committed,
            "loop": self.loop,
            "inflight": {"state": None, "store_next_row": self._round_start_row, "loop": None,
                         "round_start_row": self._round_start_row, "round_start_state": state_at_round_start},
        })
        self._round_start = state_at_round_start

    def before_write(self, state_after_round: dict[str, Any], loop: dict[str, Any] | None = None) -> None:
        """Records the round about to be appended; call right before the append. ``loop``: the
        caller's state once the round is written (its row count aside: see ``inflight_rows``)."""
        inflight = {"state": state_after_round, "store_next_row": int(self.store.next_row), "loop": dict(loop or {})}
        if self._round_start_row is not None:  # the last append of a streamed round: its earlier ones are in
            inflight.update(round_start_row=self._round_start_row, round_start_state=self._round_start)
        self._save({"format": FORMAT_VERSION, "committed": self._committed, "loop": self.loop, "inflight": inflight})

    def after_write(self, state: dict[str, Any], loop: dict[str, Any] | None = None) -> None:
        """The round is in the store: ``state`` is where the collector now stands (``loop``: the caller's)."""
        self._committed = state
        self.loop = dict(loop or {})
        self._round_start_row = None
        self._keep_in_history(state, self.loop)  # first: a kill before the save finds the round in flight written
        self._save({"format": FORMAT_VERSION, "committed": state, "loop": self.loop, "inflight": None})

    def _keep_in_history(self, state: dict[str, Any] | None, loop: dict[str, Any],
                         only_if_missing: bool = False) -> None:
        """The committed state is where the collector stands at the store's ``next_row`` (the newest
        such state: a round whose rows were all dropped leaves ``next_row`` as it was)."""
        if self.history is None or state is None:
            return
        if not (only_if_missing and self.history.has(int(self.store.next_row))):
            self.history.record(int(self.store.next_row), state, loop)

    def _save(self, payload: dict[str, Any]) -> None:
        import torch

        self._run_store.write(self._key, lambda f: torch.save(payload, f))
