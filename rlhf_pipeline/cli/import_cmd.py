"""``rlhf-pipeline import SOURCE BUFFER --pipeline PIPELINE.py``: rows from JSONL, Parquet or a
Hugging Face dataset into a replay buffer, through the pipeline's tokenizer and write path.

BUFFER is a store (created with the pipeline's ``create_buffer`` when new) or a run (its
directory or ``buffer/``: the rows get a shard of their own, the pipeline and settings come
from the run). Either may be at an ``s3://`` or ``az://`` URL (a run made with ``run --home URL``;
a store at a URL is a Zarr store); another scheme is refused. See
:mod:`rlhf_pipeline.dataio.importer` for what happens, in which order. Design: docs/datasets.md#import.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rlhf_pipeline.cli import CommandRefused
from rlhf_pipeline.cli.checks import store_or_run, writable_output

_COLUMN_OPTIONS = (
    ("--prompt", "prompt", "prompt text column (default: prompt_text or prompt)"),
    ("--messages", "messages", "chat messages column, rendered with the chat template (default: messages)"),
    ("--prompt-ids", "prompt_ids", "prompt token ids column (default: prompt_tokens, prompt_token_ids or prompt_ids)"),
    ("--completion", "completion", "completion text column, or a list of completions per prompt "
                                   "(default: response_text, completion, response, completions or responses)"),
    ("--completion-ids", "completion_ids", "completion token ids column (default: response_tokens, "
                                           "completion_token_ids, completion_ids or token_ids)"),
    ("--reward", "reward", "reward column (default: reward or rewards)"),
    ("--group", "group", "group key column (default: group_id; without one, completions of one prompt form a group)"),
    ("--log-probs", "log_probs", "per-token sampling log-probs column (default: response_log_probs, log_probs or "
                                 "logprobs; without one they are computed with the pipeline's model)"),
    ("--version", "version", "policy version column (default: policy_version)"),
)


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("source", help="a JSONL or Parquet file, a save_to_disk directory, or a directory of data files")
    parser.add_argument("buffer", help="the buffer to write: a store path (new or existing), or a run directory / "
                                       "its buffer/ (a new shard), or a run's name with --home; either may be "
                                       "an s3:// or az:// URL")
    parser.add_argument("--home", default=None, help="directory or s3:// or az:// URL holding runs, for a BUFFER "
                                                     "given by its run's name")
    parser.add_argument("--pipeline", metavar="PIPELINE.py", default=None,
                        help="pipeline whose tokenizer, model and write path the import uses (optional for a "
                             "run, which keeps a copy of its own)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a pipeline setting (not for a run: its settings.json decides)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="where log-probs are computed")
    parser.add_argument("--format", choices=("jsonl", "parquet", "hf"), default=None,
                        help="source format (default: from the file name or directory contents)")
    parser.add_argument("--split", default=None, help="split of a Hugging Face dataset (default: train)")
    group = parser.add_argument_group("columns (dotted paths reach into nested records: outputs.0.token_ids)")
    for flag, dest, help_text in _COLUMN_OPTIONS:
        group.add_argument(flag, dest=f"col_{dest}", metavar="COL", default=None, help=help_text)
    group.add_argument("--ignore-column", action="append", default=[], metavar="COL",
                       help="a column not to read, even if its name says what it holds (repeatable)")
    group.add_argument("--no-eos", action="store_true",
                       help="do not end text completions with the tokenizer's EOS (they are stored as truncated)")
    group.add_argument("--no-text-check", action="store_true",
                       help="do not check that given token ids decode to the given text")
    parser.add_argument("--policy-version", type=int, default=None,
                        help="version of rows without a version column (default: the version of the weights "
                             "that score missing log-probs; with log-probs given, the run's newest version, or 0 "
                             "outside a run)")
    parser.add_argument("--rows-per-chunk", type=int, default=512, help="source rows read and written at a time")
    parser.add_argument("--quiet", action="store_true", help="no progress output")


def run(args: argparse.Namespace) -> int:
    import sys

    from rlhf_pipeline.dataio.sources import SourceError, open_source

    # arguments first: the imports below (torch, transformers) take seconds
    if args.rows_per_chunk < 1:
        raise CommandRefused("--rows-per-chunk must be >= 1")
    if args.policy_version is not None and not 0 <= args.policy_version < 2**63:  # stored as int64, from 0
        raise CommandRefused(f"--policy-version must be in [0, 2**63), got {args.policy_version}")
    if args.pipeline is not None and not Path(args.pipeline).is_file():
        raise CommandRefused(f"pipeline file {args.pipeline!r} does not exist")
    args.buffer = store_or_run(args.buffer, args.home, "BUFFER")
    writable_output(args.buffer, "BUFFER")
    if "://" not in args.buffer and args.buffer.rstrip("/").endswith(".zip") and not Path(args.buffer).exists():
        # a new store is one an import appends to, a directory: named .zip it would read as no zip
        raise CommandRefused(f"BUFFER {args.buffer}: a zipped store is read-only, and import writes a store it appends "
                             f"to; import into a directory, then `rlhf-pipeline convert DIR {args.buffer} --to zarr` "
                             f"zips it")
    if args.device is not None:
        from rlhf_pipeline.pipeline import PipelineError
        from rlhf_pipeline.runs.run import check_cuda_device

        try:
            check_cuda_device(args.device, what="--device")
        except PipelineError as exc:
            raise CommandRefused(str(exc)) from None
    try:
        open_source(args.source, args.format, args.split)
    except SourceError as exc:
        raise CommandRefused(str(exc)) from None
    from rlhf_pipeline.runs.stopping import StopFlag

    # the first Ctrl-C (or SIGTERM) asks the import to stop after the append it is writing; a
    # second one interrupts at once, which a resume survives as well (appends are atomic)
    stop = StopFlag("import")
    try:
        return _import(args, stop.event)
    except KeyboardInterrupt:  # also how _import_into reports ImportStopped
        pass
    finally:
        stop.restore()
    print(f"[import] interrupted; the rows written so far are recorded: run the same command again to resume "
          f"the import into {args.buffer}", file=sys.stderr, flush=True)
    return 128 + (stop.signal or 2)


def _import(args: argparse.Namespace, stop) -> int:
    from contextlib import nullcontext

    from rlhf_pipeline.dataio.columns import ColumnMap
    from rlhf_pipeline.dataio.importer import ImportOptions
    from rlhf_pipeline.dataio.run_pipeline import find_run
    from rlhf_pipeline.files.run_paths import RunLocationError, check_run_url, is_url
    from rlhf_pipeline.files.run_store import RunStoreError
    from rlhf_pipeline.runs.run_directory import RunError, hold_run_directory

    columns = ColumnMap(**{dest: getattr(args, f"col_{dest}") for _, dest, _ in _COLUMN_OPTIONS},
                        ignore=tuple(args.ignore_column), append_eos=not args.no_eos,
                        check_text=not args.no_text_check)
    options = ImportOptions(columns=columns, format=args.format, split=args.split,
                            policy_version=args.policy_version, rows_per_chunk=args.rows_per_chunk,
                            show_progress=not args.quiet, stop=stop)
    try:
        if is_url(args.buffer):  # never a local path named "s3:"; only where the import can write
            check_run_url(args.buffer, "BUFFER")
        run = find_run(args.buffer)
    except RunLocationError as exc:
        raise CommandRefused(f"{exc}. An import writes a buffer at an s3:// or az:// URL only: for another place, "
                             f"import into a local path and copy it with `rlhf-pipeline convert`") from None
    except RunStoreError as exc:  # the object store refused to say whether a run is there
        raise CommandRefused(str(exc)) from None
    try:
        # importing into a run's buffer takes the run directory, as `run` and `replay` do
        with hold_run_directory(run, "import") if run is not None else nullcontext():
            return _import_into(args, run, options)
    except (RunError, RunStoreError) as exc:
        raise CommandRefused(str(exc)) from None


def _import_into(args: argparse.Namespace, run, options) -> int:
    import sys

    from rlhf_pipeline.dataio.extras import MissingExtraError
    from rlhf_pipeline.dataio.importer import ImportStopped, import_source
    from rlhf_pipeline.dataio.run_pipeline import load_run_pipeline
    from rlhf_pipeline.dataio.sources import SourceError
    from rlhf_pipeline.files.run_store import RunStoreError, StaleWriterError
    from rlhf_pipeline.pipeline import (PipelineError, RunPaths, load_pipeline_module, make_settings,
                                        zarr_where_the_buffer_is_a_url)
    from rlhf_pipeline.runs.processes import build_pipeline, set_threads
    from rlhf_pipeline.storage import StoreError

    try:
        if run is not None:
            if args.overrides:
                raise CommandRefused(f"{args.buffer} belongs to run {run.location}, whose settings.json sets the "
                                     f"pipeline's settings; drop --set")
            pipeline = load_run_pipeline(run, args.pipeline, device=args.device)
        else:
            if args.pipeline is None:
                raise CommandRefused("pass --pipeline PIPELINE.py: its tokenizer, model and write path shape the rows")
            module = load_pipeline_module(args.pipeline)
            overrides = list(args.overrides) + ([f"device={args.device}"] if args.device else [])
            settings = make_settings(module, zarr_where_the_buffer_is_a_url(overrides,
                                                                             run_at_a_url="://" in args.buffer))
            home = args.buffer.rstrip("/").rsplit("/", 1)[0] if "://" in args.buffer else None
            pipeline = build_pipeline(module, settings, RunPaths.at_url(home) if home else
                                      RunPaths(Path(args.buffer).resolve().parent))
        set_threads(pipeline)  # as `run` does: the warm start in make_policy() obeys it too
        log = (lambda *a, **k: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
        result = import_source(args.source, args.buffer, pipeline, options=options, run_root=run, log=log)
    except (SourceError, PipelineError, StoreError, MissingExtraError, RunStoreError, StaleWriterError) as exc:
        raise CommandRefused(str(exc)) from None
    except ImportStopped:
        raise KeyboardInterrupt from None
    if not result.already_done:
        print(f"{result.buffer}: {result.rows_written} rows imported from {args.source}")
        if run is not None and result.rows_written and (note := _passed_over_note(pipeline, run, result.buffer)):
            print(note, file=sys.stderr)
    return 0


def _passed_over_note(pipeline, run, shard: str) -> str | None:
    """What the run's learner will make of the rows just imported into ``shard``: it passes over, untrained,
    a row more than ``learner.max_staleness`` versions older than the weights it trains with. None for a
    learner without that bound."""
    import torch

    from rlhf_pipeline.coordination.weights import latest_version
    from rlhf_pipeline.storage import open_store

    bound = pipeline.learner.max_staleness
    if bound is None:
        return None
    store = open_store(shard)
    try:
        versions = store.read(torch.arange(len(store)), fields=("policy_version",))["policy_version"]
    finally:
        store.close()
    oldest, youngest, newest = int(versions.min()), int(versions.max()), latest_version(run.store) or 0
    these = f"policy version {oldest}" if oldest == youngest else f"policy versions {oldest}-{youngest}"
    rule = (f"trains no row more than {bound} version{'s' * (bound != 1)} older than the weights it trains with "
            f"(learner.max_staleness, from max_lag={pipeline.settings.max_lag})")
    replay = "; `rlhf-pipeline replay` trains every row of a buffer"
    if newest - youngest > bound:
        return (f"[import] note: the run's learner, at version {newest}, {rule}: it will pass over all of these rows "
                f"({these}), untrained (charts/rows_dropped_stale). Imported without their log-prob and version "
                f"columns (--ignore-column), they are scored with version {newest}{replay}")
    share = (" and takes an even share of each batch from this shard beside its collectors'"
             if pipeline.learner.sampler == "exact" else "")
    return (f"[import] note: the run's learner {rule}{share}: the rows of this import ({these}) it has not taken "
            f"by the time it trains with version {youngest + bound + 1} are passed over, untrained "
            f"(charts/rows_dropped_stale){replay}")
