"""Entry point of ``rlhf-pipeline``: parses arguments first, imports heavy modules last.

Each command lives in its own module under ``rlhf_pipeline.cli`` with two functions,
``add_arguments(parser)`` and ``run(args) -> int``. Modules keep torch, transformers
and zarr imports inside ``run`` so ``--help`` and argument errors return at once.
To add a command, add a row to ``COMMANDS``. Design: docs/architecture.md#the-command-line;
every command: docs/commands.md.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from rlhf_pipeline.cli import CommandRefused
from rlhf_pipeline.cli.bench_cmd import BENCHMARKS  # names only: the benchmarks load when one is run
from rlhf_pipeline.cli.checks import resolve_run_arguments
from rlhf_pipeline.files.run_store import RunStoreError  # no torch: the run store's base and errors
from rlhf_pipeline.learn.errors import LearnerRefused  # no torch: errors only
from rlhf_pipeline.storage.errors import StoreClosedError, StoreError  # no torch: errors only

# command name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("rlhf_pipeline.cli.run_cmd", "run a pipeline: collector and learner together"),
    "collect": ("rlhf_pipeline.cli.run_cmd", "run only the collector of a pipeline"),
    "learn": ("rlhf_pipeline.cli.run_cmd", "run only the learner of a pipeline"),
    "inspect": ("rlhf_pipeline.cli.inspect_cmd", "summarize a replay buffer (memmap or Zarr)"),
    "show": ("rlhf_pipeline.cli.show_cmd", "one stored trajectory token by token: what is trained, log-probs, HTML"),
    "convert": ("rlhf_pipeline.cli.convert_cmd", "copy a buffer between memmap and Zarr, losslessly"),
    "filter": ("rlhf_pipeline.cli.filter_cmd", "keep rows or whole groups of a buffer: a new buffer or a selection"),
    "replay": ("rlhf_pipeline.cli.replay_cmd", "train a new run from a recorded buffer (epochs, no generation)"),
    "branch": ("rlhf_pipeline.cli.branch_cmd", "a new run from another run's checkpoint of step N (settings may change)"),
    "detach": ("rlhf_pipeline.cli.detach_cmd", "make a branch self-contained: copy the parent rows it reads into its own"),
    "repair": ("rlhf_pipeline.cli.repair_cmd", "rebuild a damaged buffer's published state (dry run by default)"),
    "bench": ("rlhf_pipeline.cli.bench_cmd", "benchmarks: " + ", ".join(BENCHMARKS)),
    "import": ("rlhf_pipeline.cli.import_cmd", "rows from JSONL, Parquet or a HF dataset into a buffer"),
    "export": ("rlhf_pipeline.cli.export_cmd",
               "a buffer's rows to JSONL, Parquet or a HF dataset; whole trajectories as chat messages (chat)"),
    "export-model": ("rlhf_pipeline.cli.export_model_cmd", "a run's policy as a save_pretrained directory"),
    "plot": ("rlhf_pipeline.cli.plot_cmd", "PNG charts of runs' metrics, overlaid"),
    "eval": ("rlhf_pipeline.cli.eval_cmd", "a run's kept policy versions on its held-out sets, into its eval store"),
    "setup-vllm": ("rlhf_pipeline.cli.setup_vllm_cmd", "make the environment the vLLM generation engine runs under"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlhf-pipeline",
        description="Durable replay buffers and GRPO post-training for language models.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {installed_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.commands = {}  # each command's own parser, by name (parse_command_line)
    for name, (module_name, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        module.add_arguments(command_parser, name)
        command_parser.set_defaults(_module=module_name)
        parser.commands[name] = command_parser
    return parser


def parse_command_line(argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed, a command's options anywhere among its positionals (``export-model RUN --home DIR
    OUT``: plain argparse takes ``OUT`` for an unrecognized argument once an option splits the positionals)."""
    parser = build_parser()
    command = next(iter(argv), None)
    if command is None:  # the bare command: its commands, as `--help` lists them, not argparse's one-line error
        parser.print_help(sys.stderr)
        raise SystemExit(2)
    if command not in parser.commands:
        return parser.parse_args(argv)  # --help, --version, a typo: argparse's own answers
    try:
        args = parser.commands[command].parse_intermixed_args(argv[1:])
    except TypeError:  # a command with sub-commands of its own (bench), which intermixed parsing cannot take
        return parser.parse_args(argv)
    args.command = command
    return args


def installed_version() -> str:
    """This package's version as installed (``pip install -e .`` included)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rlhf-pipeline")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed: run pip install -e . in the repository)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse_command_line(argv)
        resolve_run_arguments(args)
    except CommandRefused as exc:  # an argument's own check (cli/checks.py: run_or_path)
        command = next((word for word in argv if not word.startswith("-")), "")
        print(f"rlhf-pipeline {command}: error: {exc}", file=sys.stderr)
        return exc.code
    args.argv = argv  # the command line as typed: `bench --page` records it
    try:
        module = importlib.import_module(args._module)
        code = int(module.run(args) or 0)
        sys.stdout.flush()  # here, so a closed pipe is caught below and not at interpreter exit
        return code
    except BrokenPipeError:
        # the reader left early (`inspect BUF | head`): as Python's docs recommend (library
        # signal, "Note on SIGPIPE"), send the rest of the output to devnull and exit 1
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:  # Ctrl-C before a command installed its own handling
        print(f"rlhf-pipeline {args.command}: interrupted", file=sys.stderr)
        return 130
    except CommandRefused as exc:
        print(f"rlhf-pipeline {args.command}: error: {exc}", file=sys.stderr)
        return exc.code
    except (StoreError, RunStoreError) as exc:
        # what a command did not word itself (a writer lock held by another process, a store refused at
        # a URL, s3fs missing for one): one line naming what and where, as every other refusal; a closed
        # store is a bug
        if isinstance(exc, StoreClosedError):
            raise
        print(f"rlhf-pipeline {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except LearnerRefused as exc:  # `learn`, `replay`: a refused step (its checkpoint kept), no rows, no GPU for a rank
        print(f"rlhf-pipeline {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
