"""Which policy versions a run evaluates, and the evaluator beside training that evaluates them.

With ``eval.every_steps = E`` the evaluator takes, for each multiple of ``E``, the first version
published at or after it (version 0 too with ``eval.before_training``): ``coordination/eval_pins.py``'s
``wanted_version``, by which the learner also keeps those versions until the evaluator has done them.
:func:`follow_run` is the evaluator process's loop: the wanted versions oldest first, one engine given
each in turn, each released to the learner's pruning once done, until the learner's ``STOP`` (then what
is left is evaluated) or a stop request. The learner never waits for it: they share only the weight
files. Design: docs/evaluation.md#evaluating-beside-training.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlhf_pipeline.evaluation.evaluator import EvalProgress, Evaluation, open_set_store
from rlhf_pipeline.evaluation.sets import EvalSet


class VersionEngine:
    """One engine for an evaluator's life, holding the version being evaluated: made at the first
    version that needs one (``make(state, version)``; a vLLM server starts once, not per version), then
    given each next version with ``load_weights``. An evaluation that failed drops it (:meth:`close`):
    an engine that died is made anew for the retry."""

    def __init__(self, make: Callable[[Any, int], Any]) -> None:
        self._make = make
        self.engine: Any = None

    def holding(self, version: int, load: Callable[[], Any]) -> Any:
        """The engine, holding ``version`` (whose state dict ``load()`` reads)."""
        if self.engine is None:
            self.engine = self._make(load(), version)
        elif self.engine.policy_version != version:
            self.engine.load_weights(load(), version)
        return self.engine

    def close(self) -> None:
        if self.engine is not None:
            engine, self.engine = self.engine, None
            engine.close()


def evaluate_version(evaluation: Evaluation, sets: Sequence[EvalSet], stores: dict[str, Any], version: int,
                     engines: VersionEngine, load: Callable[[], Any]) -> bool:
    """Every set at ``version`` (the engine given the version only when a set needs it); True when
    nothing is left to try (each set done, or given up after its tries)."""
    for eval_set in sets:
        store = stores[eval_set.name]
        progress = EvalProgress.of(store)
        if version in progress.done or progress.gave_up(version):
            evaluation.evaluate(None, eval_set, version, store)  # only logs a summary a kill kept out
            continue
        evaluation.evaluate(engines.holding(version, load), eval_set, version, store)
    progress = [EvalProgress.of(stores[s.name]) for s in sets]
    if not all(version in p.done for p in progress):
        engines.close()  # failed: its retry gets an engine of its own
    return all(version in p.done or p.gave_up(version) for p in progress)


def follow_run(evaluation: Evaluation, sets: Sequence[EvalSet], paths: Any, engines: VersionEngine,
               pins: Any, *, should_stop: Callable[[], bool], store_options: Mapping[str, Any] | None = None) -> bool:
    """The evaluator beside training (module docstring). ``engines``: the evaluator's engine;
    ``paths``: the run's ``RunPaths``; ``pins``: its ``EvalPins``; ``store_options``: how its eval
    stores are opened (``open_set_store``). Returns True once the learner is done and no version is
    left, False when asked to stop first."""
    from rlhf_pipeline.coordination.polling import PollBackoff
    from rlhf_pipeline.coordination.weights import load_weights, published_versions

    stores = {s.name: open_set_store(paths.location, s, evaluation.settings, **(store_options or {}))
              for s in sets}
    backoff = PollBackoff(max_s=0.05)
    settled_below = pins.pinned_from()  # versions below are done (a restarted evaluator goes on from there)
    try:
        while not should_stop():
            learner_done = paths.stop_requested()  # before the listing: every version it published is listed
            todo = [v for v in published_versions(paths.store) if v >= settled_below and pins.wanted(v)]
            if not todo:
                if learner_done:
                    return True
                backoff.sleep()
                continue
            version = todo[0]
            try:
                state = load_weights(paths.store, version)[0]
            except FileNotFoundError:  # taken back by a resumed learner: published again as it retrains
                backoff.sleep()
                continue
            if evaluate_version(evaluation, sets, stores, version, engines, lambda: state):
                settled_below = version + 1
                pins.release_below(settled_below)
            backoff.reset()
        return False
    finally:
        for store in stores.values():
            store.close()
