"""The samplers by name: ``learner.sampler`` picks one of :data:`SAMPLERS`; :func:`make_sampler`
builds it. To add a sampler: write its class in a module of its own in this folder, keeping the
contract of :mod:`.contract`, and add one line to :data:`SAMPLERS` naming a factory
``make(settings, store, *, seed, stop, timeout_s)`` where ``settings`` is the learner's ``LearnerSettings``.
Design: docs/learner.md#the-sampler-contract.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from rlhf_pipeline.learn.samplers.contract import BatchSampler

if TYPE_CHECKING:
    from rlhf_pipeline.learn.settings import LearnerSettings


def _window(settings: LearnerSettings, store, *, seed: int, stop: threading.Event,
            timeout_s: float) -> BatchSampler:
    from rlhf_pipeline.learn.samplers.window import FreshRowSampler

    return FreshRowSampler(store, batch_size=settings.batch_size, window=settings.sample_window, seed=seed,
                           max_staleness=settings.max_staleness, new_rows_per_draw=settings.new_rows_per_step,
                           timeout_s=timeout_s, stop=stop)


def _exact(settings: LearnerSettings, store, *, seed: int, stop: threading.Event,
           timeout_s: float) -> BatchSampler:
    from rlhf_pipeline.learn.samplers.exact import ExactUseSampler

    return ExactUseSampler(store, batch_size=settings.batch_size, uses=settings.uses_per_row,
                           max_staleness=settings.max_staleness, timeout_s=timeout_s, stop=stop)


def _groups(settings: LearnerSettings, store, *, seed: int, stop: threading.Event,
            timeout_s: float) -> BatchSampler:
    from rlhf_pipeline.learn.samplers.groups import GroupWindowSampler

    return GroupWindowSampler(store, batch_size=settings.batch_size, window=settings.sample_window, seed=seed,
                              max_staleness=settings.max_staleness, new_rows_per_draw=settings.new_rows_per_step,
                              replace_zero_variance=settings.replace_zero_variance,
                              pool_groups=settings.replay_pool_groups, timeout_s=timeout_s, stop=stop)


def _prioritized(settings: LearnerSettings, store, *, seed: int, stop: threading.Event,
                 timeout_s: float) -> BatchSampler:
    from rlhf_pipeline.learn.samplers.prioritized import PrioritizedRowSampler

    return PrioritizedRowSampler(store, batch_size=settings.batch_size, seed=seed, priority=settings.priority,
                                 alpha=settings.priority_alpha, beta=settings.priority_beta,
                                 max_staleness=settings.max_staleness, new_rows_per_draw=settings.new_rows_per_step,
                                 timeout_s=timeout_s, stop=stop, feedback=settings.priority_feedback != "none")


def _epoch(settings: LearnerSettings, store, *, seed: int, stop: threading.Event,
           timeout_s: float) -> BatchSampler:
    from rlhf_pipeline.learn.samplers.epoch import EpochSampler

    return EpochSampler(store, batch_size=settings.batch_size, order=settings.epoch_order, seed=seed,
                        rows=settings.epoch_rows, shuffle_window_rows=settings.shuffle_window_rows, stop=stop)


#: ``learner.sampler`` name -> factory. ``window``: uniform over the newest ``sample_window`` rows,
#: once ``new_rows_per_step`` new rows arrived (learn/samplers/window.py). ``exact``: every fresh
#: row in exactly ``uses_per_row`` steps, in write order (learn/samplers/exact.py). ``groups``: whole groups
#: from the same window, zero-variance groups optionally replaced (learn/samplers/groups.py).
#: ``prioritized``: rows of the whole buffer by priority, with importance weights
#: (learn/samplers/prioritized.py). ``epoch``: every row of a recorded buffer once per epoch, in
#: ``epoch_order`` (learn/samplers/epoch.py; ``replay``).
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


