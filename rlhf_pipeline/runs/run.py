"""``run``, ``collect`` and ``learn``: the checks (what the settings ask of this machine, told
without torch), the run directory held, and for ``run`` its children started, let go and watched
until the learner is done or a signal stops them all, and what the run says at its end. ``run``
imports no torch; its learner child prepares the run. ``docs/pipelines.md#start-up``.

Why one file: a launch reads top to bottom, from its first check to its last line; ``replay``,
``import`` and the Ray driver take those two ends from here rather than from modules of their own.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from rlhf_pipeline.files.log_parts import read_log_records
from rlhf_pipeline.files.run_paths import run_paths
from rlhf_pipeline.files.state_files import StateFileError
from rlhf_pipeline.pipeline import (
    PipelineError,
    RunPaths,
    describe_settings,
    load_pipeline_module,
    make_settings,
    with_flags,
    zarr_where_the_buffer_is_a_url,
)
from rlhf_pipeline.runs import launch
from rlhf_pipeline.runs.branch import refuse_evicting_parent, start_online
from rlhf_pipeline.runs.forking import ForkError
from rlhf_pipeline.runs.run_directory import (  # RunError and prepare_run stay importable from here
    RunError,
    hold_run_directory,
    prepare_run,
    prepare_run_directory,
    publish_initial_policy,
    refuse_unwritable,
)
from rlhf_pipeline.runs.processes import (
    build_pipeline,
    collect_main,
    learn_main,
    refuse_a_second_collector,
    set_threads,
    with_buffer_url,
)
from rlhf_pipeline.runs import stopping
from rlhf_pipeline.runs.stopping import LauncherSignals, StopFlag, stop_children, wait_for_children, wait_quietly
from rlhf_pipeline.schema.ids import MAX_COLLECTORS

# (command, pipeline module, settings, run paths, pipeline path, --set overrides, collectors) -> exit code
RayLaunch = Callable[[str, Any, Any, RunPaths, str, Sequence[str], int], int]


# ====================================================================== entry point
def run_command(command: str, *, pipeline_path: str, steps: int | None = None, home: str | None = None,
                run_name: str | None = None, device: str | None = None,
                overrides: Sequence[str] = (), list_settings: bool = False,
                collectors: int = 1, collector_index: int | None = None, stop_fd: int | None = None,
                wait_for_launcher: bool = False, status_fd: int | None = None,
                on_ray: RayLaunch | None = None) -> int:
    """``on_ray``: place the processes on a Ray cluster instead (``--ray``): called once the run
    directory is held, as ``on_ray(command, module, settings, paths, pipeline_path, overrides,
    collectors)``; the CLI passes :func:`rlhf_pipeline.cluster.driver.ray_launcher`'s. This layer
    knows no Ray: the cluster package builds on it, not the other way round. ``collector_index``: which
    collector ``collect`` is (None: 0, the run's only one, named ``[collector]`` in its lines)."""
    if wait_for_launcher:  # a child of `run`, started before the run directory was ready
        if not launch.wait_for_launcher(command, prepares=status_fd is not None):
            return 0  # run's checks failed or it was interrupted; it says why
    if not 1 <= collectors <= MAX_COLLECTORS:  # the ids a collector hands out keep its index in their high bits
        raise PipelineError(f"--collectors must be in [1, {MAX_COLLECTORS}], got {collectors}")
    named_by_index = collector_index is not None
    collector_index = collector_index or 0
    if not 0 <= collector_index < MAX_COLLECTORS:
        raise PipelineError(f"--collector-index must be in [0, {MAX_COLLECTORS}), got {collector_index}")
    if steps is not None and steps < 1:  # before anything is written, as `replay` refuses it
        raise PipelineError(f"--steps must be >= 1, got {steps}")
    cli_overrides = with_flags(overrides, steps=steps if command != "collect" else None, device=device)
    module = load_pipeline_module(pipeline_path)
    paths = run_paths(Path(pipeline_path).stem if run_name is None else run_name, home)  # "" is refused
    # each child (and Ray actor) is given these: a run at a URL keeps a Zarr buffer there unless told
    cli_overrides = zarr_where_the_buffer_is_a_url(cli_overrides, run_at_a_url=paths.url is not None)
    settings = make_settings(module, cli_overrides)
    if list_settings:
        print(f"settings of {pipeline_path} (change with --set KEY=VALUE):")
        print(describe_settings(settings))
        return 0
    check_settings(module, settings)  # what they ask of this machine and point at: before any process starts
    if on_ray is None:  # now, not after a child imported torch; a Ray cluster's GPUs are not this machine's
        check_cuda_device(settings.device)
        if command != "collect":
            check_lora_trainable(settings.learner.lora)
    if command == "run" and settings.learner.sampler == "epoch":  # its learner found the new buffer empty: a traceback
        raise PipelineError("setting 'learner.sampler' is 'epoch', which walks the rows a buffer holds when the learner "
                            "starts, in epochs, and never those collectors add: for an offline pass over a recorded "
                            "buffer use `rlhf-pipeline replay` (or `learn` on a run that has rows); `run` trains with "
                            "exact, window, groups or prioritized")
    if paths.url is not None and settings.buffer_backend != "zarr":  # a memmap store given a URL makes a dir "s3:"
        raise PipelineError(f"a run at a URL ({paths.url}) keeps its buffer there, which needs a Zarr buffer, but "
                            f"setting 'buffer_backend' is {settings.buffer_backend!r}: leave buffer_backend unset "
                            f"(Zarr is the default there) or --set buffer_backend=zarr")
    start_online(paths)  # a half-made branch is refused; a branch of a run with collectors is set up to go online
    if paths.url is None:
        refuse_evicting_parent(paths.root)  # nor may its parent evict the rows it reads (a local store's eviction)
    if command in ("run", "learn") and _already_finished(command, paths, settings.steps, Path(pipeline_path)):
        return 0
    # one command at a time per run directory; `run`'s children and the ranks of a torchrun'd
    # `learn` run under the holder that started them
    holds = command == "run" or (command == "learn" and not wait_for_launcher and os.environ.get("RANK", "0") == "0")
    if not holds:  # a holder is refused as it takes the directory: now, not after seconds of imports
        refuse_unwritable(paths.root)
    with hold_run_directory(paths, command) if holds else nullcontext() as holder:
        if holds and paths.url is None:  # again under the lock `branch` takes while it makes a branch of it
            refuse_evicting_parent(paths.root)
        StopFlag.launcher_fd = stop_fd
        if on_ray is not None:
            return on_ray(command, module, settings, paths, pipeline_path, cli_overrides, collectors)
        if command == "run":
            # an inherited SIG_IGN (a background job) would swallow `kill -INT`; the handlers are put
            # back on return, for a caller (a test, a notebook) that runs on in this process
            previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, _terminated_while_preparing)
            try:
                return _launch(settings, paths, pipeline_path, steps, device, overrides, collectors, holder=holder)
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
        if command == "learn" and status_fd is not None:
            return prepare_for_launcher(module, settings, paths, collectors, status_fd)
        pipeline = build_pipeline(module, settings, paths)
        paths = with_buffer_url(paths, pipeline)
        set_threads(pipeline)
        if command == "collect":
            if not wait_for_launcher:  # under `run`, the learner prepared the run directory before "go"
                prepare_run_directory(pipeline, paths, shards=(collector_index,), trains=False)
                refuse_a_second_collector(paths, collector_index)  # before seconds of warm start
                publish_initial_policy(pipeline, paths)
            return collect_main(pipeline, paths, rounds=steps, collector_index=collector_index,
                                one_of_several=named_by_index)
        if command == "learn":
            ranks = pipeline.learner.world_size
            if ranks > 1 and "WORLD_SIZE" not in os.environ:  # before the run directory is prepared
                raise PipelineError(f"learner.world_size={ranks} needs {ranks} learner processes: `rlhf-pipeline run` "
                                    f"starts them, or start `learn` with torchrun --nproc-per-node {ranks} -m "
                                    f"rlhf_pipeline.cli.main learn ...")
            initial_policy = prepare_run(pipeline, paths)
            return learn_main(pipeline, paths, initial_policy=initial_policy)
        raise PipelineError(f"unknown command {command!r}")


