"""``rlhf-pipeline export BUFFER OUT [--format jsonl|parquet|hf|chat]``: a buffer's rows as a dataset.

Every stored field, exact, one row per stored row; ``import`` reads it back into an equal
buffer. Streams one segment at a time with progress. The format follows OUT's suffix
(``rows.parquet``) unless ``--format`` says it; a contradiction is refused. Arguments are
checked before torch is imported. See :mod:`rlhf_pipeline.dataio.export`.
Design: docs/datasets.md#export.
"""

from __future__ import annotations

import argparse

from rlhf_pipeline.cli import CommandRefused
from rlhf_pipeline.cli.checks import add_run_argument


# the optional packages each export format writes with (dataio/export.py), and its name in an error
EXTRAS_OF_FORMAT = {"parquet": ("pyarrow",), "hf": ("pyarrow", "datasets")}
FORMAT_NAMES = {"parquet": "Parquet", "hf": "a Hugging Face dataset"}


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    add_run_argument(parser, "buffer",
                        help="a store (memmap directory, Zarr store), a run's buffer/ of shards, or a run (its "
                             "directory, URL or name): its buffer")
    parser.add_argument("out", help="file (jsonl, parquet) or directory (hf) to write; must not exist")
    parser.add_argument("--format", choices=("jsonl", "parquet", "hf", "chat"), default=None,
                        help="jsonl, parquet, hf (a datasets save_to_disk directory), or chat (JSONL, one "
                             "whole trajectory a line: chat messages, token ids per turn); "
                             "default: what OUT's suffix names (.jsonl, .parquet)")
    parser.add_argument("--quiet", action="store_true", help="no progress output")


def run(args: argparse.Namespace) -> int:
    import os

    from rlhf_pipeline.cli.checks import buffer_given, buffer_path_problem, writable_output
    from rlhf_pipeline.dataio.export import export_format
    from rlhf_pipeline.dataio.extras import missing_extra

    try:
        fmt = export_format(args.out, args.format)
    except ValueError as exc:
        raise CommandRefused(str(exc)) from None
    problem = buffer_path_problem(args.buffer)
    if problem is None and os.path.exists(args.out):
        problem = f"{args.out} already exists; choose another path or remove it"
    if problem is None:  # before the buffer is read (and torch imported), not after
        problem = missing_extra(EXTRAS_OF_FORMAT.get(fmt, ()), f"exporting to {FORMAT_NAMES.get(fmt, fmt)}")
    if problem is not None:
        raise CommandRefused(problem)
    writable_output(args.out, "OUT")
    buffer = buffer_given(args.buffer, "export")

    from rlhf_pipeline.dataio.export import ExportSpaceError, export_buffer
    from rlhf_pipeline.dataio.extras import MissingExtraError
    from rlhf_pipeline.dataio.progress import Progress
    from rlhf_pipeline.storage import StoreError

    progress = Progress(f"export -> {fmt}", enabled=not args.quiet)

    def report(done: int, total: int) -> None:
        if progress.total != total:
            progress.set_total(total)
        progress.update(done - progress.done)

    try:
        result = export_buffer(buffer, args.out, fmt, progress=report)
    except (StoreError, FileExistsError, MissingExtraError, IndexError) as exc:
        progress.close(failed=True)
        raise CommandRefused(str(exc)) from None
    except ExportSpaceError as exc:
        progress.close(failed=True)
        raise CommandRefused(exc.strerror, code=1) from None
    progress.close()
    if result.trajectories is not None:
        skipped = (f" ({result.trajectories_skipped} not held whole were skipped)"
                   if result.trajectories_skipped else "")
        print(f"{result.out}: {result.trajectories} trajectories from {result.rows} rows{skipped}, "
              f"fields {', '.join(result.fields)}")
    else:
        print(f"{result.out}: {result.rows} rows, fields {', '.join(result.fields)}")
    return 0
