"""End-to-end benchmark: ``run`` against a synchronous generate-then-train loop (:mod:`.sync_loop`).

Both train the same pipeline and settings to the same steps in fresh processes; ``--repeat N``
alternates them and reports medians. Figures per mode: ``wall_s``, ``time_to_first_step_s``,
``learner_step_s``, ``generation_s`` / ``generation_total_s``, ``rows_generated_per_row_trained``
(1.0: nothing wasted), ``reward_first`` / ``reward_last``. Method and figures:
docs/benchmarks.md#end-to-end-rlhf-pipeline-bench-e2e.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rlhf_pipeline.bench.storage_backends import log

MODES = ("pipeline", "synchronous")
FIGURES = ("wall_s", "time_to_first_step_s", "learner_step_s", "generation_s", "generation_total_s",
           "rows_generated_per_row_trained", "reward_first", "reward_last")


def default_pipeline() -> Path:
    return Path(__file__).resolve().parents[2] / "pipelines" / "default.py"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pipeline", default=None, metavar="PIPELINE.py",
                        help="pipeline file (default: the repository's pipelines/default.py)")
    parser.add_argument("--steps", type=int, default=300, help="learner steps per mode (default %(default)s)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run the two modes alternately N times; figures are medians (default %(default)s)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="pipeline setting for both modes, e.g. --set threads=2 (repeatable)")
    parser.add_argument("--sync-threads", type=int, default=None, metavar="N",
                        help="torch threads of the synchronous loop (default: the pipeline's `threads`)")
    parser.add_argument("--json", action="store_true", help="print one JSON record per mode on stdout")


def main(args: argparse.Namespace) -> int:
    pipeline = Path(args.pipeline) if args.pipeline else default_pipeline()
    if not pipeline.is_file():
        raise SystemExit(f"bench e2e: pipeline file {str(pipeline)!r} does not exist; pass --pipeline PATH")
    if args.steps < 1 or args.repeat < 1:
        raise SystemExit("bench e2e: --steps and --repeat must be >= 1")
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as home:
        for number in range(args.repeat):
            for mode in MODES:
                log(f"[bench e2e] {mode}, run {number + 1}/{args.repeat}: {args.steps} steps "
                     f"(load average {os.getloadavg()[0]:.1f})")
                record = run_mode(mode, pipeline, steps=args.steps, home=Path(home), name=f"{mode}-{number}",
                                  overrides=args.overrides, sync_threads=args.sync_threads)
                runs[mode].append(record)
                log(f"[bench e2e] {mode}: wall {record['wall_s']:.1f}s, first step "
                     f"{record['time_to_first_step_s']:.1f}s, waste {record['rows_generated_per_row_trained']:.3f}, "
                     f"reward {record['reward_first']:.3f} -> {record['reward_last']:.3f}")
    records = [summarize(mode, runs[mode], args.steps) for mode in MODES]
    if args.json:
        print(json.dumps(records, indent=2))
    else:
        print(format_table(records))
    return 0


# =========================================================================== one run
def run_mode(mode: str, pipeline: Path, *, steps: int, home: Path, name: str, overrides: list[str],
             sync_threads: int | None = None) -> dict[str, Any]:
    """Runs one mode in fresh processes; returns its figures (read from the run directory)."""
    settings = [item for pair in (("--set", o) for o in overrides) for item in pair]
    if mode == "pipeline":
        command = [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", str(pipeline), "--steps", str(steps),
                   "--home", str(home), "--run-name", name, *settings]
    elif mode == "synchronous":
        threads = ["--threads", str(sync_threads)] if sync_threads is not None else []
        command = [sys.executable, "-m", "rlhf_pipeline.bench.sync_loop", str(pipeline), "--steps", str(steps),
                   "--home", str(home), "--run-name", name, *threads, *settings]
    else:
        raise ValueError(f"unknown mode {mode!r}; choose from {MODES}")
    started = time.time()
    # the children's output goes to stderr: stdout stays one JSON document with --json
    result = subprocess.run(command, stdout=sys.stderr, stderr=sys.stderr)
    wall = time.time() - started
    if result.returncode != 0:
        raise SystemExit(f"bench e2e: the {mode} run failed (exit code {result.returncode}); see above")
    return {"wall_s": wall, **run_figures(home / name, started)}


def run_figures(run: Path, started: float) -> dict[str, float]:
    """The figures of a finished run directory (``started``: when its command was launched)."""
    from rlhf_pipeline.learn.metrics import read_metrics
    from rlhf_pipeline.storage import open_buffer

    steps = read_metrics(run / "metrics.jsonl")
    rounds = [r for path in sorted((run / "collector").glob("metrics-*.jsonl")) for r in read_metrics(path)]
    if not steps or not rounds:
        raise SystemExit(f"bench e2e: {run} has no learner or collector metrics")
    with open_buffer(run / "buffer") as buffer:
        generated = buffer.next_row
    tenth = max(1, len(steps) // 10)
    rewards = [r["charts/reward_mean"] for r in steps]
    generation = [r["generate_s"] for r in rounds]
    return {
        "steps": len(steps),
        "time_to_first_step_s": steps[0]["time"] - started,
        "learner_step_s": statistics.fmean(r["charts/step_time_s"] for r in steps),
        "generation_s": statistics.fmean(generation),
        "generation_total_s": sum(generation),
        "rounds": len(rounds),
        "rows_generated": generated,
        "rows_trained": steps[-1]["charts/rows_trained"],
        "rows_generated_per_row_trained": generated / max(steps[-1]["charts/rows_trained"], 1),
        "reward_first": statistics.fmean(rewards[:tenth]),
        "reward_last": statistics.fmean(rewards[-tenth:]),
    }


def summarize(mode: str, runs: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """One record per mode: the median of each figure over the runs, and every run."""
    record: dict[str, Any] = {"mode": mode, "steps": steps, "repeat": len(runs)}
    for figure in (*FIGURES, "rounds", "rows_generated", "rows_trained"):
        record[figure] = statistics.median(r[figure] for r in runs)
    record["runs"] = runs
    return record


# =========================================================================== report
def format_table(records: list[dict[str, Any]]) -> str:
    by_mode = {r["mode"]: r for r in records}
    pipe, sync = by_mode["pipeline"], by_mode["synchronous"]
    repeat = pipe["repeat"]
    lines = [f"end to end: {pipe['steps']} learner steps per mode"
             + (f", medians of {repeat} alternating runs" if repeat > 1 else ""),
             "| figure | pipeline | synchronous | pipeline / synchronous |", "|---|---|---|---|"]
    for figure in FIGURES:
        a, b = pipe[figure], sync[figure]
        ratio = f"{a / b:.2f}x" if b else "n/a"
        lines.append(f"| {figure} | {a:.3f} | {b:.3f} | {ratio} |")
    goals = [
        ("wall_s at most 0.75x the synchronous loop's", pipe["wall_s"] <= 0.75 * sync["wall_s"]),
        ("rows generated per row trained at most 1.1", pipe["rows_generated_per_row_trained"] <= 1.1),
        ("reward_last no lower than the synchronous loop's", pipe["reward_last"] >= sync["reward_last"]),
    ]
    lines.append("")
    lines += [f"{'met' if ok else 'NOT met'}: {goal}" for goal, ok in goals]
    return "\n".join(lines)