def _launch(settings: Any, paths: RunPaths, pipeline_path: str, steps: int | None,
            device: str | None, overrides: Sequence[str], collectors: int, *, holder: Any) -> int:
    """``run``: starts the collectors and the learner (and with ``eval.every_steps`` the evaluator), which
    import their modules and wait for ``go``; waits while the learner prepares the run directory
    (collectors go once it exists), then watches them."""
    paths.clear_stop()
    common = [pipeline_path, "--home", paths.home, "--run-name", paths.name,
              *(["--device", device] if device is not None else []), *(w for s in overrides for w in ("--set", s))]
    # collector k writes buffer/shard-kkkk until the learner is done (STOP), so it gets no --steps; the
    # learner reads the union of the shards. The children inherit the run directory's holder lock: it
    # outlives a launcher killed before them
    try:
        children = launch.Children.start(
            common, ["--steps", str(steps)] if steps is not None else [], collectors, settings.learner.world_size,
            keep_fds=(holder.fd,) if holder.fd >= 0 else (),
            evaluator=launch.evaluator_argv(paths.location, overrides) if settings.eval.enabled else None)
    except ForkError as exc:
        raise RunError(str(exc)) from None
    try:
        wait_for_preparation(children)
    except BaseException:
        children.abandon()
        raise
    return _run_both(paths, collectors, children, holder_lost=lambda: getattr(holder, "lost", False))


