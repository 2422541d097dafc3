"""What runs inside a collector, a learner or an evaluator process, whoever placed it there: ``run``'s
children, a standalone ``collect`` / ``learn`` / ``eval RUN``, or a Ray actor (``cluster/actors.py``);
and what the launcher and the learner take from the run's evaluation (held-out sets, pins, keep-best).
Design: docs/pipelines.md#the-commands, docs/evaluation.md.

Why one file: the process bodies are the run's one reading of its own directory (paths, stop file,
pacing, weights) from the inside; a change to how a run is laid out changes them together.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rlhf_pipeline.pipeline import CollectorLike, Pipeline, PipelineError, RunPaths
from rlhf_pipeline.runs.run_directory import RunError
from rlhf_pipeline.runs import stopping
from rlhf_pipeline.runs.stopping import StopFlag


def build_pipeline(module: Any, settings: Any, paths: RunPaths) -> Pipeline:
    """``module.build`` plus ``preflight``; any ValueError there is a settings error."""
    try:
        pipeline = module.build(settings, paths)
        if not isinstance(pipeline, Pipeline):
            raise PipelineError(
                f"build() must return rlhf_pipeline.pipeline.Pipeline, got {type(pipeline).__name__}"
            )
        pipeline.preflight()
        check_evaluation(pipeline)  # refused before any process starts, not by the evaluator later
    except PipelineError:
        raise
    except (ValueError, FileNotFoundError) as exc:  # PromptError, RewardError, ModelLoadError...
        raise PipelineError(f"{type(exc).__name__}: {exc}") from exc
    return pipeline


def with_buffer_url(paths: RunPaths, pipeline: Pipeline) -> RunPaths:
    """``paths`` with the pipeline's ``buffer_url`` (the buffer on object storage), checked."""
    url = pipeline.settings.buffer_url
    if not url:
        return paths
    if "://" not in url:
        raise PipelineError(f"setting 'buffer_url' must be a URL such as s3://bucket/run/buffer, got {url!r}; "
                            f"leave it unset to keep the buffer in the run directory")
    return dataclasses.replace(paths, buffer_url=url)


def set_threads(pipeline: Pipeline) -> None:
    """``settings.threads`` intra-op threads in this process (collector and learner run side by side)."""
    if pipeline.settings.threads is not None:
        import torch

        torch.set_num_threads(pipeline.settings.threads)


def collector_shard(paths: RunPaths, collector_index: int) -> str:
    """Where collector ``collector_index`` writes: its shard under the name it was made with
    (``shard-kkkk``, or at an object-store URL ``<hh>-shard-kkkk``), or a single-store buffer."""
    from rlhf_pipeline.storage.buffers import find_shard

    return str(paths.buffer) if paths.single_store_buffer else find_shard(paths.buffer_location, collector_index)


def refuse_a_second_collector(paths: RunPaths, collector_index: int) -> None:
    """Raises ``RunError`` when a live process holds the writer lock of this collector's local
    shard: said before the seconds of building a policy, not after. A shard at a URL is left to
    :func:`collect_main`, which waits out the lease of a collector that died on another machine."""
    from rlhf_pipeline.storage.locking import LOCK_FILE_NAME, writer_holding

    store_path = collector_shard(paths, collector_index)
    if "://" not in store_path:
        holder = writer_holding(Path(store_path) / LOCK_FILE_NAME)
        if holder is not None:
            raise _second_collector(collector_index, store_path, holder)


def _second_collector(collector_index: int, store_path: str, holder: str | None) -> Exception:
    return RunError(f"collector {collector_index} of this run is already running: {holder or 'another process'} "
                    f"writes {store_path}, and a shard takes one collector. Stop that one, or start this one with "
                    f"another --collector-index")


