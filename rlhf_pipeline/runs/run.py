"""Process orchestration for ``run`` / ``collect`` / ``learn``.

Order of work, so bad settings fail before anything starts:

1. load the pipeline file, apply ``--set`` / ``--steps`` / ``--device``, run its torch-free
   ``check`` (if it has one), ``build`` it (settings checks) and run its ``preflight`` (e.g. the
   reward on one sample);
2. prepare the run directory under a file lock (``run_directory.py``; idempotent, so ``collect``
   and ``learn`` started side by side agree): check ``settings.json`` against a previous start, create
   the buffer (:func:`prepare_run_directory`), then build the initial policy (warm start) and
   publish it as weights version 0 (:func:`publish_initial_policy`);
3. ``run`` starts ``--collectors N`` ``collect`` processes (collector ``k`` writes its own
   shard ``buffer/shard-kkkk``, see ``storage/sharded.py``) and one ``learn`` process with the
   same arguments, and waits for the learner; then it writes ``STOP``, which ends every
   collector after its current round. A child that fails stops the others.

``run`` itself imports no torch (three processes importing torch, tensordict and transformers
at once on a small machine cost seconds before the first step): it does step 1's ``check``
only, and its learner child does the rest of steps 1 and 2 while the collectors import, then
build their side during the warm start (:func:`prepare_for_launcher`, ``launch.py``). An error
of ``build``, ``preflight`` or the run directory reaches ``run`` through a pipe, and ``run``
raises it as its own (same message, exit code 2); nothing is created before they pass.

Both sides stop cleanly on Ctrl-C / SIGTERM: the collector finishes its round (rows are
durable once written), the learner saves a checkpoint. Running the same command again
resumes from there. ``run`` itself takes SIGINT and SIGTERM (a terminal's Ctrl-C, ``kill``,
a job scheduler, ``docker stop``): it asks every child to stop through a pipe they all
watch (``--stop-fd``), waits for them and exits with 130 / 143. A child also stops cleanly
when that pipe closes without a word: the launcher is gone, even by ``kill -9``. A second
signal to ``run`` kills the children at once (what a ``kill -9`` costs: the learner's steps
since its last checkpoint; nothing written to the buffer).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from rlhf_pipeline.files.run_paths import run_dir as make_run_dir
from rlhf_pipeline.pipeline import (
    Pipeline,
    PipelineError,
    RunPaths,
    describe_settings,
    load_pipeline_module,
    make_settings,
    settings_to_json,
)
from rlhf_pipeline.runs.run_directory import (  # RunError and prepare_run stay importable from here
    RunError,
    hold_run_directory,
    prepare_run,
    prepare_run_directory,
    publish_initial_policy,
)
from rlhf_pipeline.runs.stopping import (
    LauncherSignals,
    StopFlag,
    ask_children_to_stop,
    wait_for_children,
    wait_quietly,
)

# ====================================================================== entry point
def run_command(command: str, *, pipeline_path: str, steps: int | None = None, home: str | None = None,
                run_name: str | None = None, device: str | None = None,
                overrides: Sequence[str] = (), list_settings: bool = False,
                collectors: int = 1, collector_index: int = 0, stop_fd: int | None = None,
                wait_for_launcher: bool = False, status_fd: int | None = None,
                ray_address: str | None = None) -> int:
    """``ray_address``: run on Ray (``--ray [ADDRESS]``, ray_run.py); "" starts a local cluster."""
    if wait_for_launcher:  # a child of `run`, started before the run directory was ready
        from rlhf_pipeline.runs.launch import wait_for_launcher as wait

        if not wait(command, prepares=status_fd is not None):
            return 0  # run's checks failed or it was interrupted; it says why
    if collectors < 1:
        raise PipelineError(f"--collectors must be >= 1, got {collectors}")
    if collector_index < 0:
        raise PipelineError(f"--collector-index must be >= 0, got {collector_index}")
    if steps is not None and steps < 1:  # before anything is written, as `replay` refuses it
        raise PipelineError(f"--steps must be >= 1, got {steps}")
    if ray_address is not None:
        from rlhf_pipeline.cluster.driver import require_ray

        require_ray(command)  # before any slow work: one line when Ray is missing
    module = load_pipeline_module(pipeline_path)
    cli_overrides = list(overrides)
    if steps is not None and command != "collect":
        cli_overrides.append(f"steps={steps}")
    if device is not None:
        cli_overrides.append(f"device={device}")
    settings = make_settings(module, cli_overrides)
    if list_settings:
        print(f"settings of {pipeline_path} (change with --set KEY=VALUE):")
        print(describe_settings(settings))
        return 0
    if command in ("run", "learn") and settings.steps < 1:  # --set steps=0
        raise PipelineError(f"setting 'steps' must be >= 1, got {settings.steps}")
    paths = RunPaths(make_run_dir(run_name or Path(pipeline_path).stem, home).resolve())
    if command in ("run", "learn") and _already_finished(command, paths, settings.steps):
        return 0
    _check_writable(paths.root)  # now, not after seconds of imports and model building
    # one command at a time per run directory; `run`'s children and the ranks of a torchrun'd
    # `learn` run under the holder that started them
    holds = command == "run" or (command == "learn" and not wait_for_launcher and os.environ.get("RANK", "0") == "0")
    with hold_run_directory(paths, command) if holds else nullcontext() as holder:
        StopFlag.launcher_fd = stop_fd
        if ray_address is not None:
            from rlhf_pipeline.cluster.driver import launch_on_ray

            return launch_on_ray(command, module, settings, paths, pipeline_path, cli_overrides, collectors,
                                 address=ray_address)
        if command == "run":
            # an inherited SIG_IGN (a background job) would swallow `kill -INT`; the handlers are put
            # back on return, for a caller (a test, a notebook) that runs on in this process
            previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, _terminated_while_preparing)
            try:
                return _launch(module, settings, paths, pipeline_path, steps, device, overrides, collectors,
                               holder_fd=holder.fd)
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
                prepare_run(pipeline, paths, shards=(collector_index,))
            return collect_main(pipeline, paths, rounds=steps, collector_index=collector_index)
        if command == "learn":
            ranks = pipeline.learner.world_size
            if ranks > 1 and "WORLD_SIZE" not in os.environ:  # before the run directory is prepared
                raise PipelineError(f"learner.world_size={ranks} needs {ranks} learner processes: `rlhf-pipeline run` "
                                    f"starts them, or start `learn` with torchrun --nproc-per-node {ranks} -m "
                                    f"rlhf_pipeline.cli.main learn ...")
            prepare_run(pipeline, paths)
            return learn_main(pipeline, paths)
        raise PipelineError(f"unknown command {command!r}")


def _launch(module: Any, settings: Any, paths: RunPaths, pipeline_path: str, steps: int | None,
            device: str | None, overrides: Sequence[str], collectors: int, *, holder_fd: int) -> int:
    """``run``: checks what it can without torch, starts the children, waits while the learner
    prepares the run directory (collectors go once it exists), then watches them."""
    check_settings(module, settings)
    children = _start_children(pipeline_path, steps, paths, device, overrides, collectors,
                               learner_ranks=getattr(getattr(settings, "learner", None), "world_size", 1),
                               holder_fd=holder_fd)
    try:
        wait_for_preparation(children)
    except BaseException:
        children.abandon()
        raise
    return _run_both(paths, collectors, children)


def check_settings(module: Any, settings: Any) -> None:
    """The pipeline file's optional ``check(settings)``: settings checks that need no torch, so
    ``run`` reports them at once, before any process starts. ValueError counts as PipelineError."""
    check = getattr(module, "check", None)
    if check is None:
        return
    try:
        check(settings)
    except PipelineError:
        raise
    except ValueError as exc:
        raise PipelineError(f"{type(exc).__name__}: {exc}") from exc


def wait_for_preparation(children: Any) -> None:
    """Launcher side of :func:`prepare_for_launcher`: lets the collectors go once the run directory
    exists, returns once weights version 0 is published; raises the learner's error as ``run``'s."""
    from rlhf_pipeline.runs.launch import ERROR, PREPARED, READY

    for event in (PREPARED, READY):
        report = children.wait_for_learner(event)
        if report is None:
            code = children.learner.wait()
            raise RunError(f"the learner exited while preparing the run (exit code {code}); see its error above")
        if report["event"] == ERROR:
            raise _learner_error(report)
        if event == PREPARED:
            # the collectors build their side and wait for weights version 0
            children.go(list(children.collectors.values()))
    children.go()  # the other learner ranks start from version 0 (rank 0 needs no "go")


def _learner_error(report: dict) -> Exception:
    """The exception the learner reported, as ``run`` would have raised it itself."""
    from rlhf_pipeline.files.state_files import StateFileError

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
    from rlhf_pipeline.runs.launch import PREPARED, READY, LauncherReports
    from rlhf_pipeline.files.state_files import StateFileError

    reports = LauncherReports(status_fd)
    try:
        try:
            pipeline = build_pipeline(module, settings, paths)
            paths = with_buffer_url(paths, pipeline)
            set_threads(pipeline)  # before the warm start
            prepare_run_directory(pipeline, paths, shards=range(collectors))
        except (PipelineError, RunError, StateFileError, OSError) as exc:
            if reports.error(exc):
                return 2
            raise  # the launcher is gone: say it here
        reports.send(PREPARED)
        publish_initial_policy(pipeline, paths)
        reports.send(READY)
        reports.close()
    except KeyboardInterrupt:  # Ctrl-C reached the whole process group; the launcher reports it
        return 130
    return learn_main(pipeline, paths)


def build_pipeline(module: Any, settings: Any, paths: RunPaths) -> Pipeline:
    """``module.build`` plus ``preflight``; any ValueError there is a settings error."""
    try:
        pipeline = module.build(settings, paths)
        if not isinstance(pipeline, Pipeline):
            raise PipelineError(
                f"build() must return rlhf_pipeline.pipeline.Pipeline, got {type(pipeline).__name__}"
            )
        pipeline.preflight()
    except PipelineError:
        raise
    except (ValueError, FileNotFoundError) as exc:  # PromptError, RewardError, ModelLoadError...
        raise PipelineError(f"{type(exc).__name__}: {exc}") from exc
    return pipeline


def with_buffer_url(paths: RunPaths, pipeline: Pipeline) -> RunPaths:
    """``paths`` with the pipeline's ``buffer_url`` (the buffer on object storage), checked."""
    url = pipeline.buffer_url
    if not url:
        return paths
    if "://" not in url:
        raise PipelineError(f"setting 'buffer_url' must be a URL such as s3://bucket/run/buffer, got {url!r}; "
                            f"leave it unset to keep the buffer in the run directory")
    return dataclasses.replace(paths, buffer_url=url)


