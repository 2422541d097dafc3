"""Policy lag, both ends: ``python benchmarks/bench_policy_lag.py [--lags 0 1] [--seeds 0 1 2] [--steps 60] [--json PATH]``.

What ``max_lag`` costs and buys on ``pipelines/tool_use.py``: per seed, one warm start saved (the
pipeline's own, as ``bench tool-use`` makes it) and trained from once per lag, each ``run`` in a
fresh process (the lag order flipped every other seed). Per run:

* ``wall_s``: the ``run`` command, start to exit (no warm start: ``init_weights``);
* ``reward_last``: the training reward, the mean episode return of the last tenth of the rounds
  the collector sampled with policies 0 .. steps-1 (``bench tool-use``'s figure);
* ``heldout_exact``: the final policy's share of exact answers in greedy episodes on
  ``--heldout`` tasks from a seed neither the warm start, its check nor the collector draws from
  (``seed + 8_000_000``; ``evaluate_tool_use``, as the pipeline's warm-start check), and
  ``heldout_exact_start``, the warm start's on the same tasks;
* ``staleness_mean``, ``rows_dropped_stale``: how off-policy the trained rows were, and the rows
  generated and passed over for being older than ``max_lag`` allows;
* ``load``: the load average when the run started (a shared machine stretches every wall time).

Printed: one line per run, then per lag the median and range over the seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIGURES = ("wall_s", "reward_last", "heldout_exact", "heldout_exact_start", "staleness_mean", "rows_dropped_stale")
HELDOUT_SEED = 8_000_000  # the warm start draws from seed, its check from seed + 7_000_000, the collector from seed


def heldout_success(pipeline: Path, overrides: list[str], weights: dict, tasks: int) -> float:
    """The share of ``tasks`` held-out tasks a policy with ``weights`` answers exactly, greedy."""
    from rlhf_pipeline.agents.calculator import evaluate_tool_use, product_tasks
    from rlhf_pipeline.pipeline import RunPaths, load_pipeline_module, make_settings
    from rlhf_pipeline.runs.processes import build_pipeline

    module = load_pipeline_module(pipeline)
    settings = make_settings(module, overrides)
    with tempfile.TemporaryDirectory(prefix="bench-policy-lag-eval-") as scratch:
        built = build_pipeline(module, settings, RunPaths(Path(scratch)))
        model = built.make_model()
    model.load_state_dict(weights)
    held_out = product_tasks(tasks, low=settings.low, high=settings.high, seed=settings.seed + HELDOUT_SEED)
    return evaluate_tool_use(model, built.tokenizer, held_out, max_turns=settings.max_turns,
                             max_new_tokens=settings.max_new_tokens, context_length=settings.context_length)["exact"]


def one_run(pipeline: Path, *, lag: int, seed: int, steps: int, home: Path, init: Path, heldout: int,
            overrides: list[str]) -> dict:
    from rlhf_pipeline.bench.tool_use_bench import run_side
    from rlhf_pipeline.coordination.weights import load_weights
    from rlhf_pipeline.learn.metrics import read_metrics

    name = f"lag{lag}-seed{seed}"
    load = os.getloadavg()[0]
    settings = [*overrides, f"seed={seed}", f"max_lag={lag}"]
    record = run_side("ours", pipeline, steps=steps, home=home, name=name, overrides=settings, init=init)
    learner = read_metrics(home / name / "metrics.jsonl")
    state, version = load_weights(home / name)
    return {"seed": seed, "max_lag": lag, "load": load, "steps": steps, "final_version": version,
            "wall_s": record["wall_s"], "reward_last": record["reward_last"], "rounds": record["rounds"],
            "staleness_mean": statistics.fmean(r["charts/staleness_mean"] for r in learner),
            "staleness_max": max(r["charts/staleness_max"] for r in learner),
            "rows_dropped_stale": learner[-1]["charts/rows_dropped_stale_total"],
            "heldout_exact": heldout_success(pipeline, settings, state, heldout)}


def summary(runs: list[dict], lags: list[int]) -> list[str]:
    lines = ["| max_lag | " + " | ".join(FIGURES) + " |", "|---" * (len(FIGURES) + 1) + "|"]
    for lag in lags:
        cells = []
        for figure in FIGURES:
            values = [r[figure] for r in runs if r["max_lag"] == lag]
            cells.append(f"{statistics.median(values):.3g} ({min(values):.3g}-{max(values):.3g})")
        lines.append(f"| {lag} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", type=Path, default=REPO / "pipelines" / "tool_use.py")
    parser.add_argument("--lags", type=int, nargs="+", default=[0, 1], help="max_lag values (default 0 1)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=60, help="learner steps per run (default %(default)s)")
    parser.add_argument("--heldout", type=int, default=256, help="held-out tasks (default %(default)s)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a pipeline setting for every run (repeatable)")
    parser.add_argument("--json", type=Path, default=None, help="also write every run's record here")
    args = parser.parse_args(argv)
    from rlhf_pipeline.bench.tool_use_bench import initial_weights

    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-policy-lag-") as home:
        for number, seed in enumerate(args.seeds):
            init = Path(home) / f"init-seed{seed}.pt"
            seeded = [*args.overrides, f"seed={seed}"]
            print(f"[policy lag] seed {seed}: warm start (load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
            initial_weights(args.pipeline, seeded, init)
            import torch

            start = heldout_success(args.pipeline, seeded, torch.load(init, weights_only=True), args.heldout)
            for lag in (args.lags if number % 2 == 0 else args.lags[::-1]):
                record = one_run(args.pipeline, lag=lag, seed=seed, steps=args.steps, home=Path(home), init=init,
                                 heldout=args.heldout, overrides=args.overrides)
                record["heldout_exact_start"] = start
                runs.append(record)
                print(f"[policy lag] {json.dumps(record)}", file=sys.stderr, flush=True)
                if args.json is not None:
                    args.json.write_text(json.dumps(runs, indent=1))
    print(f"{args.steps} steps, seeds {args.seeds}; median (range) over the seeds")
    print("\n".join(summary(runs, args.lags)))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    from rlhf_pipeline.bench.page import script_main

    sys.exit(script_main(__file__, main, sys.argv[1:]))
