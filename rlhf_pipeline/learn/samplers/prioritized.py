"""The ``prioritized`` learner sampler (:class:`PrioritizedRowSampler`): rows drawn by priority from the
whole buffer, with importance weights.

It runs :class:`~rlhf_pipeline.storage.prioritized.PrioritizedSampler` for the learner, which multiplies
every row's loss terms by its weight (``sample_weight``). With ``learner.priority_feedback`` the rows a
step trained on take the value it hands back as their priority; draws run ahead of steps, so for draws
to be deterministic draw ``d`` applies the feedback of exactly the draws up to ``d - 1 - FEEDBACK_LAG``
(waiting for it when the learner is behind). The checkpointed state holds the updated rows and the
feedback not yet applied, so a resumed run redraws exactly. Design: docs/curation.md#in-the-learner.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import torch

from rlhf_pipeline.learn.errors import DataTimeoutError
from rlhf_pipeline.learn.samplers.contract import RowsWait, SampledRows
from rlhf_pipeline.storage.prioritized import NothingToSampleError, PrioritizedSampler
from rlhf_pipeline.storage.row_keys import keys_of

#: draw d applies the feedback of the draws up to d - 1 - FEEDBACK_LAG (see the module docstring)
FEEDBACK_LAG = 1


class PrioritizedRowSampler:
    """Draws ``batch_size`` rows by priority from the whole buffer (docs/curation.md#in-the-learner).

    Draw ``d`` takes ``batch_size`` rows of every shard (or a saved selection) with probability
    proportional to ``(priority + eps)^alpha``, with replacement, and hands the importance weights to
    the learner (``row_weights`` in ``learn/loss.py``): ``beta = 1`` undoes the bias of prioritized
    sampling, smaller betas partly. Priorities come from stored fields (``priority``):
    ``abs_advantage`` (rows that move the policy most), ``group_reward_std`` (a group with equal
    rewards gives no GRPO signal and only ``eps``), ``recency`` (halves every 10 policy versions).
    Feedback (:meth:`feed_back`) is given by the positions of draw ``d``, which stay valid as row keys
    whatever the store did since; a lag of 1 keeps one draw prepared while the learner computes. The
    feedback of a draw whose rows all went stale is empty; rows dropped as stale keep their priority.
    Without feedback a row's priority is a function of its stored fields and the state is the window
    sampler's plus a scale offset; with it the state also holds the updated rows (by row key, only
    those) and the feedback given but not applied (:meth:`with_feedback`, which the learner
    checkpoints). With ``max_staleness`` rows more than that many versions older than the learner get
    probability 0 (``PrioritizedSampler.set_min_version``): the sampler waits (reported as data-wait
    time) while no row is fresh enough, and gives up after ``timeout_s``. ``new_rows_per_draw`` waits
    for new rows between draws, as the window sampler does."""

    def __init__(self, store, *, batch_size: int, seed: int, priority: str = "abs_advantage",
                 alpha: float = 0.6, beta: float = 0.4, max_staleness: int | None = None,
                 new_rows_per_draw: int = 0, min_next_row: int = 0, timeout_s: float = 600.0,
                 poll_s: float = 0.005, stop: threading.Event | None = None, feedback: bool = False) -> None:
        """``feedback``: the learner calls :meth:`feed_back` after the step of every draw (draws wait for it)."""
        self.store = store
        self.batch_size = batch_size
        self.seed = seed
        self.sampler = PrioritizedSampler(alpha, beta, priority=priority)
        self.max_staleness = max_staleness
        self.new_rows_per_draw = new_rows_per_draw
        self.min_next_row = min_next_row
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.stop = stop or threading.Event()
        self.current_version = 0  # set by the learner before each draw: the version it trains with
        self.hurry: threading.Event | None = None  # set while the learner waits for a draw (polling.py)
        self.feedback = feedback
        # feedback by draw: (part index, global row, value) arrays; applied in draw order
        self._reports: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._applied_through: int | None = None  # last draw whose feedback is in the priorities
        self._layouts: dict[int, list] = {}  # draw -> the layout its positions refer to, until fed back
        self._first_draw: int | None = None  # this process's first draw: feedback before it comes from a state
        self._reported = threading.Condition()

    def draw(self, draw_index: int) -> SampledRows:
        if self.feedback:
            self._apply_feedback(draw_index)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + draw_index)
        deadline = time.monotonic() + self.timeout_s
        wait = RowsWait(self.store, self.poll_s, self.hurry)
        while True:
            version = self.current_version
            wait.rows()  # refreshes a read-only store: without it a wait for new rows never ends
            next_row = self.store.next_row
            empty = self._empty_shards()
            if next_row >= self.min_next_row and not empty:
                bound = None if self.max_staleness is None else version - self.max_staleness
                self.sampler.set_min_version(bound)
                try:
                    positions, info = self.sampler.sample(self.store, self.batch_size, generator=generator)
                except NothingToSampleError:
                    positions = None
                if positions is not None:
                    if self.new_rows_per_draw:
                        self.min_next_row = next_row + self.new_rows_per_draw
                    weights = info["priority_weight"]
                    metrics = {}
                    if self.feedback:
                        with self._reported:
                            self._layouts[draw_index] = self.sampler.layout
                        metrics["charts/priority_rows_updated"] = float(self.sampler.updated_rows())
                    return SampledRows(positions, 0, len(self.store), next_row, version, self.state_dict(),
                                       weights=weights, metrics=metrics)
            if self.stop.is_set():
                raise InterruptedError("sampling stopped")
            if time.monotonic() > deadline:
                raise DataTimeoutError(
                    f"waited {self.timeout_s:.0f}s for rows of {self.store.location} to sample by priority "
                    f"(rows no more than {self.max_staleness} versions older than learner version {version}, "
                    f"buffer at row {next_row}, waiting for row {self.min_next_row}; empty shards: "
                    f"{', '.join(empty) or 'none'}): is a collector running for this run? (raise "
                    f"learner.data_timeout_s, or set learner.max_staleness=none for offline replay)"
                )
            wait.sleep()

    def _empty_shards(self) -> list[str]:
        empty_shards = getattr(self.store, "empty_shards", None)
        return empty_shards() if empty_shards is not None else []

    # ---------------------------------------------------------------- feedback
    def feed_back(self, draw_index: int, positions: torch.Tensor, values: torch.Tensor) -> None:
        """The new priorities of rows the learner trained on: ``positions`` (a subset of draw
        ``draw_index``'s positions, empty when its rows all went stale) and one value each."""
        values = torch.as_tensor(values, dtype=torch.float64).reshape(-1).cpu().numpy()
        positions = torch.as_tensor(positions, dtype=torch.int64).reshape(-1).cpu().numpy()
        if values.shape != positions.shape or not np.isfinite(values).all() or (values < 0).any():
            raise ValueError(f"feedback for draw {draw_index}: need one finite value >= 0 per position, got "
                             f"{values.size} values for {positions.size} positions")
        with self._reported:
            layout = self._layouts.pop(draw_index)
            parts, rows = keys_of(None, positions, parts=layout)
            self._reports[draw_index] = (parts, rows, values)
            # a checkpoint from now on holds the state of a draw >= draw_index, which has applied
            # the feedback of the draws before draw_index - FEEDBACK_LAG: older reports are not needed
            for old in [d for d in self._reports if d < draw_index - FEEDBACK_LAG]:
                del self._reports[old]
            for old in [d for d in self._layouts if d < draw_index]:
                del self._layouts[old]
            self._reported.notify_all()

    def _apply_feedback(self, draw_index: int) -> None:
        """Applies the feedback of the draws up to ``draw_index - 1 - FEEDBACK_LAG``, waiting for it."""
        through = draw_index - 1 - FEEDBACK_LAG
        with self._reported:
            if self._first_draw is None:
                self._first_draw = draw_index
            if self._applied_through is None:  # nothing is owed for draws before this sampler's first
                self._applied_through = draw_index - 1
            owed = range(self._applied_through + 1, through + 1)
            lost = [d for d in owed if d < self._first_draw and d not in self._reports]
            if lost:  # made before this process, so only a checkpoint could hold it: waiting would never end
                raise RuntimeError(f"the sampler state lacks the priority feedback of draws {lost}: it was saved "
                                   f"without with_feedback(); resume from a checkpoint the learner wrote")
            while not all(d in self._reports for d in owed):
                if self.stop.is_set():
                    raise InterruptedError("sampling stopped")
                self._reported.wait(self.poll_s)
            reports = [self._reports[d] for d in owed]
        for parts, rows, values in reports:
            self.sampler.update_priority_by_key(parts, rows, values)
        self._applied_through = max(self._applied_through, through)

    def with_feedback(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (of a draw the learner used) plus the feedback given since that draw was made:
        what the learner checkpoints, so a resumed run applies exactly the same updates."""
        if not self.feedback:
            return state
        applied = state.get("feedback_applied_through")
        with self._reported:
            later = {d: self._reports[d] for d in sorted(self._reports) if applied is None or d > applied}
        return {**state, "feedback": {d: tuple(torch.from_numpy(a) for a in report) for d, report in later.items()}}

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        # derived priorities are recomputed from the stored rows on resume: only the scale, the
        # updated rows and the feedback not applied yet are history
        state = {"min_next_row": int(self.min_next_row),
                 "prioritized": self.sampler.state_dict(include_priorities=False)}
        if self.feedback:
            state = self.with_feedback({**state, "feedback_applied_through": self._applied_through})
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.min_next_row = int(state["min_next_row"])
        if "prioritized" in state:
            self.sampler.load_state_dict(state["prioritized"])
        with self._reported:
            self._applied_through = state.get("feedback_applied_through")
            self._reports = {int(d): tuple(torch.as_tensor(a).numpy() for a in report)
                             for d, report in state.get("feedback", {}).items()}
            self._layouts = {}
            self._first_draw = None
