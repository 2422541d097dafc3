"""Tool-use benchmark: ``pipelines/tool_use.py`` against TRL's ``GRPOTrainer`` with ``tools=``.

Per seed, one warm start saved and trained from on both sides, each in a fresh process, the order
alternating by seed: ``ours`` (``run --set init_weights=...``) and ``trl``
(:mod:`rlhf_pipeline.bench.trl_tool_side`). Figures per side, medians over the seeds: ``wall_s``,
``time_to_first_step_s``, ``reward_first`` / ``reward_last`` and ``tool_call_rate_first`` / ``_last``
(first and last tenth of the rounds TRL also samples), ``ended_on_call``, ``rounds``,
``episodes_per_step``. Method and figures: docs/benchmarks.md#tool-use-against-trl-rlhf-pipeline-bench-tool-use.
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
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

from rlhf_pipeline.bench.storage_backends import log

SIDES = ("ours", "trl")
FIGURES = ("wall_s", "time_to_first_step_s", "reward_first", "reward_last", "reward_mean", "tool_call_rate_first", "tool_call_rate_last",
           "ended_on_call", "rounds", "episodes_per_step")


def default_pipeline() -> Path:
    return Path(__file__).resolve().parents[2] / "pipelines" / "tool_use.py"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pipeline", default=None, metavar="PIPELINE.py",
                        help="pipeline file (default: the repository's pipelines/tool_use.py)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per side (default %(default)s)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], metavar="SEED",
                        help="seeds (model init, warm start, task order, sampling); one run per side each")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="pipeline setting for both sides, e.g. --set group_size=8 (repeatable)")
    parser.add_argument("--trl-threads", type=int, default=None, metavar="N",
                        help="torch threads of the TRL process (default: torch's, all cores)")
    parser.add_argument("--json", action="store_true", help="print one JSON record per side on stdout")


def main(args: argparse.Namespace) -> int:
    from rlhf_pipeline.bench.trl_side import trl_version

    if trl_version() is None:
        raise SystemExit("bench tool-use: TRL is not installed; pip install -e '.[bench-trl]'")
    pipeline = Path(args.pipeline) if args.pipeline else default_pipeline()
    if not pipeline.is_file():
        raise SystemExit(f"bench tool-use: pipeline file {str(pipeline)!r} does not exist; pass --pipeline PATH")
    if args.steps < 1:
        raise SystemExit("bench tool-use: --steps must be >= 1")
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory(prefix="bench-tool-use-") as home:
        for number, seed in enumerate(args.seeds):
            overrides = [*args.overrides, f"seed={seed}"]
            init = Path(home) / f"init-seed{seed}.pt"
            log(f"[bench tool-use] seed {seed}: warm start (load average {os.getloadavg()[0]:.1f})")
            seconds = initial_weights(pipeline, overrides, init)
            log(f"[bench tool-use] seed {seed}: initial weights in {seconds:.1f}s")
            for side in (SIDES if number % 2 == 0 else SIDES[::-1]):
                log(f"[bench tool-use] {side}, seed {seed}: {args.steps} steps "
                    f"(load average {os.getloadavg()[0]:.1f})")
                record = run_side(side, pipeline, steps=args.steps, home=Path(home), name=f"{side}-seed{seed}",
                                  overrides=overrides, init=init, trl_threads=args.trl_threads)
                record["seed"] = seed
                runs[side].append(record)
                log(f"[bench tool-use] {side}, seed {seed}: wall {record['wall_s']:.1f}s, reward "
                    f"{record['reward_first']:.3f} -> {record['reward_last']:.3f}, tool-call rate "
                    f"{record['tool_call_rate_first']:.2f} -> {record['tool_call_rate_last']:.2f}")
    records = [summarize(side, runs[side], args.steps) for side in SIDES]
    if args.json:
        print(json.dumps(records, indent=2))
    else:
        print(format_table(records))
    return 0


# =========================================================================== setup
def initial_weights(pipeline: Path, overrides: list[str], path: Path) -> float:
    """The pipeline's initial policy (its warm start) saved to ``path``; returns the seconds taken."""
    import torch

    from rlhf_pipeline.pipeline import RunPaths, load_pipeline_module, make_settings
    from rlhf_pipeline.runs.processes import build_pipeline

    started = time.time()
    module = load_pipeline_module(pipeline)
    settings = make_settings(module, overrides)
    # the pipeline prints its warm start on stdout, which --json keeps for the records
    with tempfile.TemporaryDirectory(prefix="bench-tool-use-build-") as scratch, redirect_stdout(sys.stderr):
        built = build_pipeline(module, settings, RunPaths(Path(scratch)))
        threads = torch.get_num_threads()
        if built.settings.threads is not None:
            torch.set_num_threads(built.settings.threads)
        model = built.make_policy()
        torch.set_num_threads(threads)
    torch.save(model.state_dict(), path)
    return time.time() - started