def _terminated_while_preparing(signum, frame) -> None:
    print("[run] interrupted (SIGTERM) while preparing the run, before the first learner step; "
          "run the same command again", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


def _check_writable(root: Path) -> None:
    """Raises the OSError that writing the run directory would raise (read-only, not a directory,
    no permission), without creating anything: a bad setting found later leaves no directory."""
    existing = root
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(existing))
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(existing))
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(existing))


def _already_finished(command: str, paths: RunPaths, steps: int) -> bool:
    """Says so when the newest checkpoint already reached ``steps`` (before any slow work)."""
    from rlhf_pipeline.learn.checkpoint import CheckpointManager

    reached = CheckpointManager(paths.checkpoints).latest_step()
    if reached is None or reached < steps:
        return False
    print(f"[{command}] {paths.root} has already reached step {reached} (--steps {steps}); nothing to do. "
          f"To train further, raise --steps, e.g. --steps {reached + max(steps, 1)}", file=sys.stderr)
    return True


# ====================================================================== collector side
def collect_main(pipeline: Pipeline, paths: RunPaths, rounds: int | None = None,
                 collector_index: int = 0, poller: Any = None) -> int:
    """Collects rounds until ``rounds``, a stop request, or the learner's ``STOP`` file.

    ``poller``: where new weights come from (``poll() -> (state_dict, version) | None`` and
    ``current_version``); default the run's weight files (``weights.WeightsPoller``).

    Collector ``collector_index`` writes its own shard ``buffer/shard-kkkk`` (with its own
    pending groups) and keeps its own position in ``collector/shard-kkkk.pt``.
    """
    from rlhf_pipeline.collect.position import CollectorPosition
    from rlhf_pipeline.learn.metrics import MetricsWriter
    from rlhf_pipeline.coordination.pacing import CollectorPacer, shard_key
    from rlhf_pipeline.coordination.polling import PollBackoff
    from rlhf_pipeline.storage import open_store
    from rlhf_pipeline.coordination.weights import WeightsPoller

    stop = StopFlag()
    tag = "[collector]" if collector_index == 0 else f"[collector {collector_index}]"
    state_file = paths.collector_state(collector_index)
    store_path = str(paths.buffer) if paths.single_store_buffer else paths.shard_location(collector_index)
    # the writer lock: one collector per shard; on an object store, a predecessor that died on
    # another machine holds it until its lease runs out, which is waited for
    lock_wait = ({"lock_wait_s": pipeline.buffer_lock_wait_s, "lock_lease_s": pipeline.buffer_lock_lease_s}
                 if paths.buffer_url else {})
    store = open_store(store_path, mode="a", **lock_wait)
    done = 0
    try:
        model = pipeline.make_model()
        poller = poller if poller is not None else WeightsPoller(paths.root)
        update = _wait_for_weights(poller, stop)
        if update is None:  # stopped while the learner warm-started: nothing written yet
            print(f"{tag} stopped before any policy weights were published", file=sys.stderr, flush=True)
            return stop.exit_code()
        state, version = update
        model.load_state_dict(state)
        collector = _make_collector(pipeline, model, store, collector_index)
        # prompt position, id counters and sampling RNG: no prompt skipped or repeated, even
        # after a crash between a round's append and the save of the state after it
        position = CollectorPosition(state_file, store)
        saved = position.load()
        if saved is not None:
            collector.load_state_dict(saved)
        if position.resumed_inflight_round:
            print(f"{tag} the round in flight at the last stop was written; resuming after it",
                  file=sys.stderr, flush=True)
        collector.set_policy_state(state, version)
        rounds_at_version = 0
        # generate no more than the learner will take in, plus collect_rounds_ahead rounds
        # (alone, with no learner yet, it may be recording a buffer: unpaced until one publishes)
        key = shard_key(store_path, paths.buffer) if not paths.buffer_url else f"shard-{collector_index:04d}"
        pacer = CollectorPacer(paths.pacing, key, pipeline.collect_rounds_ahead,
                               round_rows=_round_rows(collector), learner_expected=stop.launcher_fd is not None)
        metrics = MetricsWriter(paths.collector_metrics(collector_index))
        waited = paced_total = 0.0
        paced = PollBackoff(max_s=0.02)  # the learner takes the next batch within a step: poll soon
        lease_s = getattr(store, "writer_lease_s", None)  # an object store's leased lock
        lease = f" (writer lock lease {lease_s:g} s)" if lease_s is not None else ""
        print(f"{tag} writing to {store_path}{lease} with policy version {version}", file=sys.stderr, flush=True)
        # a paced round takes the version pacing names for it, not the newest: the same weights
        # for every round of a seed, whenever the learner publishes (pacing.py)
        pinned = pacer.rounds_ahead is not None and hasattr(poller, "poll_version")
        while not _should_stop(stop, paths) and (rounds is None or done < rounds):
            limit = pipeline.collect_rounds_per_version
            allowed = pacer.may_collect(store.next_row)
            version = pacer.version_for_round(store.next_row) if pinned and allowed else None
            if version is not None:
                if limit is not None and rounds_at_version >= limit:
                    version = max(version, collector.policy_version + 1)
                update = poller.poll_version(version)
            else:  # unpaced, or a round only the stall rule allowed: the newest
                update = poller.poll() if allowed or not pinned else None
            if update is not None:
                collector.set_policy_state(*update)
                rounds_at_version = 0
            behind = version is not None and collector.policy_version < version
            if behind or (limit is not None and rounds_at_version >= limit) or not allowed:
                # far enough ahead of the learner: more rows now would go stale or untrained
                started = time.perf_counter()
                paced.sleep()
                waited += time.perf_counter() - started
                continue
            paced.reset()
            rows_before = store.next_row
            batch = collector.collect(before_write=position.before_write)
            position.after_write(collector.state_dict())
            pacer.round_written(store.next_row - rows_before)
            done += 1
            rounds_at_version += 1
            paced_total += waited
            metrics.log(getattr(collector, "batches_emitted", done), {
                **getattr(collector, "last_metrics", {}), "rows_written": float(store.next_row - rows_before),
                "shard_rows": float(store.next_row), "paced_wait_s": waited})
            waited = 0.0
            if done % 50 == 0:
                print(f"{tag} round {done}: {len(batch)} rows, shard {len(store)} rows, "
                      f"policy version {poller.current_version}, {paced_total:.1f}s waiting for the learner",
                      file=sys.stderr, flush=True)
        metrics.close()
    finally:
        store.close()
        stop.restore()
    print(f"{tag} stopped after {done} rounds ({paced_total:.1f}s waiting for the learner to take rows in)",
          file=sys.stderr, flush=True)
    return stop.exit_code()