def collect_main(pipeline: Pipeline, paths: RunPaths, rounds: int | None = None,
                 collector_index: int = 0, poller: Any = None, one_of_several: bool = False) -> int:
    """Collects rounds until ``rounds``, a stop request, or the learner's ``STOP`` file.

    ``poller``: where new weights come from (``poll() -> (state_dict, version) | None``,
    ``poll_version`` and ``current_version``); default the run's weight files (``weights.WeightsPoller``).

    Collector ``collector_index`` writes its own shard ``buffer/shard-kkkk``. Every append publishes
    the rows and the collector's state after them in one step (``storage/writer_state.py``), so it
    resumes from its shard's last publish: no round repeated or skipped, whenever it was killed.
    ``one_of_several``: its lines say ``[collector K]``, else ``[collector]`` (collector 0 alone).
    """
    from rlhf_pipeline.collect.rewards import EpisodeFailureRateError, RewardError
    from rlhf_pipeline.collect.console import collector_tag, name_collectors, say
    from rlhf_pipeline.collect.commit import stored_in_round
    from rlhf_pipeline.coordination.branch_weights import held_version
    from rlhf_pipeline.generation.engine import EngineFailed, EngineStopped, GenerationEngine
    from rlhf_pipeline.runs.branch_online import collector_rows, keep_position_history
    from rlhf_pipeline.runs.retention import ShardRetention
    from rlhf_pipeline.learn.metrics import MetricsWriter
    from rlhf_pipeline.coordination.pacing import WAIT_REPORT_S, CollectorPacer, shard_key
    from rlhf_pipeline.coordination.polling import PollBackoff
    from rlhf_pipeline.storage import open_store
    from rlhf_pipeline.storage.errors import StoreLockedError
    from rlhf_pipeline.coordination.weights import WeightsPoller
    from rlhf_pipeline.files.machine_cache import MachineCache

    name_collectors(one_of_several)
    tag = collector_tag(collector_index)
    stop = StopFlag(tag.strip("[]"), finish_allowance_s=stopping.COLLECTOR_FINISH_S)
    GenerationEngine.stopping = stop.event  # every engine of this process: a stop ends a wait for a shared server
    store_path = collector_shard(paths, collector_index)
    # the writer lock: one collector per shard; on an object store, a predecessor that died on
    # another machine holds it until its lease runs out, which is waited for
    lock_wait = ({"lock_wait_s": pipeline.settings.buffer_lock_wait_s,
                  "lock_lease_s": pipeline.settings.buffer_lock_lease_s}
                 if paths.buffer_url else {})
    try:
        store = open_store(store_path, mode="a", **lock_wait)
    except StoreLockedError as exc:  # a refusal, said in one line: the store's own words are for Python callers
        raise _second_collector(collector_index, store_path, exc.holder) from None
    done, waited, paced_total = 0, 0.0, 0.0
    collector = failed = None
    try:
        model = pipeline.make_model()
        if poller is None:  # at a URL, one download per version for all collectors of this machine
            poller = WeightsPoller(paths.store, cache=MachineCache(paths.fetched_weights) if paths.url else None)
        start_file, run_store = paths.state_object(paths.collector_state(collector_index))
        saved = _start_state(store, start_file, run_store)
        key = shard_key(store_path, paths.buffer_location)  # its name in pacing.json and checkpoints' records
        # a continued branch's shard numbers its rows on from its parent's (runs/branch_online.py)
        rows, continues_from = collector_rows(paths, store, key)
        history = keep_position_history(paths, start_file, run_store, key)  # where a branch restarts it
        if store.writer_state is not None and not history.has(rows.next_row):  # a kill came before its entry
            history.record(rows.next_row, store.writer_state)
        # the first round waits on this: locally a listing every millisecond at first (version 0
        # usually comes within ~0.1 s of "go"), at a URL each poll is a request. Backed off to 0.5 s
        # there, the 40-50 LISTs while the learner starts went, but the run took ~1 s longer and sent
        # as many requests in all (docs/benchmarks.md, bench_run_requests.py)
        first = PollBackoff(max_s=0.05) if paths.url is None else PollBackoff(max_s=0.05, first_s=0.05)
        stop_check = _StopCheck(paths, stop, tag)
        held = held_version(saved)
        # built while the learner warm-starts: an engine with a process of its own takes tens of
        # seconds to start; the weights it starts with go in below, as every later version does
        try:
            collector = _make_collector(pipeline, model, store, collector_index)
        except EngineStopped as exc:  # its engine's first check waited for a shared server held on other weights
            say(f"{tag} {exc}")
            return stop.exit_code()
        _keep_history_at_every_append(collector, history, rows, store)
        _announce_engine(collector.engine, tag, say)
        update = _wait_for_weights(poller, stop_check, first, held=held, tag=tag,
                                   republished_after=_resumed_learner_version(paths) if held is not None else None)
        if update is None:  # stopped while the learner warm-started (or retrained): nothing written yet
            say(f"{tag} stopped before the policy weights it starts with were published")
            return stop.exit_code()
        state, version = update
        if saved is not None:
            collector.load_state_dict(saved)
            if stored := stored_in_round(saved):
                say(f"{tag} the round in flight at the last stop was written in part ({stored} groups); "
                    f"generating it again and writing only its groups not stored yet")
        try:
            collector.set_policy_state(state, version)
        except EngineFailed as exc:  # a version its engine does not serve as published (LoRA's canary, loop.py)
            say(f"{tag} stopped: {exc}")
            return 1
        # generate what the learner's next max_lag batches need, no more (alone, with no learner
        # yet, it may be recording a buffer: unpaced until one publishes)
        pacing, pacing_store = paths.state_object(paths.pacing)
        pacer = CollectorPacer(pacing, key, pipeline.settings.max_lag, round_rows=collector.round_rows,
                               learner_expected=stop.launcher_fd is not None, store=pacing_store,
                               reread_s=0.0 if paths.url is None else 0.05)
        metrics_log, metrics_store = paths.state_object(paths.collector_metrics(collector_index))
        metrics = MetricsWriter(metrics_log, store=metrics_store)
        # a branch continued online: its floors count from the parent's rows at the branch step
        retention = (ShardRetention(pipeline.settings.retention, paths, key, store_path, pipeline.learner,
                                    collector.runner_state, continues_from)
                     if pipeline.settings.retention.enabled else None)
        # the learner takes the next batch within a step: poll soon (at a URL each poll is a few
        # requests, so not every millisecond)
        paced = PollBackoff(max_s=0.02) if paths.url is None else PollBackoff(max_s=0.2, first_s=0.01)
        lease = "" if store.writer_lease_s is None else f" (writer lock lease {store.writer_lease_s:g} s)"
        say(f"{tag} writing to {store_path}{lease} with policy version {version}")
        # a paced round takes the version pacing names for it, not the newest: the same weights
        # for every round of a seed, whenever the learner publishes (pacing.py)
        pinned = pacer.max_lag is not None
        waiting_since = None
        while not stop_check() and (rounds is None or done < rounds):
            plan = pacer.plan_round(rows.next_row)
            # a round submitted ahead (CollectorPacer.next_round_goes_ahead), or written in part before a stop,
            # keeps its weights
            if not collector.continues_a_round:
                update = (poller.poll_version(plan.version) if plan.version is not None and pinned
                          else poller.poll() if plan.allowed or not pinned else None)  # unpaced or stalled: the newest
                if update is not None:
                    try:
                        collector.set_policy_state(*update)
                    except EngineFailed as exc:  # refused before any row of that version (as above)
                        say(f"{tag} stopped: {exc}")
                        failed = exc
                        break
                if not plan.allowed or collector.policy_version < plan.min_version:
                    # far enough ahead of the learner, or waiting for the weights this round must use
                    started = time.perf_counter()
                    paced.sleep()
                    waited += time.perf_counter() - started
                    waiting_since = waiting_since or time.monotonic()
                    if time.monotonic() - waiting_since > WAIT_REPORT_S:
                        say(f"{tag} no round for {time.monotonic() - waiting_since:.0f} s: "
                            f"{stop_check.waiting_for or plan.waiting_for}")
                        waiting_since = time.monotonic()  # said again after as long a wait
                    continue
            waiting_since = None
            paced.reset()
            rows_before = store.next_row
            collector.runner_state = retention.runner_state if retention is not None else {}  # with the round's rows
            next_round = None if rounds is not None and done + 1 >= rounds else (
                lambda rows_to_come, held=collector.policy_version: pacer.next_round_goes_ahead(
                    poller.store, shard_rows=rows.next_row, rows_to_come=rows_to_come, policy_version=held))
            try:
                collector.collect(next_round=next_round)
            except EpisodeFailureRateError as exc:  # the round is written and logged below; then the run stops
                failed = exc
            except EngineFailed as exc:  # its retries or restarts spent, or an answer that cannot be a row
                say(f"{tag} stopped: {exc}")  # one line; a rerun resumes from the state the store last published
                failed = None if stop.event.is_set() else exc  # asked to stop (its wait for a shared server ended)
                break
            except RewardError as exc:  # a reward's answer that cannot be a row's: its message names the fix
                say(f"{tag} stopped: {exc}")
                failed = exc
                break
            if store.writer_state is None:
                raise PipelineError("the pipeline's collector wrote its round without its state: give it "
                                    "make_replay_buffer(store, transforms=...).extend as its sink, which "
                                    "publishes the two together")
            pacer.round_written(store.next_row - rows_before, round_rows=collector.round_rows)
            done += 1
            # old rows go after the round (whole segments, never past what the run still needs)
            retained = retention.after_round(store, collector.policy_version) if retention is not None else None
            paced_total += waited
            metrics.log(collector.batches_emitted, {
                **collector.last_metrics, "rows_written": float(store.next_row - rows_before),
                "shard_rows": float(rows.next_row), "paced_wait_s": waited,
                **(retained.metrics() if retained is not None else {})})
            waited = 0.0
            if failed is not None:
                say(f"{tag} stopped: {failed}")
                break
            if collector.batches_emitted % 50 == 0:  # the collector's own count: a resumed one goes on from it
                say(f"{tag} round {collector.batches_emitted}: {store.next_row - rows_before} rows, shard "
                    f"{len(store)} rows, policy version {poller.current_version}, {paced_total:.1f}s waiting "
                    f"for the learner")
        metrics.close()
    finally:
        if collector is not None:
            collector.close()  # its generation engine's process, if any
        store.close()
        GenerationEngine.stopping = None
        stop.restore()
    say(f"{tag} stopped after {done} round{'' if done == 1 else 's'} ({paced_total:.1f}s waiting for the learner to "
        f"take rows in)")
    return 1 if failed is not None else stop.exit_code()


