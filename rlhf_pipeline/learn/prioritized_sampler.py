"""The ``prioritized`` learner sampler: rows drawn by priority from the whole buffer, with weights.

``PrioritizedRowSampler`` runs :class:`~rlhf_pipeline.storage.prioritized.PrioritizedSampler`
(prioritized experience replay on torchrl's ``Sampler`` contract) for the learner: draw ``d``
takes ``batch_size`` rows of the whole buffer (every shard, or a saved selection) with
probability proportional to ``(priority + eps)^alpha`` (with replacement), and hands the
importance weights ``w_i`` to the learner, which multiplies every row's loss terms by them
(``sample_weight`` in the batch, ``row_weights`` in ``learn/loss.py``): ``beta = 1`` undoes
the bias of prioritized sampling, smaller betas partly.

Priorities come from stored fields (``learner.priority``): ``abs_advantage`` (|advantage|:
rows that move the policy most), ``group_reward_std`` (rows of groups whose rewards disagree:
a group with equal rewards gives no GRPO signal and only ``eps``), ``recency`` (halves every
10 policy versions). The learner does not feed priorities back, so a row's priority is a
function of its stored fields and the sampler's state is the window sampler's plus a scale
offset: a resumed run recomputes the same priorities and redraws exactly the same rows.

Off-policy control: with ``max_staleness`` set, rows more than that many versions older than
the learner get probability 0 (``PrioritizedSampler.set_min_version``); the sampler waits
(reported as data-wait time) while no row is fresh enough, and gives up after ``timeout_s``.
``new_rows_per_draw`` waits for new rows between draws, as the window sampler does.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from rlhf_pipeline.learn.sampling import DataTimeoutError, SampledRows
from rlhf_pipeline.storage.prioritized import NothingToSampleError, PrioritizedSampler


class PrioritizedRowSampler:
    """Draws ``batch_size`` rows by priority from the whole buffer (see the module docstring)."""

    def __init__(self, store, *, batch_size: int, seed: int, priority: str = "abs_advantage",
                 alpha: float = 0.6, beta: float = 0.4, max_staleness: int | None = None,
                 new_rows_per_draw: int = 0, min_next_row: int = 0, timeout_s: float = 600.0,
                 poll_s: float = 0.05, stop: threading.Event | None = None) -> None:
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
        self.current_version = 0  # set by the learner after each publish

    def draw(self, draw_index: int) -> SampledRows:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + draw_index)
        deadline = time.monotonic() + self.timeout_s
        while True:
            version = self.current_version
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
                    return SampledRows(positions, 0, len(self.store), next_row, version, self.state_dict(),
                                       weights=weights)
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
            time.sleep(self.poll_s)

    def _empty_shards(self) -> list[str]:
        empty_shards = getattr(self.store, "empty_shards", None)
        return empty_shards() if empty_shards is not None else []

    def state_dict(self) -> dict[str, Any]:
        # priorities are re-derived from the stored rows on resume; only the scale is history
        return {"min_next_row": int(self.min_next_row),
                "prioritized": self.sampler.state_dict(include_priorities=False)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.min_next_row = int(state["min_next_row"])
        if "prioritized" in state:
            self.sampler.load_state_dict(state["prioritized"])