def _round_rows(collector: Any) -> int | None:
    """Rows one round writes, when the collector says (``CollectorConfig``); pacing counts in rounds."""
    config = getattr(collector, "config", None)
    try:
        return int(config.prompts_per_batch) * int(config.num_generations)
    except (AttributeError, TypeError, ValueError):
        return None


def set_threads(pipeline: Pipeline) -> None:
    """``pipeline.torch_threads`` intra-op threads in this process (collector and learner run side by side)."""
    if pipeline.torch_threads is not None:
        import torch

        torch.set_num_threads(pipeline.torch_threads)


def _make_collector(pipeline: Pipeline, model: Any, store: Any, collector_index: int) -> Any:
    """``pipeline.make_collector`` for collector ``collector_index``; checks the ids it will use."""
    import inspect

    make = pipeline.make_collector
    try:
        params = inspect.signature(make).parameters.values()
    except (TypeError, ValueError):
        params = []
    takes_index = any(p.name == "collector_index" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    if takes_index:
        collector = make(model, store, collector_index=collector_index)
    elif collector_index == 0:
        collector = make(model, store)
    else:
        raise PipelineError(
            "the pipeline's make_collector(model, store) takes no collector_index, so it can run "
            "collector 0 only; add a `collector_index=0` parameter and pass it to "
            "CollectorConfig(collector_index=...) to run several collectors"
        )
    got = getattr(getattr(collector, "config", None), "collector_index", None)
    if got is not None and got != collector_index:
        raise PipelineError(
            f"make_collector(..., collector_index={collector_index}) returned a collector with "
            f"collector_index {got}; pass it to CollectorConfig so ids stay unique across collectors"
        )
    return collector


def _wait_for_weights(poller, stop: StopFlag):
    """The first published weights, or None when asked to stop before there were any."""
    while True:
        update = poller.poll()
        if update is not None:
            return update
        if stop.event.is_set():
            return None
        time.sleep(0.05)  # the first round waits on this: poll often (a directory listing)


def _should_stop(stop: StopFlag, paths: RunPaths) -> bool:
    return stop.event.is_set() or paths.stop_file.exists()


# ====================================================================== learner side
def learn_main(pipeline: Pipeline, paths: RunPaths, data_parallel: Any = None,
               on_learner: Any = None) -> int:
    """``data_parallel``: this rank (default: torchrun's environment, else one rank);
    ``on_learner(learner)`` runs once the learner is built (Ray attaches its weights publisher)."""
    import torch

    from rlhf_pipeline.learn.distributed import DataParallel
    from rlhf_pipeline.learn.learner import Learner

    # under torchrun: one of N data-parallel ranks (learn/distributed.py); rank 0 writes the files
    data_parallel = data_parallel if data_parallel is not None else DataParallel.from_torchrun_env()
    stop = StopFlag()
    if data_parallel.is_main:
        paths.stop_file.unlink(missing_ok=True)  # a resumed learner wants collectors running
    data_parallel.start(torch.device(pipeline.settings.device))
    learner = Learner.from_pipeline(pipeline, paths, stop_event=stop.event, data_parallel=data_parallel)
    if on_learner is not None:
        on_learner(learner)
    try:
        learner.setup()
        finished = learner.train()
    finally:
        learner.cleanup()
        stop.restore()
        data_parallel.stop()
    if finished:
        if data_parallel.is_main:
            paths.stop_file.touch()  # tells collectors of this run that the learner is done
        return 0
    return stop.exit_code() or 1  # not finished: the launcher must not report "done"


# ====================================================================== both
def _start_children(pipeline_path: str, steps: int | None, paths: RunPaths, device: str | None,
                    overrides: Sequence[str], collectors: int, learner_ranks: int = 1, holder_fd: int = -1):
    """Starts the collectors and the learner, which import their modules and wait for ``go``."""
    from rlhf_pipeline.runs.launch import Children

    paths.stop_file.unlink(missing_ok=True)
    common = [pipeline_path, "--home", str(paths.root.parent), "--run-name", paths.root.name]
    if device is not None:
        common += ["--device", device]
    for item in overrides:
        common += ["--set", item]
    # the collector runs until the learner is done (STOP), so it gets no --steps
    learner_steps = ["--steps", str(steps)] if steps is not None else []
    launcher = [sys.executable, "-m", "rlhf_pipeline.cli.main"]
    # collector k writes buffer/shard-kkkk; the learner reads the union of the shards
    # the children inherit the run directory's holder lock: it outlives a launcher killed before them
    return Children.start(launcher, common, learner_steps, collectors, learner_ranks,
                          keep_fds=(holder_fd,) if holder_fd >= 0 else ())


def _run_both(paths: RunPaths, collectors: int, children) -> int:
    """Lets the waiting children go, then watches them until the learner is done or a signal."""
    from rlhf_pipeline.runs.launch import stop_ranks

    collector_procs, learner, ranks = children.collectors, children.learner, children.learners
    stop_write = children.stop_write
    print(f"[run] run directory {paths.root}" + (f" with {collectors} collectors" if collectors > 1 else ""),
          file=sys.stderr, flush=True)
    signals = LauncherSignals()  # before the children go, so no signal is missed
    try:
        children.go()
        processes = [*collector_procs.values(), *ranks]
        while not signals.received and learner.poll() is None:
            if any(p.poll() not in (None, 0) for p in ranks):
                # a failed data-parallel rank leaves the others in a collective that never ends
                stop_ranks(ranks)
                break
            for k, p in collector_procs.items():
                code = p.poll()
                if code is None or (code == 0 and paths.stop_file.exists()):
                    # (a clean exit after STOP means the learner finished and is exiting too)
                    continue
                # a collector died: stop the learner (it checkpoints) and the other collectors
                ask_children_to_stop(stop_write, len(processes))
                wait_for_children(processes, signals)
                name = "the collector" if collectors == 1 else f"collector {k}"
                raise RunError(f"{name} exited early (exit code {code}); see its error above. The "
                               f"learner saved a checkpoint; rerun to resume")
            time.sleep(0.2)
        if signals.received:
            ask_children_to_stop(stop_write, len(processes))
            wait_for_children(processes, signals)
        else:
            paths.stop_file.touch()  # every collector ends after its current round
            for p in collector_procs.values():
                wait_quietly(p, timeout=120.0)
    finally:
        signals.restore()
        os.close(stop_write)
    for p in ranks[1:]:  # rank 0 is done: the others end with it
        wait_quietly(p, timeout=60.0)
    learner_code = next((p.returncode for p in ranks if p.returncode not in (0, None)), learner.returncode)
    failed = {k: p.returncode for k, p in collector_procs.items() if p.returncode not in (0, 130, 143)}
    if learner_code == 0 and not failed:  # the learner took every step, even if a signal came late
        _print_summary(paths)
        return 0
    if signals.received or learner_code in (130, 143):
        signum = signals.received[0] if signals.received else learner_code - 128
        reached = _checkpoint_step(paths)
        saved = f"the learner's newest checkpoint is at step {reached}; " if reached is not None else ""
        print(f"[run] interrupted ({signal.Signals(signum).name}); {saved}run the same command again to "
              f"resume {paths.root}", file=sys.stderr, flush=True)
        return 128 + signum
    if learner_code != 0:
        raise RunError(f"the learner failed (exit code {learner_code}); see its error above")
    names = ", ".join(f"collector {k} (exit code {c})" for k, c in failed.items())
    raise RunError(f"{names} failed; see the error above")


def _checkpoint_step(paths: RunPaths) -> int | None:
    from rlhf_pipeline.learn.checkpoint import CheckpointManager

    return CheckpointManager(paths.checkpoints).latest_step()


def _print_summary(paths: RunPaths) -> None:
    # metrics.jsonl read here, not with learn.metrics.read_metrics: that module imports torch,
    # which would cost the launcher seconds after the learner is done
    lines = paths.metrics.read_text(encoding="utf-8").splitlines() if paths.metrics.exists() else []
    records = [json.loads(line) for line in lines if line.strip()]
    if not records:
        return
    rewards = [r.get("charts/reward_mean") for r in records if "charts/reward_mean" in r]
    k = max(1, len(rewards) // 10)
    first = sum(rewards[:k]) / k if rewards else float("nan")
    last = sum(rewards[-k:]) / k if rewards else float("nan")
    print(f"[run] done: {records[-1]['step']} learner steps; mean reward {first:.3f} "
          f"(first {k} steps) -> {last:.3f} (last {k} steps)", file=sys.stderr)
    print(f"[run] metrics: {paths.metrics}  tensorboard: {paths.tensorboard}", file=sys.stderr)

