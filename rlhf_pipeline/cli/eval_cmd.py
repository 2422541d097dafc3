"""``rlhf-pipeline eval RUN [--step N|best | --all-kept] [--set eval.samples=...]``: a run's policy versions
on its pipeline's held-out sets, into the run's eval stores (``<run>/eval/<set>``).

Each (version, set) is evaluated once: a second call evaluates only what is not stored yet, and
prints what is. ``--follow`` is the evaluator that ``run`` starts beside training when
``eval.every_steps`` > 0 (docs/evaluation.md).
"""

from __future__ import annotations

import argparse

from rlhf_pipeline.cli import CommandRefused
from rlhf_pipeline.cli.checks import add_run_argument, step_or_best


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    add_run_argument(parser, "run_dir", metavar="RUN",
                        help="the run directory (holds settings.json, weights/, checkpoints/), a run's URL (s3://..., "
                             "az://...), or a run's name under --home")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--step", type=step_or_best, default=None, metavar="N",
                       help="the policy of learner step N, from a kept checkpoint or published weights; or best: "
                            "the run's best checkpoint by learner.keep_best (e.g. scored again with more samples)")
    which.add_argument("--all-kept", action="store_true",
                       help="every policy version whose weights the run keeps (the default)")
    which.add_argument("--follow", action="store_true",
                       help="evaluate the versions eval.every_steps names as the run publishes them, until its "
                            "learner is done (what `run` starts beside training)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="eval.KEY=VALUE",
                        help="an evaluation setting, e.g. --set eval.samples=8 --set eval.temperature=1.0 "
                             "(repeatable; only eval.* settings)")
    # set by `run` for the evaluator it starts (rlhf_pipeline/runs/launch.py)
    parser.add_argument("--stop-fd", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--wait-for-launcher", action="store_true", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.wait_for_launcher:
        from rlhf_pipeline.runs.launch import wait_for_launcher

        if not wait_for_launcher("eval"):
            return 0  # run's checks failed or it was interrupted; it says why
    for item in args.overrides:
        if not item.strip().startswith("eval."):
            raise CommandRefused(f"--set {item}: eval takes evaluation settings only (eval.every_steps, "
                                 f"eval.before_training, eval.samples, eval.temperature, eval.max_prompts); the "
                                 f"run's other settings are its own")
    from rlhf_pipeline.dataio.model_export import RunNotFoundError, VersionNotFoundError
    from rlhf_pipeline.evaluation.evaluator import EvalEngineUnavailable
    from rlhf_pipeline.files.run_paths import RunLocationError
    from rlhf_pipeline.files.state_files import StateFileError
    from rlhf_pipeline.learn.keep_best import NoBestCheckpoint
    from rlhf_pipeline.pipeline import PipelineError
    from rlhf_pipeline.storage.errors import StoreLockedError

    try:
        return _evaluate(args)
    except (PipelineError, VersionNotFoundError, RunNotFoundError, RunLocationError, StateFileError,
            EvalEngineUnavailable, NoBestCheckpoint) as exc:
        raise CommandRefused(str(exc)) from None
    except StoreLockedError as exc:
        raise CommandRefused(f"another evaluator ({exc.holder or 'another process'}) is writing this run's eval store; "
                             f"wait for it to finish, then run this again")


def _evaluate(args: argparse.Namespace) -> int:
    import dataclasses

    from rlhf_pipeline.dataio.model_export import available_versions, run_at, version_state
    from rlhf_pipeline.dataio.run_pipeline import load_run_pipeline
    from rlhf_pipeline.pipeline import PipelineError, apply_overrides
    from rlhf_pipeline.runs.processes import eval_main, eval_sets_of, set_threads
    from rlhf_pipeline.runs.stopping import StopFlag

    paths = run_at(args.run_dir)
    # published weights, and checkpoints that hold a version (as export-model finds them), through the
    # run's store at a URL; refuses what is not a run, in one line
    available = {v: (lambda source=source: version_state(source))
                 for v, source in available_versions(paths).items()}
    pipeline = load_run_pipeline(paths, device="cpu")  # our loop evaluates on the CPU, beside the learner
    pipeline = dataclasses.replace(pipeline, settings=apply_overrides(pipeline.settings, args.overrides))
    engine_device = _run_device(paths)  # a vLLM of the evaluator's own runs where the run's does
    StopFlag.launcher_fd = args.stop_fd
    set_threads(pipeline)
    if args.follow:
        if not pipeline.settings.eval.enabled:
            raise PipelineError("--follow evaluates the versions eval.every_steps names, which is 0 (off): add "
                                "--set eval.every_steps=N")
        return eval_main(pipeline, paths, engine_device=engine_device)
    publish_every = pipeline.learner.publish_every
    sets, settings = eval_sets_of(pipeline), pipeline.settings.eval
    step = args.step
    if step == "best":
        from rlhf_pipeline.learn.checkpoint import run_best

        best = run_best(paths, "--step N")
        print(f"the best checkpoint, {best.describe()}")
        step = best.step
    if step is not None:
        version, rest = divmod(step, publish_every)
        if not rest and version not in available:  # evaluated beside training, its policy dropped since?
            stored = _stored_progresses(paths, sets, settings)
            if all(progress is not None and version in progress.done for progress in stored.values()):
                _print_stored(stored, [version], publish_every, stopped=False)  # what is stored is the answer
                return 0
        if rest or version not in available:
            kept = ", ".join(str(v * publish_every) for v in available) or "none"
            raise PipelineError(f"--step {step}: no policy of that step is kept in {paths.location}, nor a result "
                                f"of it with these eval settings (versions are published every {publish_every} steps; "
                                f"kept steps: {kept})")
        chosen = [version]
    else:
        chosen = list(available)
    code = eval_main(pipeline, paths, versions=[(v, available[v]) for v in chosen], engine_device=engine_device)
    _print_stored(_stored_progresses(paths, sets, settings), chosen, publish_every, stopped=code != 0)
    return code


def _run_device(paths) -> str:
    """The device the run was started with (its settings.json), where an owned vLLM engine runs."""
    from rlhf_pipeline.files.settings_history import saved_settings

    return str((saved_settings(paths.store) or {}).get("device") or "cpu")


def _stored_progresses(paths, sets, settings) -> dict:
    """Each evaluation's name (a set under these eval settings) -> its ``EvalProgress``, None before its first."""
    from rlhf_pipeline.evaluation.evaluator import EvalProgress, evaluation_name, set_store_location
    from rlhf_pipeline.storage import open_store
    from rlhf_pipeline.storage.errors import StoreNotFoundError

    progresses = {}
    for eval_set in sets:
        name = evaluation_name(eval_set, settings)
        try:
            store = open_store(set_store_location(paths.location, name))
        except StoreNotFoundError:
            progresses[name] = None
            continue
        try:
            progresses[name] = EvalProgress.of(store)
        finally:
            store.close()
    return progresses


def _print_stored(progresses: dict, versions, publish_every: int, *, stopped: bool) -> None:
    """The stored summary of each (version, evaluation) asked for, evaluated now or before; ``stopped``: this
    evaluation was stopped (a signal) before it had done them all."""
    from rlhf_pipeline.evaluation.evaluator import EvalProgress

    for name, progress in progresses.items():
        progress = progress or EvalProgress()
        for version in versions:
            summary = progress.done.get(version)
            where = f"{name} step {version * publish_every} (policy version {version})"
            if version in progress.failed:
                print(f"{where}: failed: {progress.failed[version]}")
                continue
            if summary is None:  # a version the stop came before is no failure
                print(f"{where}: not evaluated" + ("; stopped before it: the same command evaluates it" if stopped
                                                   else ""))
                continue
            shown = ", ".join(f"{key.rsplit('/', 1)[1]} {value:.3f}" for key, value in summary.items()
                              if not key.endswith("/prompts"))
            print(f"{where}: {shown} ({int(summary[f'eval/{name}/prompts'])} prompts)")