def check_settings(module: Any, settings: Any) -> None:
    """The checks that look past the settings' own values, none of which needs torch: what they ask of
    this machine (``RunSettings.check_machine``: the engine's Python, vLLM's head sizes) and what they
    point at (the pipeline file's optional ``check(settings)``: a data file, a model's directory).
    ValueError counts as PipelineError."""
    try:
        check = getattr(module, "check", None)
        if check is not None:
            check(settings)
        settings.check_machine()
    except PipelineError:
        raise
    except ValueError as exc:
        raise PipelineError(str(exc)) from None


def wait_for_preparation(children: Any) -> None:
    """Launcher side of :func:`prepare_for_launcher`: lets the collectors go once the run directory
    exists, returns once weights version 0 is published; raises the learner's error as ``run``'s."""
    for event in (launch.PREPARED, launch.READY):
        report = children.wait_for_learner(event)
        if report is None:
            code = children.learner.wait()
            raise RunError(f"the learner ended while preparing the run ({launch.how_it_ended(code)})")
        if report["event"] == launch.ERROR:
            raise _learner_error(report)
        if event == launch.PREPARED:
            # the collectors (and the evaluator) build their side and wait for weights version 0
            children.go([*children.collectors.values(), *children.helpers])
    children.go()  # the other learner ranks start from version 0 (rank 0 needs no "go")


def _learner_error(report: dict) -> Exception:
    """The exception the learner reported, as ``run`` would have raised it itself."""
    kind, message = report.get("kind"), report.get("message", "")
    if report.get("errno") is not None:
        return OSError(report["errno"], report.get("strerror"), report.get("filename"))
    classes = {"PipelineError": PipelineError, "RunError": RunError, "StateFileError": StateFileError}
    return classes.get(kind, RunError)(message)


def prepare_for_launcher(module: Any, settings: Any, paths: RunPaths, collectors: int, status_fd: int) -> int:
    """The learner child of ``run``: builds the pipeline (checks, preflight), prepares the run
    directory for ``collectors`` shards, warm-starts and publishes weights version 0, reporting
    each stage to ``run`` on ``status_fd``; then learns. A failed check is reported, not printed
    (``run`` prints it), and exits 2."""
    reports = launch.LauncherReports(status_fd)
    try:
        try:
            pipeline = build_pipeline(module, settings, paths)
            paths = with_buffer_url(paths, pipeline)
            set_threads(pipeline)  # before the warm start
            prepare_run_directory(pipeline, paths, shards=range(collectors))
            reports.send(launch.PREPARED)
            # the pipeline's make_policy (its warm start, its initial weights) may refuse too
            initial_policy = publish_initial_policy(pipeline, paths)
        except (PipelineError, RunError, StateFileError, OSError) as exc:
            if reports.error(exc):
                return 2
            raise  # the launcher is gone: say it here
        reports.send(launch.READY)
        reports.close()
    except KeyboardInterrupt:  # Ctrl-C reached the whole process group; the launcher reports it
        return 130
    return learn_main(pipeline, paths, initial_policy=initial_policy)


