"""Which rows each learner step trains on: the contract every sampler keeps (:class:`BatchSampler`).

A sampler makes *draw* ``d`` (the ``d``-th batch the learner asks for; draws and steps may differ):
the store positions of one step's rows (:class:`SampledRows`), on the learner's prefetch thread, a few
draws ahead. ``draw(d)`` is deterministic given the seed, ``d``, the state and the rows published;
``current_version`` is the version the draw trains with; each draw carries the state right after it,
and the learner checkpoints the state of the last draw it used. A sampler waiting for rows polls
through a :class:`RowsWait`, fast only while a step waits (the optional ``hurry`` event).
Design: docs/learner.md#the-sampler-contract.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from rlhf_pipeline.coordination.polling import PollBackoff

if TYPE_CHECKING:
    import torch

WAITING_REFRESH_FIRST_S = 0.05
"""How often a reader that throttles its refreshes re-reads the buffer in the first
``WAITING_REFRESH_FAST_S`` of a wait for rows."""

WAITING_REFRESH_FAST_S = 1.0
"""How long a wait for rows re-reads every ``WAITING_REFRESH_FIRST_S`` before its gaps double."""


@dataclass
class SampledRows:
    """One draw: which rows, and what the learner logs about how they were chosen."""

    positions: torch.Tensor  # (batch_size,) store positions, valid until the store's next refresh
    dropped_stale: int  # rows drawn but rejected as too stale
    buffer_rows: int  # rows in the buffer when drawn
    buffer_next_row: int
    version: int  # learner version the staleness check used
    sampler_state: dict[str, Any] = field(default_factory=dict)  # state_dict() right after this draw
    weights: torch.Tensor | None = None  # (batch_size,) importance weights the loss applies per row, if any
    metrics: dict[str, float] = field(default_factory=dict)  # logged by the learner with the step's metrics
    # rows the learner has taken in with this draw, per shard key (learn/shard_rows.py): what
    # collectors pace themselves by (rlhf_pipeline/coordination/pacing.py). None: every row published when
    # the draw was made (the learner fills that in)
    consumed: dict[str, int] | None = None
    # new rows the next draw waits for (None: learner.new_rows_per_step, or batch_size when 0)
    next_draw_rows: int | None = None
    # set by the learner, not the sampler, when it narrows a draw of multi-turn rows to the rows that
    # end a trajectory (learn/trajectories.py): (n,) the step of each, whose earlier turns train with
    # it. None: single-turn rows, trained as drawn
    trajectory_steps: torch.Tensor | None = None
    # set by the data-parallel layer, not the sampler (learn/distributed.py, order_by_rank): the rows
    # of each rank, in rank order, when the draw is ordered by the rank that owns each row's shard.
    # None: the ranks take slices of equal size
    rank_rows: list[int] | None = None


class BatchSampler(Protocol):
    """What the learner asks of a sampler (docs/learner.md#the-sampler-contract): ``draw(d)``,
    deterministic given the seed, ``d``, the state and the rows published; ``current_version``, set by
    the learner before each draw; ``state_dict()`` / ``load_state_dict()``, whatever else a resumed run
    needs (each ``SampledRows`` carries it as of right after its draw: ``sampler_state``). A sampler that
    waits for rows of its own choosing may also say what its draw lacks (``lacking``, published to the
    collectors) and why rows held do not make it (``why_rows_held_wait()``, in the learner's wait line),
    as ``exact.py`` does; the learner reads them where they are."""

    current_version: int

    def draw(self, draw_index: int) -> SampledRows: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class RowsWait:
    """One wait of a sampler for rows: the buffer's rows at each poll (:meth:`rows`), then :meth:`sleep`.

    A reader at a URL re-reads its commit record at most once per ``refresh_interval_s`` (1 s; a GET,
    or a LIST and a GET per shard) however often it is asked, so a learner drawing batch after batch
    pays a request once a second, not per batch. Waiting for rows, that throttle was the wait: a run
    at a URL whose learner keeps up with its collector waited most of a second per step for rows
    already published. A wait asks sooner: every ``WAITING_REFRESH_FIRST_S`` for its first
    ``WAITING_REFRESH_FAST_S``, then at gaps that double up to that interval, so rows published in
    the first second of a wait are seen within 50 ms, and a long wait still costs a request a second.
    (Gaps that doubled from the start, 50, 100, 200 ms, had the default pipeline's learner at an
    ``s3://`` URL wait 0.14 s a step for rounds its collector wrote every 0.2 s; now 0.09 s.) A local
    reader re-reads at every ask anyway; a data-parallel rank's view (an interval of inf) follows
    rank 0's refreshes."""

    def __init__(self, store: Any, poll_s: float, hurry: threading.Event | None) -> None:
        self.store = store
        self._backoff = PollBackoff(poll_s, hurry=hurry)
        interval = store.refresh_interval_s
        self._throttle_s = interval if 0 < interval < math.inf else 0.0
        self._gap_s = min(WAITING_REFRESH_FIRST_S, self._throttle_s)
        self._began = self._asked_at = time.monotonic()  # the wait's start

    def rows(self) -> int:
        """The rows the buffer holds, re-read if due (the store's own refresh until the first gap is up)."""
        now = time.monotonic()
        if not self._throttle_s or now - self._asked_at < self._gap_s:
            return len(self.store)
        if now - self._began >= WAITING_REFRESH_FAST_S:
            self._gap_s = min(2 * self._gap_s, self._throttle_s)
        self._asked_at = now
        return self.store.refresh(force=True)

    def sleep(self) -> None:
        self._backoff.sleep()
