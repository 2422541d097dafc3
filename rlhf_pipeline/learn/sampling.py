"""Which rows each learner step trains on: the sampler contract and the registry of samplers.

A sampler makes *draw* ``d`` (the ``d``-th batch the learner asks for; a batch can be
dropped whole as stale, so draws and steps may differ): the store positions of one
step's rows. The learner runs draws on a prefetch thread a few draws ahead
(``learn/prefetch.py``), reads the rows into a padded batch, and records the draw count in
its ``Progress``. A sampler keeps this contract (:class:`BatchSampler`):

* ``draw(d) -> SampledRows`` is deterministic given the seed, ``d``, the sampler's state
  and the rows published: a resumed run redraws exactly what an uninterrupted one would;
* ``current_version`` is set by the learner after each publish (staleness checks use it);
* ``state_dict()`` / ``load_state_dict()`` hold whatever else a resumed run needs. Draws run
  ahead of the steps, so each ``SampledRows`` carries the state right after its draw
  (``sampler_state``); the learner checkpoints the state of the last draw it *used*;
* optionally, a ``hurry`` attribute: the learner sets it to an event that is set while a step
  waits for the draw; a sampler that polls the buffer for new rows polls fast only then
  (``rlhf_pipeline/coordination/polling.py``).

To add a sampler: write its class in a module of its own, and add one line to
:data:`SAMPLERS` naming a factory ``make(settings, store, *, seed, stop, timeout_s)`` where
``settings`` is the learner's ``LearnerSettings``. ``learner.sampler`` picks it by name.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from rlhf_pipeline.learn.settings import LearnerSettings


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


class BatchSampler(Protocol):
    """What the learner asks of a sampler (see the module docstring)."""

    current_version: int

    def draw(self, draw_index: int) -> SampledRows: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _window(settings: LearnerSettings, store, *, seed: int, stop: threading.Event,
            timeout_s: float) -> BatchSampler:
    from rlhf_pipeline.learn.window_sampler import FreshRowSampler

    return FreshRowSampler(store, batch_size=settings.batch_size, window=settings.sample_window, seed=seed,
                           max_staleness=settings.max_staleness, new_rows_per_draw=settings.new_rows_per_step,
                           timeout_s=timeout_s, stop=stop)


def _exact(settings: LearnerSettings, store, *, seed: int, stop: threading.Event,
           timeout_s: float) -> BatchSampler:
    from rlhf_pipeline.learn.exact_sampler import ExactUseSampler

    return ExactUseSampler(store, batch_size=settings.batch_size, uses=settings.uses_per_row,
                           max_staleness=settings.max_staleness, timeout_s=timeout_s, stop=stop)


def _groups(settings: LearnerSettings, store, *, seed: int, stop: threading.Event,
            timeout_s: float) -> BatchSampler:
    from rlhf_pipeline.learn.group_sampler import GroupWindowSampler

    return GroupWindowSampler(store, batch_size=settings.batch_size, window=settings.sample_window, seed=seed,
                              max_staleness=settings.max_staleness, new_rows_per_draw=settings.new_rows_per_step,
                              replace_zero_variance=settings.replace_zero_variance,
                              pool_groups=settings.replay_pool_groups, timeout_s=timeout_s, stop=stop)


def _prioritized(settings: LearnerSettings, store, *, seed: int, stop: threading.Event,
                 timeout_s: float) -> BatchSampler:
    from rlhf_pipeline.learn.prioritized_sampler import PrioritizedRowSampler

    return PrioritizedRowSampler(store, batch_size=settings.batch_size, seed=seed, priority=settings.priority,
                                 alpha=settings.priority_alpha, beta=settings.priority_beta,
                                 max_staleness=settings.max_staleness, new_rows_per_draw=settings.new_rows_per_step,
                                 timeout_s=timeout_s, stop=stop, feedback=settings.priority_feedback != "none")


def _epoch(settings: LearnerSettings, store, *, seed: int, stop: threading.Event,
           timeout_s: float) -> BatchSampler:
    from rlhf_pipeline.learn.epoch_sampler import EpochSampler

    return EpochSampler(store, batch_size=settings.batch_size, order=settings.epoch_order, seed=seed,
                        rows=settings.epoch_rows, shuffle_window_rows=settings.shuffle_window_rows, stop=stop)


#: ``learner.sampler`` name -> factory. ``window``: uniform over the newest ``sample_window`` rows,
#: once ``new_rows_per_step`` new rows arrived (learn/window_sampler.py). ``exact``: every fresh
#: row in exactly ``uses_per_row`` steps, in write order (learn/exact_sampler.py). ``groups``: whole groups
#: from the same window, zero-variance groups optionally replaced (learn/group_sampler.py).
#: ``prioritized``: rows of the whole buffer by priority, with importance weights
#: (learn/prioritized_sampler.py). ``epoch``: every row of a recorded buffer once per epoch, in
#: ``epoch_order`` (learn/epoch_sampler.py; ``replay``).
SAMPLERS: dict[str, Callable[..., BatchSampler]] = {
    "window": _window,
    "exact": _exact,
    "groups": _groups,
    "prioritized": _prioritized,
    "epoch": _epoch,
}


def make_sampler(settings: LearnerSettings, store, *, seed: int, stop: threading.Event,
                 timeout_s: float | None = None) -> BatchSampler:
    """The sampler ``settings.sampler`` names, over ``store``."""
    try:
        factory = SAMPLERS[settings.sampler]
    except KeyError:
        raise ValueError(f"learner setting 'sampler' must be one of {sorted(SAMPLERS)}, "
                         f"got {settings.sampler!r}") from None
    return factory(settings, store, seed=seed, stop=stop,
                   timeout_s=settings.data_timeout_s if timeout_s is None else timeout_s)


