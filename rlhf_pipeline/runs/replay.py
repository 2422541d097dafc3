"""``rlhf-pipeline replay``: train a new run from a recorded buffer, offline. The source is opened
read-only; the run's ``settings.json`` keeps a ``replay`` record a resumed replay must match, and
``batches.jsonl`` each step's rows. ``docs/replay.md``.

Why one file: ``replay`` is one command whose checks, run-directory preparation, re-scoring set-up
and launch of its ranks run in a fixed order, so that bad input fails before anything is written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlhf_pipeline.files.run_paths import RunLocationError, is_url, run_paths
from rlhf_pipeline.files.run_store import StaleWriterError
from rlhf_pipeline.files.settings_history import record_resume, saved_settings, settings_in_force
from rlhf_pipeline.pipeline import (
    PipelineError,
    RunPaths,
    describe_settings,
    load_pipeline_module,
    make_settings,
    settings_to_json,
    split_override,
    with_flags,
    zarr_where_the_buffer_is_a_url,
)
from rlhf_pipeline.runs.branch import half_made_branch, offline_branch_of
from rlhf_pipeline.runs.forking import ForkError
from rlhf_pipeline.runs.launch import how_it_ended, start_ranks, stop_ranks
from rlhf_pipeline.runs.lineage import KeepsNoBuffer, buffer_of_run, read_parent, run_recording, run_store_at
from rlhf_pipeline.runs.processes import build_pipeline, set_threads
from rlhf_pipeline.runs.replay_options import ReplayOptions
from rlhf_pipeline.runs.run import check_cuda_device, check_lora_trainable
from rlhf_pipeline.runs.run_directory import hold_run_directory, keep_pipeline_copy, run_lock, settings_changes
from rlhf_pipeline.runs.stopping import LauncherSignals, StopFlag, stop_children

# replay options a resumed replay may change: how long it runs
_RESUMABLE_OPTIONS = {"epochs", "steps"}
BATCH_LOG = "batches.jsonl"


class ReplayError(RuntimeError):
    """The source, the initial weights or the run directory do not fit this replay."""


# the settings a replay sets itself, and what to give instead of --set
SET_BY_REPLAY = {
    "steps": "a replay's length is --steps N (or --epochs N); give that instead",
    "learner.sampler": "a replay walks the buffer in epochs (learner.sampler=epoch, which it sets); their order is "
                       "--order shuffle|sequential|with-replacement. To train on a run's rows with another sampler, "
                       "`branch` the run that recorded them",
    "learner.epoch_order": "a replay's order is --order shuffle|sequential|with-replacement; give that instead",
    "learner.epoch_rows": "a replay walks every row the buffer holds when it starts; to replay fewer, make a "
                          "selection of them with `rlhf-pipeline filter` and replay that",
}


# ====================================================================== entry point
def replay_command(pipeline_path: str, options: ReplayOptions, *, home: str | None = None,
                   run_name: str | None = None, device: str | None = None, overrides: Sequence[str] = (),
                   list_settings: bool = False, stop_fd: int | None = None) -> int:
    """``stop_fd``: a rank's end of its launcher's stop pipe (``_train_on_ranks``)."""

    options.check()
    given = {split_override(item)[0] for item in overrides}
    for key, instead in SET_BY_REPLAY.items():  # each was replaced by the replay's own value, silently
        if key in given:
            raise ReplayError(f"--set {key}: {instead}")
    module = load_pipeline_module(pipeline_path)
    paths = run_paths(f"{Path(pipeline_path).stem}-replay" if run_name is None else run_name, home)
    # recorded as a run at a URL records it, so a branch of this replay continued online keeps Zarr there
    cli_overrides = zarr_where_the_buffer_is_a_url(
        with_flags(overrides, device=device), run_at_a_url=paths.url is not None)
    settings = make_settings(module, cli_overrides)
    if list_settings:
        print(f"settings of {pipeline_path} (change with --set KEY=VALUE):")
        print(describe_settings(settings))
        return 0
    check_cuda_device(settings.device)  # before torch is imported
    check_lora_trainable(settings.learner.lora)
    if "buffer_backend" not in {split_override(item)[0] for item in cli_overrides}:
        # a replay keeps no buffer of its own: its buffer_backend is what its settings.json says (a branch of a
        # run at a URL says zarr, which that run took unless told), not the pipeline's default to be refused
        recorded_backend = (saved_settings(paths.store) or {}).get("buffer_backend")
        if recorded_backend not in (None, getattr(settings, "buffer_backend", recorded_backend)):
            cli_overrides.append(f"buffer_backend={recorded_backend}")
            settings = make_settings(module, cli_overrides)
    if (half_made := half_made_branch(paths)) is not None:
        raise ReplayError(half_made)
    if "WORLD_SIZE" in os.environ:  # a rank started by _train_on_ranks: its launcher holds the directory
        StopFlag.launcher_fd = stop_fd
        quiet = os.environ.get("RANK", "0") != "0"  # rank 0 alone says what the replay does
        with contextlib.redirect_stderr(io.StringIO()) if quiet else contextlib.nullcontext():
            return _replay(module, settings, pipeline_path, options, paths, cli_overrides, overrides, device)
    with hold_run_directory(paths, "replay") as holder:
        return _replay(module, settings, pipeline_path, options, paths, cli_overrides, overrides, device,
                       holder_fd=holder.fd)


def _replay(module, settings, pipeline_path: str, options: ReplayOptions, paths: RunPaths,
            cli_overrides: list[str], overrides: Sequence[str], device: str | None, holder_fd: int = -1) -> int:
    rank = "WORLD_SIZE" in os.environ
    # a rank repeats the checks and the preparation, silently: its launcher said what this replay does
    with contextlib.redirect_stderr(io.StringIO()) if rank else contextlib.nullcontext():
        source = source_location(options.buffer)
        saved = _saved_replay(paths)
        with _open_source(source) as store:
            rows = saved["rows"] if saved else len(store)
            if not rows:
                raise ReplayError(f"--buffer {options.buffer}: {store.location} holds no rows, so there is nothing to "
                                  f"replay; give a buffer, selection or run that holds rows (`rlhf-pipeline inspect` "
                                  f"counts them)")
            if saved:
                _check_source_unchanged(store, saved)
            try:  # what build_pipeline's Pipeline derives its learner from, without building it twice
                batch_size = settings.learner_settings().batch_size
            except ValueError as exc:  # as build_pipeline says it
                raise PipelineError(f"{type(exc).__name__}: {exc}") from exc
            batches_per_epoch = -(-rows // batch_size)
            steps = options.steps or (options.epochs or 1) * batches_per_epoch
            settings = make_settings(module, cli_overrides + [f"steps={steps}"])
            pipeline = build_pipeline(module, settings, paths)
            learner_settings = _replay_learner_settings(pipeline.learner, options, rows)
            if options.order == "shuffle":
                learner_settings = fit_shuffle_window(store, rows, learner_settings, given=options.shuffle_window_rows)
            _check_source_fits(store, options, learner_settings)
            record = _replay_record(options, source, store, rows, steps, learner_settings)
        # before the run directory is written, as --init-from is checked: a --ref-model or recomputed
        # advantages that cannot apply leave nothing behind that would refuse the corrected command
        rescorer = _make_rescorer(pipeline, options, learner_settings, source)
        initial_policy = prepare_replay_run(pipeline, paths, record, options)
        epochs = steps / batches_per_epoch
        print(f"[replay] {source}: {rows} rows, {batches_per_epoch} batches of <= {batch_size} per epoch, "
              f"{steps} steps ({epochs:.3g} epoch{'' if epochs == 1 else 's'}, order {options.order}) "
              f"into {paths.location}",
              file=sys.stderr, flush=True)
        window = learner_settings.shuffle_window_rows
        if options.order == "shuffle" and 0 < window < rows:
            print(f"[replay] shuffling within windows of >= {window} rows of whole storage units (--shuffle-window); "
                  f"a Zarr source decodes each unit once per epoch while a window fits its cache_bytes",
                  file=sys.stderr, flush=True)
    if learner_settings.world_size > 1 and not rank:
        # this process prepared the run; the ranks repeat the checks (they pass) and train
        argv = ["replay", pipeline_path, "--buffer", options.buffer, *options.flags(), "--home", paths.home,
                "--run-name", paths.name, *(["--device", device] if device is not None else []),
                *(word for item in overrides for word in ("--set", item))]
        return _train_on_ranks(argv, learner_settings.world_size, holder_fd)
    return _train(pipeline, paths, options, learner_settings, source, record["seed"], steps, rescorer,
                  initial_policy=initial_policy)


def _train_on_ranks(argv: list[str], world_size: int, holder_fd: int = -1) -> int:
    """Starts ``world_size`` data-parallel learner ranks (``learner.world_size``), each running the
    command ``argv`` (this replay's) under this process's stop pipe (``launch.start_ranks``), and
    watches them: a failed rank stops the others; a signal here asks every rank to stop, and they
    checkpoint at the same step; this process killed, they do so on their own."""
    # the ranks inherit the run directory's holder lock: it outlives this process if it is killed first
    try:
        ranks, stop_write = start_ranks(argv, world_size, keep_fds=(holder_fd,) if holder_fd >= 0 else ())
    except ForkError as exc:
        raise ReplayError(str(exc)) from None
    signals = LauncherSignals("replay")  # a signal before it ends this process: the pipe's end stops them
    try:
        while any(p.poll() is None for p in ranks):
            if signals.received:
                stop_children(stop_write, ranks, signals)
            elif any(p.poll() not in (None, 0) for p in ranks):
                stop_ranks(ranks)  # the others wait in a collective that never completes
            time.sleep(0.2)
    finally:
        signals.restore()
        os.close(stop_write)
    failed = [(rank, p.returncode) for rank, p in enumerate(ranks) if p.returncode != 0]
    if signals.received:
        return 128 + signals.received[0]
    if failed:
        rank, code = failed[0]
        raise ReplayError(f"data-parallel rank {rank} of the replay failed ({how_it_ended(code)})")
    return 0


def source_location(buffer: str) -> str:
    """An absolute path for a local source (so a resume finds it from any directory); URLs as given. A run
    (its directory or URL) stands for the buffer its learner read: its ``buffer_url``, else ``RUN/buffer``."""
    location = buffer
    if "://" not in buffer:
        path = Path(buffer).expanduser()
        if not path.exists():
            raise ReplayError(f"--buffer {buffer!r} does not exist; pass a replay buffer directory, a Zarr "
                              f".zip or URL, a run's buffer/ directory, or the run itself")
        location = str(path.resolve())
    try:
        run_buffer = buffer_of_run(location)
    except KeepsNoBuffer as exc:
        raise ReplayError(f"--buffer {exc}") from None
    if run_buffer is None:
        return location  # a buffer
    print(f"[replay] --buffer {buffer} is a run: its buffer {run_buffer}", file=sys.stderr, flush=True)
    return run_buffer


def _open_source(location: str):
    from rlhf_pipeline.storage import StoreError, open_buffer

    try:
        return open_buffer(location, mode="r")
    except StoreError as exc:
        raise ReplayError(f"--buffer {location}: {exc}") from exc


def _replay_learner_settings(learner, options: ReplayOptions, rows: int):
    changes: dict[str, Any] = {"sampler": "epoch", "epoch_order": options.order, "epoch_rows": rows,
                               "max_staleness": None, "new_rows_per_step": 0}
    if options.shuffle_window_rows is not None:
        changes["shuffle_window_rows"] = options.shuffle_window_rows
    try:
        return dataclasses.replace(learner, **changes)
    except ValueError as exc:
        raise PipelineError(str(exc)) from None


def fit_shuffle_window(store, rows: int, learner, *, given: int | None, cache_bytes: int | None = None):
    """Learner settings whose shuffle window fits a Zarr reader's decoded-unit cache.

    A Zarr reader decodes whole units into an LRU cache (512 MiB by default); a shuffled epoch
    walks windows of units, and a window whose decoded rows exceed the cache misses on nearly
    every batch (``docs/benchmarks.md``, replay). The window is kept to half the cache
    (``cache_bytes``, default the reader's), at the source's mean decoded bytes per row: set so
    when ``--shuffle-window`` was not given, else only a warning.
    """
    backends = {store.backend_name} | {s.backend_name for s in getattr(store, "shards", {}).values()}
    window = learner.shuffle_window_rows
    if "zarr" not in backends:
        return learner
    from rlhf_pipeline.storage.zarr.store import DEFAULT_CACHE_BYTES

    cache_bytes = DEFAULT_CACHE_BYTES if cache_bytes is None else cache_bytes
    stats = store.stats()
    row_bytes = max(1.0, stats.raw_bytes / max(stats.rows, 1))
    fitting = max(1, int(cache_bytes // 2 // row_bytes))
    span = rows if window == 0 else min(window, rows)
    if span <= fitting:
        return learner
    why = (f"{store.location}'s rows are ~{row_bytes / 1024:.1f} KB decoded, and its reader caches "
           f"{cache_bytes / 2**20:.3g} MiB of decoded units")
    if given is not None:
        print(f"[replay] warning: a shuffle window of {span} rows is more than the cache holds ({why}); "
              f"expect every batch to decode units again, or use --shuffle-window {fitting}",
              file=sys.stderr, flush=True)
        return learner
    print(f"[replay] shuffle window set to {fitting} rows: {why}", file=sys.stderr, flush=True)
    return dataclasses.replace(learner, shuffle_window_rows=fitting)


def _check_source_fits(store, options: ReplayOptions, learner) -> None:
    """The loss's inputs must be stored or re-scored; say which option provides what is missing."""
    fields = store.schema.field_names
    if "advantage" not in fields and not options.recompute_advantages:
        raise ReplayError(
            f"{store.location} stores no 'advantage' field; recompute advantages from its rewards with "
            f"--advantage-baseline mean (GRPO) or --advantage-std off (Dr. GRPO)"
        )
    if learner.loss.kl_coef and "ref_log_probs" not in fields and options.ref_model is None:
        raise ReplayError(
            f"learner.loss.kl_coef={learner.loss.kl_coef} needs reference log-probs, which {store.location} "
            f"does not store; score them with --ref-model MODEL_DIR|RUN_DIR, or set learner.loss.kl_coef=0"
        )


def _check_source_unchanged(store, saved: dict[str, Any]) -> None:
    """A resumed replay walks the positions it started with; they must still name the same rows."""
    grown = int(store.next_row) - int(saved.get("next_row", store.next_row))
    if not grown:
        return
    if store.backend_name == "sharded":
        # positions run shard after shard: rows added to one shard move every later shard's rows
        raise ReplayError(
            f"{store.location} gained {grown} rows since this replay started; in a buffer of shards that "
            f"moves the positions the replay walks. Replay a finished buffer (or a copy: `rlhf-pipeline "
            f"convert`), or start a new replay with --run-name NAME"
        )
    print(f"[replay] note: {store.location} gained {grown} rows since this replay started; it walks the "
          f"{saved['rows']} rows it started with", file=sys.stderr, flush=True)


def _replay_record(options: ReplayOptions, source: str, store, rows: int, steps: int, learner) -> dict[str, Any]:
    record = dataclasses.asdict(options)
    record.update(
        buffer=source, backend=store.backend_name, rows=rows, first_row=int(store.first_row),
        next_row=int(store.next_row), steps=steps,
        staleness_bound="none: the rows' policy versions belong to the run that recorded them",
        learner=settings_to_json(learner),
    )
    for name in ("init_from", "ref_model"):
        if record[name] is not None and "://" not in record[name]:
            record[name] = str(Path(record[name]).expanduser().resolve())
    return record


# ====================================================================== run directory
def _saved_replay(paths: RunPaths) -> dict[str, Any] | None:
    """The replay record of a resumed replay; None for a new one, or for a branch of a run with
    collectors replayed for the first time (its settings are its parent's, ``runs/branch.py``)."""
    saved = saved_settings(paths.store)
    if saved is None or ("replay" not in saved and offline_branch_of(paths) is not None):
        return None
    if "replay" not in saved:
        raise ReplayError(f"{paths.location} holds a run made by `rlhf-pipeline run`, not a replay; choose another "
                          f"--run-name")
    return saved["replay"]


def _resumes_parents_checkpoint(paths: RunPaths) -> bool:
    """A branch of a run with collectors whose newest checkpoint is still its parent's: that one saw
    the parent's buffer, not the selection of its rows the branch replays."""
    from rlhf_pipeline.learn.checkpoint import run_checkpoints

    lineage = offline_branch_of(paths)
    return lineage is not None and run_checkpoints(paths).latest_step() == int(lineage["step"])


def prepare_replay_run(pipeline, paths: RunPaths, record: dict[str, Any], options: ReplayOptions) -> Any:
    """Writes ``settings.json`` with the replay's record (or checks a resumed replay against it) and
    publishes version 0; returns the model it published (the learner trains it without loading it
    again), else None."""
    from rlhf_pipeline.learn.checkpoint import run_checkpoints
    from rlhf_pipeline.coordination.weights import latest_version, publish_weights

    set_threads(pipeline)  # before the warm start, as `run` does: it and the training steps use them
    with run_lock(paths):
        saved = saved_settings(paths.store)
        # None: a new replay, or a branch's first (_saved_replay refused any other run without one)
        recorded = None if saved is None else saved.pop("replay", None)
        if record["seed"] is None:
            record["seed"] = recorded["seed"] if recorded else int(getattr(pipeline.settings, "seed", 0))
        if saved is not None:  # a branch's settings are its parent's with its changes: they must hold too
            resumed_from = run_checkpoints(paths).latest_step() or 0
            in_force = settings_in_force(paths.store, saved, resumed_from)
            refused = settings_changes(in_force, pipeline.settings, tag="[replay]",
                                       since=f"step {resumed_from}" if recorded and resumed_from else
                                       "the replay started" if recorded else "the branch was made")
            changed = [*refused.values(), *(
                f"--{k.replace('_', '-')}: was {recorded.get(k)!r}, now {record[k]!r}"
                for k in sorted(dataclasses.asdict(options)) if recorded
                and k not in _RESUMABLE_OPTIONS and k in record and recorded.get(k) != record[k])]
            if changed and recorded is None:
                raise ReplayError(f"run directory {paths.location} is a branch made with other settings "
                                  f"({'; '.join(changed)}); replay it with its settings (runs/branch.py)")
            if changed:
                raise ReplayError(f"run directory {paths.location} holds a replay started with other settings "
                                  f"({'; '.join(changed)}). Resume with the same command, or start a new replay "
                                  f"with --run-name NAME")
            if recorded:
                record_resume(paths.store, saved, settings_to_json(pipeline.settings), resumed_from)
        # the initial policy before settings.json: a --init-from that does not fit leaves nothing behind
        model = (initial_policy(pipeline, options.init_from, record["buffer"])
                 if latest_version(paths.store) is None else None)
        if model is not None:  # a new replay: what it will train must be rows this model can embed
            _check_token_ids_fit(record["buffer"], model)
        if recorded is None:
            text = json.dumps({**(saved or settings_to_json(pipeline.settings)), "replay": record}, indent=2,
                              sort_keys=True).encode()
            key, partial = paths.key(paths.settings_file), paths.settings_file.name + ".partial"
            try:
                if saved is not None:  # a branch's settings gain the record
                    paths.store.write(key, text, partial_name=partial)
                else:
                    paths.store.create(key, text, partial_name=partial)
            except StaleWriterError:  # only a start of this replay on another machine writes it meanwhile
                raise ReplayError(f"{paths.location} was started meanwhile by another start of this replay (another "
                                  f"machine); run the same command again: it checks its settings against that one"
                                  ) from None
        keep_pipeline_copy(pipeline, paths)  # what export-model rebuilds the model from
        if model is not None:
            publish_weights(paths.store, model.state_dict(), 0)
    return model


def initial_policy(pipeline, init_from: str | None, source: str):
    """The replay's starting weights in the pipeline's architecture: ``init_from`` (see
    :func:`load_policy`), else the recording run's initial policy (:func:`recorded_initial_policy`),
    else ``make_policy()`` (a warm start of seconds to minutes), with the reason it is built again."""
    if init_from is not None:
        print(f"[replay] initial policy: {init_from}", file=sys.stderr, flush=True)
        return load_policy(init_from, pipeline, what="--init-from")
    recorded, said = recorded_initial_policy(pipeline, source)
    if recorded is not None:
        print(f"[replay] initial policy: {said}", file=sys.stderr, flush=True)
        return recorded
    print(f"[replay] initial policy: the pipeline's make_policy(), since {said} (--init-from RUN_DIR|MODEL_DIR "
          f"starts from saved weights instead)", file=sys.stderr, flush=True)
    return pipeline.initial_policy()


# settings make_policy() does not depend on: those a run may change on resume, the learner's, and where and how
# rows are generated and kept (a buffer at a URL is Zarr; a run there records it)
_NOT_THE_INITIAL_POLICY = {"learner", "steps", "device", "ray", "eval", "max_lag", "buffer_lock_wait_s",
                           "buffer_lock_lease_s", "buffer_backend", "segment_rows", "buffer_url", "retention",
                           "generation"}


def _check_token_ids_fit(source: str, model) -> None:
    """Refuses, before ``settings.json`` is written, a buffer holding a token id ``model`` cannot embed:
    rows recorded with another tokenizer (another pipeline's run) stopped the first step with an
    ``IndexError`` in the embedding, and the replay directory left behind refused the corrected command
    as "started with other settings". Reads every row's ids once (a fitting buffer) or up to the first
    storage unit holding one."""
    from rlhf_pipeline.storage.token_ids import first_outside

    vocab_size = model.get_input_embeddings().num_embeddings
    began = said = time.monotonic()

    def progress(done: int, total: int) -> None:  # a line every 10 s: about 2M rows of memmap, 0.5M of Zarr
        nonlocal said
        if time.monotonic() - said >= 10.0 and done < total:
            said = time.monotonic()
            print(f"[replay] token ids checked in {done}/{total} storage units ({said - began:.0f} s)",
                  file=sys.stderr, flush=True)

    with _open_source(source) as store:
        bad = first_outside(store, vocab_size, progress)
    if bad is None:
        return
    run = run_recording(source)
    instead = (f"replay it with the pipeline that recorded it (the copy its run keeps: {run}/pipeline.py)"
               if run is not None else "replay it with a pipeline whose tokenizer and model recorded it")
    raise ReplayError(f"--buffer {source}: trajectory {bad['trajectory_id']} (group {bad['group_id']}) holds token "
                      f"id {bad['token']} in {bad['field']}, outside this pipeline's model's vocabulary of "
                      f"{vocab_size}: its rows were tokenized for another model; {instead}")


def recorded_initial_policy(pipeline, source: str) -> tuple[Any, str]:
    """``(model, what it is)``: weights version 0 of the run whose ``buffer/`` (or shard of it) is
    ``source``, in ``make_model()``, when that run still holds it (a run keeps it until its learner's
    first checkpoint: a buffer recorded by ``collect`` alone, a short run) and was made with this
    replay's settings, so ``make_policy()`` would build those weights again; else ``(None, why not)``."""
    from rlhf_pipeline.coordination.weights import load_weights, published_versions

    run = run_recording(source)
    if run is None:
        return None, f"{source} is no run's buffer/ (no initial weights beside it)"
    store = run_store_at(run)
    try:
        saved = saved_settings(store) or {}
        branch = read_parent(store)
    except (OSError, ValueError) as exc:
        return None, f"the settings of {run}, which recorded the buffer, are unreadable ({exc})"
    if branch is not None:
        return None, f"{run}, which recorded the buffer, is a branch: it started from a checkpoint of its parent"
    current = settings_to_json(pipeline.settings)
    changed = [k for k in sorted(current) if k not in _NOT_THE_INITIAL_POLICY and k in saved and saved[k] != current[k]]
    if changed:
        return None, (f"{run}, which recorded the buffer, was made with other settings ({', '.join(changed)}), "
                      f"so its initial policy may not be this pipeline's")
    if 0 not in published_versions(store):
        return None, (f"{run}, which recorded the buffer, no longer holds its weights version 0 (a run keeps it "
                      f"until its first checkpoint)")
    state, _ = load_weights(store, 0)
    model = pipeline.make_model()
    _check_same_architecture(model.state_dict(), state, f"run {run} (weights version 0)", "the recording run")
    model.load_state_dict(state)
    return model, f"weights version 0 of {run}, the run that recorded the buffer (made with these settings)"


def load_policy(location: str, pipeline, *, what: str, any_causal_lm: bool = False):
    """Weights from a run directory or a run at a URL (its newest published version) or a
    ``save_pretrained`` directory (``AutoModelForCausalLM.from_pretrained``), copied into the pipeline's
    ``make_model()``. ``any_causal_lm`` (a frozen reference, ``--ref-model``): a local ``save_pretrained``
    directory that is no run is loaded as it is, any causal LM whose vocabulary covers the pipeline's
    tokenizer."""
    from rlhf_pipeline.models import ModelLoadError, load_model
    from rlhf_pipeline.coordination.weights import latest_version, load_weights

    path = Path(location).expanduser()
    if any_causal_lm and not is_url(location) and latest_version(path) is None and (path / "config.json").is_file():
        try:
            model = load_model(path)
        except ModelLoadError as exc:
            raise ReplayError(f"{what} {location}: {exc}") from exc
        vocabulary = model.get_input_embeddings().num_embeddings
        if pipeline.tokenizer is not None and vocabulary < len(pipeline.tokenizer):
            raise ReplayError(f"{what} {location} has a vocabulary of {vocabulary} tokens, fewer than the "
                              f"pipeline's tokenizer ({len(pipeline.tokenizer)}): it cannot score these token ids")
        print(f"[replay] reference model: {path}", file=sys.stderr, flush=True)
        return model
    try:
        run = RunPaths.at(location if is_url(location) else path).store
    except RunLocationError as exc:  # an unsupported scheme
        raise ReplayError(f"{what}: {exc}") from None
    model = pipeline.make_model()
    if latest_version(run) is not None:
        state, version = load_weights(run)
        source = f"run {location} (weights version {version})"
    elif is_url(location):  # never looked for as a local directory named "s3:"
        raise ReplayError(f"{what} {location} holds no published weights (weights/policy_*): give the URL of a "
                          f"run (--home URL plus its --run-name), or a local save_pretrained directory")
    elif (path / "config.json").is_file():
        try:
            state = load_model(path).state_dict()
        except ModelLoadError as exc:
            raise ReplayError(f"{what} {location}: {exc}") from exc
        source = f"model directory {path}"
    else:
        raise ReplayError(f"{what} {location} is neither a run directory (weights/policy_*) nor a model "
                          f"directory written by save_pretrained() (config.json + weights)")
    _check_same_architecture(model.state_dict(), state, source, what)
    model.load_state_dict(state)
    return model


def _check_same_architecture(expected: dict, found: dict, source: str, what: str) -> None:
    from rlhf_pipeline.models.loading import state_dict_misfit

    if (misfit := state_dict_misfit(expected, found)) is not None:
        raise ReplayError(f"{what}: the weights of {source} do not fit the pipeline's model ({misfit}); set the "
                          f"pipeline's model settings to match (e.g. --set hidden_size=..., see --list-settings)")


# ====================================================================== training
def _train(pipeline, paths: RunPaths, options: ReplayOptions, learner_settings, source: str, seed: int,
           steps: int, rescorer: Any, initial_policy: Any = None) -> int:
    import torch

    from rlhf_pipeline.learn.distributed import DataParallel
    from rlhf_pipeline.learn.learner import BufferSource, Learner
    from rlhf_pipeline.learn.metrics import MetricsWriter, truncate_metrics

    # one of learner.world_size ranks (_train_on_ranks) or of torchrun's; one rank otherwise
    data_parallel = DataParallel.from_torchrun_env()
    stop = StopFlag("learner")
    batch_log: MetricsWriter | None = None

    def record_step(step: int, sampled, batch, metrics: dict[str, float]) -> None:
        # the rows of every step, so two replays can be compared row for row (every rank's rows)
        ids = data_parallel.gather_rows(batch)["trajectory_id"].tolist()
        if batch_log is not None:
            batch_log.log(step, {"positions": sampled.positions.tolist(), "trajectory_ids": ids})
        if options.ref_model is not None:
            mask = batch["masks", "response"]
            metrics["charts/sampler_ref_kl_mean"] = float(batch["kl", "response"][mask].mean())

    learner = Learner(learner_settings, paths, make_model=pipeline.make_model, steps=steps, seed=seed,
                      device=pipeline.settings.device, pad_token_id=pipeline.pad_token_id, stop_event=stop.event,
                      source=BufferSource(source, fed_by_collectors=False,
                                          checkpoint_saw_another=_resumes_parents_checkpoint(paths)),
                      batch_transform=rescorer, on_step=record_step,
                      before_checkpoint=lambda: batch_log.flush() if batch_log is not None else None,
                      data_parallel=data_parallel, initial_policy=initial_policy)
    data_parallel.start(torch.device(pipeline.settings.device))
    try:
        learner.setup()
        if data_parallel.is_main:  # only rank 0 writes files
            log, store = paths.state_object(paths.root / BATCH_LOG)
            truncate_metrics(log, learner.progress.step, store=store)  # a resumed replay redoes later steps
            batch_log = MetricsWriter(log, store=store)
        finished = learner.train()
    finally:
        learner.cleanup()
        if batch_log is not None:
            batch_log.close()
        stop.restore()
        data_parallel.stop()
    if not data_parallel.is_main:
        return 0 if finished else 130
    if finished:
        store = paths.store
        print(f"[replay] done: {steps} steps; metrics: {store.describe('metrics.jsonl')}  batches: "
              f"{store.describe(BATCH_LOG)}  weights: {store.describe('weights')}", file=sys.stderr, flush=True)
        return 0
    print(f"[replay] interrupted; run the same command again to resume {paths.location}", file=sys.stderr)
    return 130


def _make_rescorer(pipeline, options: ReplayOptions, learner_settings, source: str):
    if not options.recompute_advantages and options.ref_model is None:
        return None
    from rlhf_pipeline.learn.rescore import AdvantageOptions, BatchRescorer, ReferenceRescorer, buffer_advantages

    advantages = None
    if options.recompute_advantages:
        advantage_options = AdvantageOptions(normalize=options.advantage_std is not False,
                                             leave_one_out=options.advantage_baseline == "leave-one-out")
        with _open_source(source) as store:
            try:
                advantages = buffer_advantages(store, learner_settings.epoch_rows, advantage_options)
            except ValueError as exc:
                raise ReplayError(str(exc)) from None
        print(f"[replay] advantages recomputed from the stored rewards ({advantage_options})", file=sys.stderr,
              flush=True)
    reference = None
    if options.ref_model is not None:
        model = load_policy(options.ref_model, pipeline, what="--ref-model", any_causal_lm=True)
        reference = ReferenceRescorer(model.to(pipeline.settings.device), temperature=learner_settings.temperature,
                                      kl_estimator=options.kl_estimator, kl_coef=options.kl_coef,
                                      pad_token_id=pipeline.pad_token_id)
    return BatchRescorer(advantages, reference)
