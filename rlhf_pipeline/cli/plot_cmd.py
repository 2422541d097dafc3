"""``rlhf-pipeline plot RUN_DIR [RUN_DIR ...] --out DIR``: PNG charts of runs, overlaid.

Reward, KL, response length, clip fractions, staleness and throughput over learner steps,
from each run's ``metrics.jsonl``, and each held-out evaluation's scores beside the training
reward (``eval/metrics.jsonl``); one PNG per chart plus ``overview.png``. Needs the
``plot`` extra (matplotlib). See :mod:`rlhf_pipeline.dataio.plots`. Design: docs/datasets.md#plot.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rlhf_pipeline.cli import CommandRefused
from rlhf_pipeline.cli.checks import add_run_argument, writable_output

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".svg", ".pdf", ".gif", ".webp"}


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    add_run_argument(parser, "runs", nargs="+", metavar="RUN_DIR",
                        help="run directories or runs' names, runs at s3:// or az:// URLs (copied into the local cache), or "
                             "metrics.jsonl files")
    parser.add_argument("--out", required=True, help="directory for the PNG files")


def _refuse_an_image_name(out: str) -> None:
    """``--out chart.png`` asks for one picture; plot draws several, into a directory that name would make."""
    if Path(out).suffix.lower() in IMAGE_SUFFIXES and not Path(out).is_dir():
        raise CommandRefused(f"--out {out}: --out is the directory plot writes its charts into (one PNG per chart and "
                             f"overview.png), not an image file; give a directory, e.g. --out "
                             f"{Path(out).with_suffix('')}")


def run(args: argparse.Namespace) -> int:
    import sys

    from rlhf_pipeline.dataio.extras import MissingExtraError
    from rlhf_pipeline.dataio.plots import NotMetricsError, plot_runs
    from rlhf_pipeline.files.run_cache import local_copy
    from rlhf_pipeline.files.run_paths import RunLocationError
    from rlhf_pipeline.files.run_store import RunStoreError

    _refuse_an_image_name(args.out)
    writable_output(args.out, "--out", kind="directory")
    try:
        written = plot_runs([local_copy(run) for run in args.runs], args.out)
    except (MissingExtraError, FileNotFoundError, FileExistsError, NotMetricsError, RunLocationError,
            RunStoreError) as exc:
        raise CommandRefused(str(exc)) from None
    if not written:
        print("rlhf-pipeline plot: the runs logged none of the charted metrics yet", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0
