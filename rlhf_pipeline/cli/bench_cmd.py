"""``rlhf-pipeline bench <name>``: a small registry of benchmarks.

Each benchmark is a module with ``add_arguments(parser)`` (its own options) and ``main(args) -> int``
(runs it, prints a table, or one JSON document with ``--json`` so stdout stays machine-readable;
progress goes to stderr). ``--page PAGE``, on every benchmark, also keeps what it printed on the
benchmarks page (:mod:`rlhf_pipeline.bench.page`). To add one, add a row to ``BENCHMARKS``; modules
are imported only when their benchmark is chosen (and to build ``--help``), so they keep torch
imports inside ``main``. Design: docs/benchmarks.md#how-the-page-is-kept.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

from rlhf_pipeline.cli import CommandRefused

# benchmark name -> (module, one-line help)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "storage": (
        "rlhf_pipeline.bench.storage_bench",
        "write speed, padded sampling speed, disk and RSS of each storage backend",
    ),
    "write-path": (
        "rlhf_pipeline.bench.write_path_bench",
        "cost of the write-path transform stack per completion",
    ),
    "curation": (
        "rlhf_pipeline.bench.curation_bench",
        "prioritized sampling and filter against plain baselines",
    ),
    "replay": (
        "rlhf_pipeline.bench.replay_bench",
        "epoch-order replay of a buffer bigger than the Zarr cache: memmap vs Zarr, uniform sampling beside",
    ),
    "e2e": (
        "rlhf_pipeline.bench.e2e_bench",
        "the default pipeline against a synchronous generate-then-train loop, to the same steps",
    ),
    "learner": (
        "rlhf_pipeline.bench.learner_bench",
        "learner steps on length-skewed rows: padded vs packed micro-batches, TRL's GRPOTrainer beside",
    ),
    "tool-use": (
        "rlhf_pipeline.bench.tool_use_bench",
        "pipelines/tool_use.py against TRL's GRPOTrainer with tools=, same weights, tasks and steps (needs trl)",
    ),
    "generation": (
        "rlhf_pipeline.bench.generation_bench",
        "our sampling loop, HF generate, a vLLM engine and a vLLM server on the same model and tokens",
    ),
}


def add_arguments(parser: argparse.ArgumentParser, name: str | None = None) -> None:
    from rlhf_pipeline.bench.page import PAGE_HELP  # here, not at the top: every command imports this module

    sub = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for bench_name, (module_name, help_text) in BENCHMARKS.items():
        bench_parser = sub.add_parser(bench_name, help=help_text, description=help_text)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name != module_name:
                raise
            # registered but not written yet: still listed, fails clearly when run
            bench_parser.set_defaults(_bench_module=None)
            continue
        module.add_arguments(bench_parser)
        bench_parser.add_argument("--page", type=Path, metavar="PAGE", help=PAGE_HELP)
        bench_parser.set_defaults(_bench_module=module_name)


def run(args: argparse.Namespace) -> int:
    module_name = getattr(args, "_bench_module", None)
    if module_name is None:
        raise SystemExit(f"rlhf-pipeline bench {args.benchmark}: this benchmark is not built yet")
    module = importlib.import_module(module_name)
    if args.page is None:
        return int(module.main(args) or 0)
    from rlhf_pipeline.bench.page import PageError, command_line, run_and_keep

    try:
        return run_and_keep(lambda: int(module.main(args) or 0), command=command_line(["rlhf-pipeline", *args.argv]),
                            page=args.page)
    except PageError as exc:
        raise CommandRefused(str(exc)) from None