def _terminated_while_preparing(signum, frame) -> None:
    print("[run] interrupted (SIGTERM) while preparing the run, before the first learner step; "
          "run the same command again", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


def _already_finished(command: str, paths: RunPaths, steps: int, pipeline_file: Path) -> bool:
    """Says so when the newest checkpoint already reached ``steps`` (before any slow work), for the
    run's own pipeline: another file given is left to the checks that refuse it, naming why."""
    from rlhf_pipeline.learn.checkpoint import run_checkpoints
    from rlhf_pipeline.runs.pipeline_copy import differs_from_copy

    reached = run_checkpoints(paths).latest_step()
    if reached is None or reached < steps:
        return False
    given = pipeline_file.resolve()
    if not (paths.url is None and given == paths.pipeline_file.resolve()) and differs_from_copy(given, paths.store):
        return False
    print(f"[{command}] {paths.location} has already reached step {reached} (--steps {steps}); nothing to do. "
          f"To train further, raise --steps, e.g. --steps {reached + max(steps, 1)}", file=sys.stderr)
    return True


# ====================================================================== both
def _run_both(paths: RunPaths, collectors: int, children, holder_lost: Callable[[], bool] = lambda: False) -> int:
    """Lets the waiting children go, then watches them until the learner is done or a signal."""
    collector_procs, learner, ranks = children.collectors, children.learner, children.learners
    evaluator, evaluator_said = children.evaluator, False
    killed: set[int] = set()  # collectors this launcher killed, stuck in a round past the learner's last step
    stop_write = children.stop_write
    print(f"[run] run directory {paths.location}" + (f" with {collectors} collectors" if collectors > 1 else ""),
          file=sys.stderr, flush=True)
    signals = LauncherSignals()  # before the children go, so no signal is missed
    try:
        children.go()
        processes = [*collector_procs.values(), *ranks, *children.helpers]
        bounded = {p: ("the collector" if collectors == 1 else f"collector {k}", stopping.COLLECTOR_FINISH_S)
                   for k, p in collector_procs.items()}
        if evaluator is not None:
            bounded[evaluator] = ("the evaluator", stopping.EVALUATOR_FINISH_S)
        while not signals.received and learner.poll() is None:
            if evaluator is not None and evaluator.poll() not in (None, 0) and not evaluator_said:
                evaluator_said = True  # an evaluation never stops training
                print(launch.evaluator_exited(evaluator.returncode, paths.location), file=sys.stderr, flush=True)
            if any(p.poll() not in (None, 0) for p in ranks):
                # a failed data-parallel rank leaves the others in a collective that never ends
                launch.stop_ranks(ranks)
                break
            if holder_lost():
                # a run at a URL: another command took the run over (this one's lease ran out unrenewed)
                stop_children(stop_write, processes, signals, bounded)
                raise RunError(f"{paths.location} was taken over by another command (this one's lease on run.lock "
                               f"was not renewed in time); stopped its collectors and learner")
            for p in collector_procs.values():
                code = p.poll()
                if code is None or (code == 0 and paths.stop_requested()):
                    # (a clean exit after STOP means the learner finished and is exiting too)
                    continue
                # a collector died: stop the learner (it checkpoints) and the other collectors
                stop_children(stop_write, processes, signals, bounded)
                raise RunError(f"{bounded[p][0]} ended early ({launch.how_it_ended(code)}). The learner saved a "
                               f"checkpoint: once the cause is fixed, the same command resumes the run (a fix in "
                               f"the pipeline file is refused first, as a change to what the run trains, with "
                               f"how to go on with it)")
            time.sleep(0.2)
        if signals.received:
            stop_children(stop_write, processes, signals, bounded)
        else:
            paths.request_stop()  # every collector ends after its current round
            stuck = wait_for_children(list(collector_procs.values()), signals,
                                      {p: bounded[p] for p in collector_procs.values()})
            killed = {k for k, p in collector_procs.items() if p in stuck}
            if evaluator is not None:  # it evaluates the versions left (the last one's too), then ends
                wait_quietly(evaluator, bounded[evaluator][1], name=bounded[evaluator][0])
                if evaluator.returncode not in (None, 0) and not evaluator_said:
                    print(launch.evaluator_exited(evaluator.returncode, paths.location, training_done=True),
                          file=sys.stderr, flush=True)
    finally:
        signals.restore()
        os.close(stop_write)
    for rank, p in enumerate(ranks[1:], start=1):  # rank 0 is done: the others end with it
        wait_quietly(p, timeout=60.0, name=f"learner rank {rank}")
    learner_code = next((p.returncode for p in ranks if p.returncode not in (0, None)), learner.returncode)
    # a collector killed once the learner was done lost only the round it was stuck in, which no step needs
    failed = {k: p.returncode for k, p in collector_procs.items()
              if p.returncode not in (0, 130, 143) and k not in killed}
    if learner_code == 0 and not failed:  # the learner took every step, even if a signal came late
        print_summary(paths)
        return 0
    if signals.received or learner_code in (130, 143):
        signum = signals.received[0] if signals.received else learner_code - 128
        print_interrupted(paths, signum)
        return 128 + signum
    if learner_code != 0:
        raise RunError(f"the learner failed ({launch.how_it_ended(learner_code)})")
    raise RunError("; ".join(f"collector {k} failed ({launch.how_it_ended(c)})" for k, c in failed.items()))


# ====================================================================== what the settings ask of this machine
# told without importing torch: a CUDA device (a GPU driver's files) for --device cuda, peft for
# learner.lora.rank > 0; refused before a child imports torch to find it missing

# NVIDIA's driver (a container given a GPU gets these too), Jetson's integrated GPU, AMD's ROCm (torch
# answers to "cuda" there), WSL 2's pass-through
GPU_DRIVER_FILES = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/nvhost-ctrl-gpu", "/dev/kfd", "/dev/dxg")


def no_cuda_reason(platform: str = sys.platform, root: str = "/") -> str | None:
    """Why no CUDA device can be used here, or None when one may be. ``root``: where to look for
    the driver's files (tests)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU from this process"
    if platform == "darwin":
        return "macOS has no CUDA"
    if not platform.startswith("linux"):
        return None
    here = [os.path.join(root, path.lstrip("/")) for path in GPU_DRIVER_FILES]
    if any(os.path.exists(path) for path in here) or glob.glob(os.path.join(root, "dev", "nvidia[0-9]*")):
        return None
    return "this machine has no GPU driver (no /dev/nvidia*, /proc/driver/nvidia, /dev/kfd or /dev/dxg)"


def check_cuda_device(device: str, what: str = "setting 'device'") -> None:
    """Raises :class:`PipelineError` when ``device`` is a CUDA device this machine cannot have."""
    if not str(device).startswith("cuda"):
        return
    reason = no_cuda_reason()
    if reason is not None:
        raise PipelineError(f"{what} is {device!r} but {reason}; use --device cpu")


def check_lora_trainable(lora: Any) -> None:
    """Raises :class:`PipelineError` when ``lora`` (``learner.lora``) asks for an adapter and peft, which
    the learner trains it with, is not installed: the learner's process found out with a traceback once
    the collectors were sampling. A collector needs no peft (it merges adapters with torch alone)."""
    if lora.enabled and importlib.util.find_spec("peft") is None:
        raise PipelineError(f"setting 'learner.lora.rank' is {lora.rank}: a LoRA learner trains its adapter with "
                            f"peft, which is not installed; install it with `pip install -e '.[lora]'` (from a "
                            f"checkout) or `pip install 'rlhf-pipeline[lora]'`")


# ====================================================================== what a finished or interrupted run says
# its newest checkpoint's step and the reward it reached: printed by the launcher (here or on Ray) once its
# children are done
def print_interrupted(paths: RunPaths, signum: int) -> None:
    """What ``run`` (on this machine or on Ray) says when a signal stopped it: how far the learner's
    checkpoints reached, and how to resume."""
    from rlhf_pipeline.learn.checkpoint import run_checkpoints

    reached = run_checkpoints(paths).latest_step()
    saved = f"the learner's newest checkpoint is at step {reached}; " if reached is not None else ""
    print(f"[run] interrupted ({signal.Signals(signum).name}); {saved}run the same command again to "
          f"resume {paths.location}", file=sys.stderr, flush=True)


def reward_first_and_last(records: list[dict]) -> tuple[int, float, float]:
    """The mean training reward of the first and of the last tenth of a run's logged steps (at least
    one step each), and how many steps a tenth is: what the run's last line reports (NaN without any)."""
    rewards = [r["charts/reward_mean"] for r in records if "charts/reward_mean" in r]
    k = max(1, len(rewards) // 10)
    first = sum(rewards[:k]) / k if rewards else float("nan")
    last = sum(rewards[-k:]) / k if rewards else float("nan")
    return k, first, last


def print_summary(paths: RunPaths) -> None:
    records = read_log_records(paths.store, paths.key(paths.metrics))
    if not records:
        return
    k, first, last = reward_first_and_last(records)
    steps = "step" if k == 1 else f"{k} steps"
    print(f"[run] done: {records[-1]['step']} learner steps; mean reward {first:.3f} "
          f"(first {steps}) -> {last:.3f} (last {steps})", file=sys.stderr)
    from rlhf_pipeline.learn.checkpoint import kept_best

    _, best = kept_best(paths)  # read once the evaluator is done
    if best is not None:
        print(f"[run] best checkpoint by {best.metric}: {best.describe()} "
              f"(rlhf-pipeline export-model {paths.location} OUT --best)", file=sys.stderr)
    if paths.url is not None:
        metrics = paths.store.describe(paths.key(paths.metrics))
        print(f"[run] metrics: {metrics} (parts)  tensorboard: {paths.store.describe('tensorboard')} "
              f"(uploaded at the end; cached in {paths.tensorboard})", file=sys.stderr)
        return
    print(f"[run] metrics: {paths.metrics}  tensorboard: {paths.tensorboard}", file=sys.stderr)