def _start_state(store: Any, start_file: Any, run_store: Any) -> dict[str, Any] | None:
    """The collector state to start from: the one its shard's last publish carries; for a shard with
    no publish yet, a continued branch's start in the same form (``collector/shard-kkkk.pt``, which
    ``runs/branch_online.py`` takes from its parent's position history), else None (a new collector)."""
    from rlhf_pipeline.files.run_store import state_store_and_key
    from rlhf_pipeline.storage.writer_state import decode

    published = decode(store.writer_state, store.location)
    if published is None:
        start_store, key = state_store_and_key(start_file, run_store)
        where, data = start_store.describe(key), start_store.read(key)
        if data is not None and store.next_row:
            raise RunError(f"{where} is the collector position of a run made before a buffer's appends carried "
                           f"their collector's state (format 2); this version cannot resume its collectors: "
                           f"start a new run")
        published = decode(data, where)
    return None if published is None else published["writer"]


def _announce_engine(engine: Any, tag: str, say: Callable[[str], None]) -> None:
    """An engine in a process of its own says when it started, and its restarts go to this console."""
    if engine.stats.starts:
        say(f"{tag} the {engine.name} generation engine started in {engine.stats.start_s:.0f} s; it keeps "
            f"running and takes each new policy version in place")
    if engine.retries is not None:  # a server's engine, which may restart the server it owns (vllm_http.Retries)
        engine.retries.announce = lambda line: say(f"{tag} {line}")