# =========================================================================== one run
def run_side(side: str, pipeline: Path, *, steps: int, home: Path, name: str, overrides: list[str], init: Path,
             trl_threads: int | None = None) -> dict[str, Any]:
    """Runs one side in a fresh process from ``init``; returns its figures."""
    settings = [item for o in overrides for item in ("--set", o)]
    out = home / f"{name}.json"
    if side == "ours":
        command = [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", str(pipeline), "--steps", str(steps),
                   "--home", str(home), "--run-name", name, *settings, "--set", f"init_weights={init}"]
    elif side == "trl":
        threads = ["--threads", str(trl_threads)] if trl_threads is not None else []
        command = [sys.executable, "-m", "rlhf_pipeline.bench.trl_tool_side", str(pipeline), "--init", str(init),
                   "--steps", str(steps), "--out", str(out), *threads, *settings]
    else:
        raise ValueError(f"unknown side {side!r}; choose from {SIDES}")
    started = time.time()
    # the children's output goes to stderr: stdout stays one JSON document with --json
    result = subprocess.run(command, stdout=sys.stderr, stderr=sys.stderr)
    wall = time.time() - started
    if result.returncode != 0:
        raise SystemExit(f"bench tool-use: the {side} run failed (exit code {result.returncode}); see above")
    if side == "ours":
        from rlhf_pipeline.learn.metrics import read_metrics

        rounds = ours_rounds(home / name, steps)
        learner = read_metrics(home / name / "metrics.jsonl")
        per_step = statistics.fmean(r["charts/trajectories"] for r in learner)
        first_step = learner[0]["time"] - started
    else:
        figures = json.loads(out.read_text())
        rounds = figures["rounds"]
        per_step = statistics.fmean(r["episodes"] for r in rounds)
        first_step = figures["first_step_time"] - started
    return {"wall_s": wall, "time_to_first_step_s": first_step, **round_figures(rounds),
            "episodes_per_step": per_step}


def ours_rounds(run: Path, steps: int) -> list[dict[str, float]]:
    """The collector's rounds of a finished run sampled by policies 0 .. steps-1, in order."""
    from rlhf_pipeline.learn.metrics import read_metrics

    rounds = [r for path in sorted((run / "collector").glob("metrics-*.jsonl")) for r in read_metrics(path)]
    if not rounds:
        raise SystemExit(f"bench tool-use: {run} has no collector metrics")
    rounds = [r for r in rounds if r["policy_version"] < steps]
    for r in rounds:  # every episode ends for one reason; env_done is the one with an answer
        r["episodes"] = sum(v for k, v in r.items() if k.startswith("reason/"))
        r["ended_on_call"] = r["episodes"] - r.get("reason/env_done", 0.0)
    return rounds


def round_figures(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Reward and tool-call rate of the first and last tenth of ``rounds`` (equal-sized rounds)."""
    tenth = max(1, len(rounds) // 10)
    reward = [r["reward_mean"] for r in rounds]
    calls = [r["tool_call_rate"] for r in rounds]
    return {
        "rounds": len(rounds),
        "reward_first": statistics.fmean(reward[:tenth]),
        "reward_last": statistics.fmean(reward[-tenth:]),
        "reward_mean": statistics.fmean(reward),
        "tool_call_rate_first": statistics.fmean(calls[:tenth]),
        "tool_call_rate_last": statistics.fmean(calls[-tenth:]),
        "ended_on_call": sum(r["ended_on_call"] for r in rounds) / sum(r["episodes"] for r in rounds),
    }


def summarize(side: str, runs: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """One record per side: the median of each figure over the seeds, and every run."""
    record: dict[str, Any] = {"side": side, "steps": steps, "seeds": [r["seed"] for r in runs]}
    for figure in FIGURES:
        record[figure] = statistics.median(r[figure] for r in runs)
    record["runs"] = runs
    return record


# =========================================================================== report
def format_table(records: list[dict[str, Any]]) -> str:
    by_side = {r["side"]: r for r in records}
    ours, trl = by_side["ours"], by_side["trl"]
    seeds = ours["seeds"]
    lines = [f"tool use: {ours['steps']} optimizer steps per side, seeds {seeds}"
             + (" (medians over the seeds)" if len(seeds) > 1 else ""),
             "| figure | ours | TRL | ours / TRL |", "|---|---|---|---|"]
    for figure in FIGURES:
        a, b = ours[figure], trl[figure]
        ratio = f"{a / b:.2f}x" if b else "n/a"
        lines.append(f"| {figure} | {a:.3f} | {b:.3f} | {ratio} |")
    goals = [
        ("reward_last at least TRL's", ours["reward_last"] >= trl["reward_last"]),
        ("wall_s at most TRL's", ours["wall_s"] <= trl["wall_s"]),
    ]
    lines.append("")
    lines += [f"{'met' if ok else 'NOT met'}: {goal}" for goal, ok in goals]
    return "\n".join(lines)
