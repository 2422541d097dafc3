"""Which policy versions a run evaluates, and the evaluator beside training that evaluates them.

With ``eval.every_steps = E`` the evaluator takes, for each multiple of ``E``, the first version
published at or after it (the version of step 0 too with ``eval.before_training``):
``coordination/eval_pins.py``'s ``wanted_version``, by which the learner also keeps those versions
until the evaluator has done them.

:func:`follow_run` is the evaluator process's loop: it lists the run's published weights and
evaluates the wanted versions oldest first, each with an engine of its own, releasing each to the
learner's pruning once done, until the learner's ``STOP`` (then what is left is evaluated) or a stop
request. The learner never waits for it: they share nothing but the weight files.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rlhf_pipeline.evaluation.evaluator import EvalProgress, Evaluation, open_set_store
from rlhf_pipeline.evaluation.sets import EvalSet


def evaluate_version(evaluation: Evaluation, sets: Sequence[EvalSet], stores: dict[str, Any], version: int,
                     engine_for: Callable[[], Any]) -> bool:
    """Every set at ``version`` (an engine made only when a set needs it); True when nothing is left
    to try (each set done, or given up after its tries)."""
    engine = None
    try:
        for eval_set in sets:
            store = stores[eval_set.name]
            progress = EvalProgress.of(store)
            if version in progress.done or progress.gave_up(version):
                evaluation.evaluate(None, eval_set, version, store)  # only logs a summary a kill kept out
                continue
            engine = engine or engine_for()
            evaluation.evaluate(engine, eval_set, version, store)
    finally:
        if engine is not None:
            engine.close()
    return all(version in (p := EvalProgress.of(stores[s.name])).done or p.gave_up(version) for s in sets)


def follow_run(evaluation: Evaluation, sets: Sequence[EvalSet], paths: Any, make_engine: Callable[[Any, int], Any],
               pins: Any, *, should_stop: Callable[[], bool]) -> None:
    """The evaluator beside training (module docstring). ``make_engine(state_dict, version)`` -> an
    engine holding those weights; ``paths``: the run's ``RunPaths``; ``pins``: its ``EvalPins``."""
    from rlhf_pipeline.coordination.polling import PollBackoff
    from rlhf_pipeline.coordination.weights import load_weights, published_versions

    stores = {s.name: open_set_store(paths.root, s, evaluation.settings) for s in sets}
    backoff = PollBackoff(max_s=0.05)
    settled_below = pins.pinned_from()  # versions below are done (a restarted evaluator goes on from there)
    try:
        while not should_stop():
            learner_done = paths.stop_requested()  # before the listing: every version it published is listed
            todo = [v for v in published_versions(paths.store) if v >= settled_below and pins.wanted(v)]
            if not todo:
                if learner_done:
                    return
                backoff.sleep()
                continue
            version = todo[0]
            try:
                state = load_weights(paths.store, version)[0]
            except FileNotFoundError:  # taken back by a resumed learner: published again as it retrains
                backoff.sleep()
                continue
            if evaluate_version(evaluation, sets, stores, version, lambda: make_engine(state, version)):
                settled_below = version + 1
                pins.release_below(settled_below)
            backoff.reset()
    finally:
        for store in stores.values():
            store.close()