def _make_collector(pipeline: Pipeline, model: Any, store: Any, collector_index: int) -> CollectorLike:
    """``pipeline.make_collector`` for collector ``collector_index``; checks the ids it will use."""
    collector = pipeline.make_collector(model, store, collector_index=collector_index)
    got = collector.config.collector_index
    if got != collector_index:
        raise PipelineError(
            f"make_collector(..., collector_index={collector_index}) returned a collector with "
            f"collector_index {got}; pass it to CollectorConfig so ids stay unique across collectors"
        )
    return collector


def _keep_history_at_every_append(collector: CollectorLike, history: Any, rows: Any, store: Any) -> None:
    """Records the collector's published state in its position history after every append, not every
    round: a round's groups are appended as they end, and a learner's checkpoint (where a branch
    restarts the collector) may name any row count the store published, mid-round too."""
    publish = collector.sink

    def publish_and_record(batch: Any, *, writer_state: Any) -> None:
        publish(batch, writer_state=writer_state)
        history.record(rows.next_row, store.writer_state)

    collector.sink = publish_and_record


def _resumed_learner_version(paths: RunPaths) -> int | None:
    """The policy version of the state a (re)started learner resumes from: its newest checkpoint's, or
    0 (the initial policy) before the first. The learner takes back every version published after it
    (``retract_versions_after``) and publishes those numbers again as it retrains. None when that
    cannot be told without torch (a checkpoint whose rewind record a crash kept from being written,
    or an older run that pruned its initial policy)."""
    from rlhf_pipeline.coordination.branch_weights import held_version
    from rlhf_pipeline.coordination.weights import published_versions
    from rlhf_pipeline.learn.checkpoint import run_checkpoints

    checkpoints = run_checkpoints(paths)
    step = checkpoints.latest_step()
    if step is None:
        return 0 if 0 in published_versions(paths.store) else None
    return held_version(checkpoints.record(step))


