"""Which rows each learner step trains on: the contract every sampler keeps.

A sampler makes *draw* ``d`` (the ``d``-th batch the learner asks for; a batch can be
dropped whole as stale, so draws and steps may differ): the store positions of one
step's rows. The learner runs draws on a prefetch thread a few draws ahead
(``learn/learner.py``, ``Prefetcher``), reads the rows into a padded batch, and records the draw count in
its ``Progress``. A sampler keeps this contract (:class:`BatchSampler`):

* ``draw(d) -> SampledRows`` is deterministic given the seed, ``d``, the sampler's state
  and the rows published: a resumed run redraws exactly what an uninterrupted one would;
* ``current_version`` is set by the learner before each draw: the policy version that draw is
  trained with (staleness checks use it; ``DrawVersions``, ``learn/learner.py``);
* ``state_dict()`` / ``load_state_dict()`` hold whatever else a resumed run needs. Draws run
  ahead of the steps, so each ``SampledRows`` carries the state right after its draw
  (``sampler_state``); the learner checkpoints the state of the last draw it *used*;
* optionally, a ``hurry`` attribute: the learner sets it to an event that is set while a step
  waits for the draw; a sampler that polls the buffer for new rows polls fast only then
  (``rlhf_pipeline/coordination/polling.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


class DataTimeoutError(RuntimeError):
    """The buffer held too few usable rows for longer than the learner's data timeout."""


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
    """What the learner asks of a sampler (see the module docstring)."""

    current_version: int

    def draw(self, draw_index: int) -> SampledRows: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
