"""``rlhf-pipeline export BUFFER OUT --format jsonl|parquet|hf``: a buffer's rows as a dataset.

Every stored field, exact, one row per stored row; ``import`` reads it back into an equal
buffer. Streams one segment at a time with progress. See :mod:`rlhf_pipeline.dataio.export`.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("buffer", help="a store (memmap directory, Zarr store) or a run's buffer/ of shards")
    parser.add_argument("out", help="file (jsonl, parquet) or directory (hf) to write; must not exist")
    parser.add_argument("--format", required=True, choices=("jsonl", "parquet", "hf"),
                        help="jsonl, parquet, or hf (a datasets save_to_disk directory)")
    parser.add_argument("--quiet", action="store_true", help="no progress output")


def run(args: argparse.Namespace) -> int:
    import sys

    from rlhf_pipeline.dataio.export import export_buffer
    from rlhf_pipeline.dataio.extras import MissingExtraError
    from rlhf_pipeline.dataio.progress import Progress
    from rlhf_pipeline.storage import StoreError

    progress = Progress(f"export -> {args.format}", enabled=not args.quiet)

    def report(done: int, total: int) -> None:
        if progress.total != total:
            progress.set_total(total)
        progress.update(done - progress.done)

    try:
        result = export_buffer(args.buffer, args.out, args.format, progress=report)
    except (StoreError, FileExistsError, MissingExtraError, IndexError) as exc:
        progress.close()
        print(f"rlhf-pipeline export: error: {exc}", file=sys.stderr)
        return 2
    progress.close()
    print(f"{result.out}: {result.rows} rows, fields {', '.join(result.fields)}")
    return 0