def _wait_for_weights(poller, should_stop: Callable[[], bool], backoff: Any, *, held: int | None = None,
                      tag: str = "[collector]", republished_after: int | None = None):
    """The weights to start with, or None when asked to stop before there were any: the newest for a
    new collector; for a resumed one the version it ``held`` when it stopped, as the uninterrupted
    collector holds it for its next round (the newest when that version was pruned). A learner
    resumed from a checkpoint before ``held`` (of version ``republished_after``) takes back every
    version after it and publishes them again as it retrains (``learn/learner.py``): then this waits
    for ``held`` itself. Until the learner has taken them back, the listing may still show the stopped
    learner's newer versions with ``held`` pruned; the newest of those is not what the uninterrupted
    collector used, so it is never taken in place of ``held`` (a restart that raced the learner's
    retraction wrote a round with version 11 where the uninterrupted run used 8)."""
    said = False
    exactly_held = held is not None and republished_after is not None and held > republished_after
    while True:
        update = poller.poll() if held is None else poller.poll_version(held)
        if update is not None and (held is None or update[1] == held or (update[1] > held and not exactly_held)):
            return update
        if update is not None:  # another version: ``held`` was pruned, or taken back between listing and loading
            poller.current_version = -1
        elif held is not None and not said:
            said = True
            from rlhf_pipeline.collect.console import say

            say(f"{tag} resuming with policy version {held}, the one its last round used; waiting for the "
                f"learner to publish it")
        if should_stop():
            return None
        backoff.sleep()


