"""The evaluator's process beside a run (``run``'s third child, ``eval RUN``, a Ray actor), and what
the launcher and the learner take from the run's evaluation: its held-out sets checked, the versions
kept for it, the best checkpoint's rule. Design and use: docs/evaluation.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rlhf_pipeline.pipeline import Pipeline, PipelineError, RunPaths
from rlhf_pipeline.runs import stopping
from rlhf_pipeline.runs.stopping import StopFlag


def eval_main(pipeline: Pipeline, paths: RunPaths,
              versions: Sequence[tuple[int, Callable[[], dict[str, Any]]]] | None = None, *,
              engine_device: str = "cpu") -> int:
    """The evaluator: the pipeline's held-out sets at policy versions of the run, each (version, set)
    once into its eval store (``rlhf_pipeline/evaluation``), with an engine of the run's kind
    (``evaluation.evaluator.eval_engine``: the loop, a vLLM of its own on ``engine_device``, or the
    run's server at ``generation.url``, shared under its weights lease), never the learner's.
    ``versions``: ``(version, load its state dict)`` pairs to evaluate (``rlhf-pipeline eval RUN``);
    None: follow the run as it trains, the versions ``eval.every_steps`` names, until the learner is
    done or a stop request (``run``'s third kind of child)."""
    from rlhf_pipeline.evaluation.evaluator import Evaluation, eval_engine, eval_metrics_path, open_set_store
    from rlhf_pipeline.evaluation.follow import VersionEngine, evaluate_version, follow_run
    from rlhf_pipeline.generation.engine import EngineStopped, GenerationEngine
    from rlhf_pipeline.learn.checkpoint import run_checkpoints
    from rlhf_pipeline.learn.keep_best import recorded_keep_best
    from rlhf_pipeline.learn.metrics import MetricsWriter

    stop = StopFlag("evaluator", finish_allowance_s=stopping.EVALUATOR_FINISH_S)
    settings = pipeline.settings.eval
    sets = eval_sets_of(pipeline, TURN_EVAL_OFF if versions is None else "")
    publish_every = pipeline.learner.publish_every
    log_at, store = paths.state_object(eval_metrics_path(paths.root))  # a run at a URL: its object store
    metrics = MetricsWriter(log_at, tensorboard_dir=paths.tensorboard / "eval", store=store,
                            tensorboard_key=paths.key(paths.tensorboard / "eval"))

    def log(step: int, summary: dict[str, float]) -> None:
        metrics.log(step, summary)
        shown = ", ".join(f"{key.split('/', 1)[1]} {value:.3f}" for key, value in summary.items()
                          if "pass@" in key or key.endswith("mean_score"))
        print(f"[eval] step {step} (policy version {int(summary['eval/policy_version'])}): {shown}", flush=True)

    evaluation = Evaluation(pipeline.tokenizer, settings, pipeline.settings.seed, log=log,
                            step_of=lambda version: version * publish_every)
    # at a URL, an evaluator killed elsewhere holds its stores' writer locks until their lease runs out
    lock = ({"lock_wait_s": pipeline.settings.buffer_lock_wait_s, "lock_lease_s": pipeline.settings.buffer_lock_lease_s}
            if paths.url else {})
    engines = VersionEngine(lambda state, version: eval_engine(
        pipeline.settings.generation, pipeline.make_model, pipeline.tokenizer, state, version,
        device=engine_device, seed=pipeline.settings.seed, greedy=settings.temperature == 0))
    GenerationEngine.stopping = stop.event  # every engine of this process: a stop ends a wait for a shared server
    try:
        if versions is None:
            if follow_run(evaluation, sets, paths, engines, eval_pins(pipeline, paths), should_stop=stop.event.is_set,
                          store_options=lock):  # said for a follow that found nothing left as well
                print("[eval] done: the learner finished and every version eval.every_steps names is evaluated",
                      flush=True)
        else:
            stores = {s.name: open_set_store(paths.location, s, evaluation.settings, **lock) for s in sets}
            try:
                for version, load in versions:
                    if stop.event.is_set():
                        break
                    evaluate_version(evaluation, sets, stores, version, engines, load)
            finally:
                for store in stores.values():
                    store.close()
        recorded = recorded_keep_best(paths.store)  # the run's, whatever eval.* this call was given
        if recorded is not None:  # scores came in since the learner last pruned
            learner = pipeline.learner
            run_checkpoints(paths, keep_last=learner.keep_checkpoints, keep_every=learner.checkpoint_keep_every,
                            keep_best=recorded).prune()
    except EngineStopped as exc:  # stopped while waiting for the run's shared server: nothing of it stored
        print(f"[eval] {exc}", flush=True)
    finally:
        engines.close()
        metrics.close()
        GenerationEngine.stopping = None
        stop.restore()
    return stop.exit_code()


def eval_pins(pipeline: Pipeline, paths: RunPaths) -> Any:
    """The run's claim for its evaluator on published weights (``coordination/eval_pins.py``)."""
    from rlhf_pipeline.coordination.eval_pins import EvalPins

    settings = pipeline.settings.eval
    return EvalPins(paths.store, every_steps=settings.every_steps, publish_every=pipeline.learner.publish_every,
                    before_training=settings.before_training)


def keep_best(pipeline: Pipeline, paths: RunPaths) -> Any:
    """``learner.keep_best``'s rule for the run's checkpoints (``learn/checkpoint.py``), or None when off."""
    from rlhf_pipeline.learn.keep_best import KeepBest

    metric = pipeline.learner.keep_best
    return None if metric is None else KeepBest(metric, paths.store, eval_pins(pipeline, paths))


def check_evaluation(pipeline: Pipeline) -> None:
    """With ``eval.every_steps`` on, the pipeline declares held-out sets; ``learner.keep_best`` names a
    summary of that evaluation. PipelineError otherwise."""
    from rlhf_pipeline.evaluation.best import check_keep_best

    settings, metric = pipeline.settings.eval, pipeline.learner.keep_best
    sets = eval_sets_of(pipeline, TURN_EVAL_OFF) if settings.enabled else []
    if metric is not None:
        try:
            check_keep_best(metric, sets, settings)
        except ValueError as exc:
            raise PipelineError(str(exc)) from None


TURN_EVAL_OFF = ", or leave eval.every_steps at 0"
"""What a run that evaluates beside training may do instead of declaring held-out sets."""


def eval_sets_of(pipeline: Pipeline, otherwise: str = "") -> list[Any]:
    """The pipeline's held-out sets, checked (``evaluation.sets.check_sets``), or PipelineError."""
    from rlhf_pipeline.evaluation.sets import check_sets

    try:
        return check_sets(pipeline.eval_sets() if pipeline.eval_sets is not None else None, otherwise)
    except ValueError as exc:
        raise PipelineError(str(exc)) from None
