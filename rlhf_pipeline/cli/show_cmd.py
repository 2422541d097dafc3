"""``rlhf-pipeline show BUFFER``: one stored trajectory, token by token, trained or not.

Prints the trajectory turn by turn (what was added before each turn, grey; what the model
sampled and is trained on, green) and with ``--html PAGE`` writes a self-contained page that
reads as text, with a table per turn of every token's id and log-probs. Without
``--trajectory``/``--row`` it shows the newest whole trajectory. Tokens are decoded with the
pipeline's tokenizer: the run's own when the buffer belongs to a run, else ``--pipeline``'s; with
neither, tokens are shown by id and turns by their stored text. See
:mod:`rlhf_pipeline.dataio.trajectory_view`. Design: docs/buffer-tools.md#show.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rlhf_pipeline.cli import CommandRefused
from rlhf_pipeline.cli.checks import add_run_argument, writable_output

EXAMPLES = """examples:
  rlhf-pipeline show storage/tool_use                          # the newest trajectory of a run
  rlhf-pipeline show storage/tool_use --trajectory 17 --log-probs
  rlhf-pipeline show my_buffer --pipeline pipelines/default.py --row 0 --html trajectory.html
"""


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.epilog = EXAMPLES
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_run_argument(parser, "buffer",
                        help="a run directory or a run's name, its buffer, a memmap or Zarr store, or a saved selection")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--trajectory", type=int, metavar="ID", help="the trajectory id to show")
    which.add_argument("--row", type=int, metavar="N", help="show the trajectory holding row N (0 = oldest held)")
    parser.add_argument("--pipeline", default=None,
                        help="pipeline file whose tokenizer decodes the tokens (default: the run's, for a run's buffer)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a --pipeline setting (repeatable)")
    parser.add_argument("--html", metavar="PAGE", default=None,
                        help="also write a self-contained HTML page here (the text, and a table per turn of every "
                             "token's id and log-probs)")
    parser.add_argument("--log-probs", action="store_true", help="print each sampled token's log-prob after it")
    parser.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                        help="colour trained tokens (default: when printing to a terminal)")


def run(args: argparse.Namespace) -> int:
    import sys

    if "://" not in args.buffer and not Path(args.buffer).exists():  # before the imports below (torch)
        raise CommandRefused(f"{args.buffer} does not exist")
    if args.html:
        writable_output(args.html, "--html", kind="file")
    from rlhf_pipeline.dataio.run_pipeline import find_run
    from rlhf_pipeline.files.atomic import write_atomic
    from rlhf_pipeline.files.run_paths import RunLocationError
    from rlhf_pipeline.dataio.trajectory_view import (
        TrajectoryNotFound,
        find_trajectory,
        format_trajectory,
        trajectory_html,
        written_by_show,
    )
    from rlhf_pipeline.pipeline import PipelineError
    from rlhf_pipeline.storage import StoreError, open_buffer

    if args.html and Path(args.html).is_file() and not written_by_show(Path(args.html)):
        raise CommandRefused(f"--html {args.html} already exists and is not a page show wrote (those it replaces); "
                             f"choose another path or remove it")

    if args.pipeline is not None and not Path(args.pipeline).is_file():
        raise CommandRefused(f"pipeline file {args.pipeline!r} does not exist")
    if args.overrides and args.pipeline is None:
        raise CommandRefused("--set overrides a setting of --pipeline's pipeline: pass --pipeline PIPELINE.py too "
                             "(a run's buffer is decoded with the run's own settings)")
    try:
        run = find_run(args.buffer)  # a run directory or a run at a URL, or None
    except RunLocationError as exc:
        raise CommandRefused(str(exc)) from None
    location = args.buffer
    if run is not None and str(args.buffer).rstrip("/") == run.location.rstrip("/"):
        location = run.buffer_location
    elif run is not None and run.url is None and Path(args.buffer).resolve() == run.root:
        location = run.buffer_location
    try:
        tokenizer = _tokenizer(args, run)
        with open_buffer(location, mode="r") as store:
            view = find_trajectory(store, args.trajectory, row=args.row)
    except (StoreError, PipelineError, TrajectoryNotFound) as exc:
        raise CommandRefused(str(exc)) from None
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    print(format_trajectory(view, tokenizer, color=color, log_probs=args.log_probs))
    if tokenizer is None:
        print("(tokens shown by id: pass --pipeline PIPELINE.py to decode them with its tokenizer)", file=sys.stderr)
    if args.html:
        page = trajectory_html(view, tokenizer, title=str(args.buffer)).encode()
        write_atomic(args.html, lambda f: f.write(page), durable=False)  # a page read whole, or the one before
        print(f"wrote {args.html}", file=sys.stderr)
    return 0


def _tokenizer(args: argparse.Namespace, run):
    """The tokenizer of ``--pipeline`` (with ``--set``), else of the run (``RunPaths``), else None."""
    if args.pipeline is None and run is None:
        return None
    if args.pipeline is None:
        from rlhf_pipeline.dataio.run_pipeline import load_run_pipeline

        return load_run_pipeline(run).tokenizer
    from rlhf_pipeline.pipeline import RunPaths, load_pipeline_module, make_settings
    from rlhf_pipeline.runs.processes import build_pipeline

    module = load_pipeline_module(args.pipeline)
    # build() may name paths under it; show writes nothing there (a URL is no local path: the cwd then)
    scratch = Path.cwd() if "://" in str(args.buffer) else Path(args.buffer).resolve().parent
    return build_pipeline(module, make_settings(module, list(args.overrides)), RunPaths(scratch)).tokenizer