class _StopCheck:
    """Whether to stop: a stop request, or a ``STOP`` its learner wrote since this collector started;
    at a URL, ``STOP`` (a HEAD request, a GET while an earlier one is there) is looked at no more than
    every ``every_s`` seconds, not on every paced poll.

    A ``STOP`` already there when a collector starts on its own (``collect``) is an earlier
    learner's, which finished: such a collector, started to continue a finished run with ``learn``,
    stopped at once when it came first, and the learner then waited for rows that never came. It
    collects for the next learner instead, whose start clears that ``STOP`` and whose end writes a
    new one. A launcher (``run``, the Ray driver) clears ``STOP`` before it starts its collectors,
    so one they find was written by this run's learner: a collector restarted after it stops."""

    def __init__(self, paths: RunPaths, stop: StopFlag, tag: str, every_s: float = 0.5) -> None:
        self.paths, self.stop = paths, stop
        self.every_s = 0.0 if paths.url is None else every_s
        self._checked_at = -float("inf")
        self._earlier = paths.stop_token() if stop.launcher_fd is None else None
        if self._earlier is not None:
            from rlhf_pipeline.collect.console import say

            say(f"{tag} the run's learner finished before this collector started (its STOP is there): "
                f"collecting for the next learner (`learn` or `run` with a larger --steps), and stopping when "
                f"that learner finishes")

    @property
    def waiting_for(self) -> str | None:
        """What a paced wait is for while no learner has started since the finished one: the pacing's
        own reason speaks of that learner ("its last step"), which no longer runs."""
        if self._earlier is None:
            return None
        return ("waiting for the next learner (`learn` or `run` with a larger --steps) to start: the run's last "
                "learner finished before this collector started")

    def __call__(self) -> bool:
        if self.stop.event.is_set():
            return True
        now = time.monotonic()
        if now - self._checked_at < self.every_s:
            return False
        self._checked_at = now
        if self._earlier is None:
            return self.paths.stop_requested()
        token = self.paths.stop_token()
        if token is None:
            self._earlier = None  # cleared by a learner's start: the next STOP is its own
        return token is not None and token != self._earlier


def learn_main(pipeline: Pipeline, paths: RunPaths, data_parallel: Any = None,
               on_learner: Any = None, initial_policy: Any = None) -> int:
    """``data_parallel``: this rank (default: torchrun's environment, else one rank);
    ``on_learner(learner)`` runs once the learner is built (Ray attaches its weights publisher);
    ``initial_policy``: the model this process published as version 0, trained without a reload."""
    import torch

    from rlhf_pipeline.learn.distributed import DataParallel
    from rlhf_pipeline.learn.learner import Learner

    # under torchrun: one of N data-parallel ranks (learn/distributed.py); rank 0 writes the files
    data_parallel = data_parallel if data_parallel is not None else DataParallel.from_torchrun_env()
    stop = StopFlag("learner")
    if data_parallel.is_main:
        paths.clear_stop()  # a resumed learner wants collectors running
    data_parallel.start(torch.device(pipeline.settings.device))
    learner = Learner.from_pipeline(pipeline, paths, stop_event=stop.event, data_parallel=data_parallel,
                                    initial_policy=initial_policy)
    if on_learner is not None:
        on_learner(learner)
    if pipeline.settings.eval.enabled:  # the evaluator beside it finds every version it wants
        learner.keep_versions_for = eval_pins(pipeline, paths).keep
    learner.checkpoints.keep_best = keep_best(pipeline, paths)
    try:
        learner.setup()
        finished = learner.train()
    finally:
        learner.cleanup()
        stop.restore()
        data_parallel.stop()
    if finished:
        if data_parallel.is_main:
            paths.request_stop()  # tells collectors of this run that the learner is done
        return 0
    return stop.exit_code() or 1  # not finished: the launcher must not report "done"


# ====================================================================== the evaluator
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
    # each summary uploaded as it is logged: once its version is released (follow_run), keep_best's pruning
    # (the learner's, and this process's at its end) takes a checkpoint it finds no score for as not the best
    metrics = MetricsWriter(log_at, tensorboard_dir=paths.tensorboard / "eval", store=store,
                            tensorboard_key=paths.key(paths.tensorboard / "eval"), upload_every_s=0.0)

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
