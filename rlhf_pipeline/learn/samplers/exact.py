"""The ``exact`` sampler (:class:`ExactUseSampler`): every fresh row is trained on exactly ``uses`` times.

Rows are taken in write order in *blocks* of ``batch_size``, each block the whole batch of ``uses``
consecutive draws (the GRPO paper's mu iterations, TRL's ``num_iterations``): nothing is random, so no
row is left out or drawn twice by chance. A block takes an even share from every shard with rows past
its cursor. Rows too stale for the version the block's first draw trains with, or evicted, are passed
over for good; while a block waits, :attr:`~ExactUseSampler.lacking` says how many rows it still lacks,
which the learner publishes to the collectors. The state (cursors, current block, its draws) resumes
the block a run was on, and the blocks a killed learner took past its checkpoint are taken again as it
took them (:meth:`~ExactUseSampler.retake`). Design: docs/learner.md#which-rows-a-step-trains-on.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import numpy as np

from rlhf_pipeline.learn.errors import DataTimeoutError
from rlhf_pipeline.learn.samplers.contract import RowsWait, SampledRows
from rlhf_pipeline.learn.shard_rows import next_rows, shard_stores, union_positions


NOTHING_LACKING: tuple[int, int, dict[str, int]] = (0, 0, {})
"""What a sampler not waiting for rows lacks."""


class ExactUseSampler:
    """Blocks of ``batch_size`` fresh rows in write order, each the batch of ``uses`` draws.

    Each shard (one per collector) has a cursor: the global id of its oldest row not yet taken into a
    block. A new block waits until the shards together hold ``batch_size`` rows past their cursors,
    then takes them evenly from the shards that have some, oldest first, so a collector that starts
    late or runs slower is neither left out nor waited for; which rows form a block depends on what
    each shard held then, and every row is still used exactly ``uses`` times. ``max_staleness`` is
    checked against ``current_version`` when the block is taken (the version its first draw trains
    with, not whichever the learner holds as the rows arrive), and the learner's own check at use time
    applies to every pass: with ``max_staleness < uses`` some rows are trained on fewer times. Rows
    passed over are rows the learner's intake did not count on, hence :attr:`lacking`. A resumed run
    continues the block it was on and takes the next rows after it: no row is lost or trained on an
    extra time."""

    def __init__(self, store, *, batch_size: int, uses: int = 1, max_staleness: int | None = None,
                 timeout_s: float = 600.0, poll_s: float = 0.005, stop: threading.Event | None = None) -> None:
        if batch_size < 1 or uses < 1:
            raise ValueError(f"batch_size and uses must be >= 1 (got {batch_size}, {uses})")
        self.store = store
        self.batch_size = batch_size
        self.uses = uses
        self.max_staleness = max_staleness
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.stop = stop or threading.Event()
        self.current_version = 0  # set by the learner before each draw: the version it trains with
        self.hurry: threading.Event | None = None  # set while the learner waits for a draw (polling.py)
        self.cursors: dict[str, int] = {}  # shard key -> oldest global id not yet taken into a block
        self.block: dict[str, list[int]] = {}  # shard key -> global ids of the current block
        self.block_draws = uses  # draws that used the current block; == uses: the next draw takes a new one
        # (version the draw trains with, rows it lacks, rows per shard seen): read by the learner while it waits
        self.lacking: tuple[int, int, dict[str, int]] = NOTHING_LACKING
        self.passed_over = 0  # stale rows the block being waited for passed over: the learner's wait line says so
        self._recorded: dict[int, dict[str, int]] = {}  # draw index -> cursors right after it (retake)

    def draw(self, draw_index: int) -> SampledRows:
        """The next draw's rows. ``draw_index`` is not needed: the state says where the run is."""
        dropped = 0
        while True:
            if self.block_draws >= self.uses:
                recorded = self._recorded.pop(draw_index, None)
                dropped += self._take_block() if recorded is None else self._take_recorded_block(draw_index, recorded)
            rows = len(self.store)  # refresh once: the positions hold until the next refresh
            positions, gone = union_positions(self.store, self.block)
            dropped += gone
            if gone:  # evicted before every pass used them: later passes name the rows still held
                self._forget_evicted()
            if positions.numel():
                break
            self.block_draws = self.uses  # the whole block was evicted: take the next one
        self.block_draws += 1
        return SampledRows(positions, dropped, rows, self.store.next_row, self.current_version, self.state_dict(),
                           consumed=dict(self.cursors),
                           next_draw_rows=self.batch_size if self.block_draws >= self.uses else 0)

    # ------------------------------------------------------------------ blocks
    def _take_block(self) -> int:
        """Waits for ``batch_size`` usable rows past the cursors and makes them the new block;
        returns how many stale rows were passed over on the way."""
        deadline = time.monotonic() + self.timeout_s
        wait = RowsWait(self.store, self.poll_s, self.hurry)
        block: dict[str, list[int]] = {}
        have = skipped = 0
        while True:
            wait.rows()  # refresh
            available = self._available()
            need = self.batch_size - have
            if sum(len(ids) for ids in available.values()) >= need:
                taken = _even_split(available, need)
                fresh, stale = self._fresh(taken)
                skipped += stale
                self.passed_over = skipped
                for key, ids in taken.items():  # stale rows are passed over for good
                    self.cursors[key] = int(ids[-1]) + 1
                for key, ids in fresh.items():
                    block.setdefault(key, []).extend(int(i) for i in ids)
                    have += len(ids)
                if have == self.batch_size:
                    self._begin_block(block)
                    return skipped
                continue
            self.lacking = (self.current_version, need - sum(len(ids) for ids in available.values()),
                            next_rows(self.store))
            if self.stop.is_set():
                raise InterruptedError("sampling stopped")
            if time.monotonic() > deadline:
                held = sum(len(ids) for ids in available.values())
                stale = f"; {skipped} more were too stale to train on" if skipped else ""
                raise DataTimeoutError(
                    f"waited {self.timeout_s:.0f}s for {need} rows not yet trained on in "
                    f"{self.store.location} (it holds {held} past the rows already used{stale}): is a collector "
                    f"running for this run? (raise learner.data_timeout_s)"
                )
            wait.sleep()

    def retake(self, taken: dict[int, dict[str, int]]) -> None:
        """Draws a learner killed past its checkpoint took in (index -> ``consumed``, the cursors right
        after each, from ``pacing.json``): which rows a block took from each shard was what the shards
        held as it was drawn, so this learner takes those blocks again as recorded, not as the shards
        stand now. The versions those draws trained were published and sampled with: trained again on
        the same rows, they are the same weights under the same numbers."""
        self._recorded = dict(taken)

    def _take_recorded_block(self, draw_index: int, cursors: dict[str, int]) -> int:
        """The block draw ``draw_index`` took before a kill: every row from the cursors up to
        ``cursors``, less the stale ones as then. Rows since evicted, or settings changed on resume
        (another ``batch_size``), make another block: the record ends there and blocks are taken from
        the shards as they stand, said in one line."""
        deadline = time.monotonic() + self.timeout_s
        wait = RowsWait(self.store, self.poll_s, self.hurry)
        while True:
            wait.rows()  # refresh: a reader at a URL may not list every row the record names yet
            shards = dict(shard_stores(self.store))
            if all(key in shards and int(shards[key].next_row) >= end for key, end in cursors.items()):
                break
            if self.stop.is_set():
                raise InterruptedError("sampling stopped")
            if time.monotonic() > deadline:
                break  # a shard lost rows it published: the block below cannot be the recorded one
            wait.sleep()
        taken, whole = {}, True
        for key, end in cursors.items():
            cursor, shard = self.cursors.get(key, 0), shards.get(key)
            if end < cursor or (end > cursor and (shard is None or int(shard.next_row) < end)):
                whole = False
            elif end > cursor:  # (rows evicted before they were taken were passed over then too)
                taken[key] = np.arange(max(cursor, int(shard.first_row)), end, dtype=np.int64)
        fresh, stale = self._fresh(taken) if whole else ({}, 0)
        if not whole or sum(len(ids) for ids in fresh.values()) != self.batch_size:
            print(f"[learner] draw {draw_index + 1}, taken in before the learner was stopped, took rows this "
                  f"learner cannot take again as they were (evicted since, or learner.batch_size changed on "
                  f"resume): its blocks from here on are taken from the shards as they stand",
                  file=sys.stderr, flush=True)
            self._recorded = {}
            return self._take_block()
        self.cursors.update(cursors)
        self._begin_block({key: [int(i) for i in ids] for key, ids in fresh.items() if len(ids)})
        return stale

    def _begin_block(self, block: dict[str, list[int]]) -> None:
        """``block`` is whole: the next ``uses`` draws train on it, and nothing is waited for."""
        self.block = block
        self.block_draws = 0
        self.lacking, self.passed_over = NOTHING_LACKING, 0

    def why_rows_held_wait(self) -> str | None:
        """Why rows the buffer holds past the last draw's do not make the block waited for: those passed
        over as stale, said in the learner's wait line (None: none were)."""
        if not self.passed_over:
            return None
        return (f"{self.passed_over} of them were sampled more than learner.max_staleness={self.max_staleness} (from "
                f"max_lag) versions before version {self.current_version}, which this draw trains with: passed over, "
                f"never trained")

    def _available(self) -> dict[str, np.ndarray]:
        """Per shard, the global ids past its cursor that it still holds (as of the last refresh)."""
        out = {}
        for key, shard in shard_stores(self.store):
            start = max(self.cursors.get(key, 0), int(shard.first_row))
            if int(shard.next_row) > start:
                out[key] = np.arange(start, int(shard.next_row), dtype=np.int64)
        return out

    def _fresh(self, taken: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int]:
        """The rows of ``taken`` within ``max_staleness`` versions of the learner, and how many were not."""
        if self.max_staleness is None:
            return taken, 0
        positions, _ = union_positions(self.store, taken)
        versions = self.store.read(positions, fields=("policy_version",))["policy_version"].numpy()
        keep = versions >= self.current_version - self.max_staleness
        out, at = {}, 0
        for key, ids in taken.items():
            out[key] = ids[keep[at: at + len(ids)]]
            at += len(ids)
        return out, int((~keep).sum())

    def _forget_evicted(self) -> None:
        firsts = {key: int(shard.first_row) for key, shard in shard_stores(self.store)}
        self.block = {key: [i for i in ids if i >= firsts[key]] for key, ids in self.block.items() if key in firsts}

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"cursors": dict(self.cursors), "block": {k: list(v) for k, v in self.block.items()},
                "block_draws": int(self.block_draws)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "cursors" not in state:
            # a run that sampled with another sampler until now: train on the rows written from here on
            len(self.store)
            self.cursors, self.block, self.block_draws = next_rows(self.store), {}, self.uses
            return
        self.cursors = {str(k): int(v) for k, v in state["cursors"].items()}
        self.block = {str(k): [int(i) for i in v] for k, v in state["block"].items()}
        self.block_draws = int(state["block_draws"])


def _even_split(available: dict[str, np.ndarray], count: int) -> dict[str, np.ndarray]:
    """``count`` ids: an even share from every shard that has some (a short shard's share goes
    to the others), the oldest of each."""
    take = dict.fromkeys(available, 0)
    remaining = count
    while remaining > 0:
        active = [key for key, ids in available.items() if take[key] < len(ids)]
        share = max(1, remaining // len(active))
        for key in active:
            step = min(share, len(available[key]) - take[key], remaining)
            take[key] += step
            remaining -= step
            if remaining == 0:
                break
    return {key: available[key][:n] for key, n in take.items() if n}
