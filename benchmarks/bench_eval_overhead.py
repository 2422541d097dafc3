"""What evaluation beside training costs the learner: ``python benchmarks/bench_eval_overhead.py
[--engines loop vllm] [--repeats 2] [--steps 40] [--every 10] [--json PATH]``.

Per engine (``loop``: our sampling loop; ``vllm``: ``generation.engine=vllm``, the collector's own vLLM
server, and then the evaluator's own too), the same ``rlhf-pipeline run pipelines/default.py`` with
evaluation off and on (``eval.every_steps``), each run in a fresh process and home, the order of off and
on flipped every other repeat so that a machine's drift falls on both. Per run, from the learner's
``metrics.jsonl`` (every step logged, the first ``--skip`` left out: start-up):

* ``step_s``: ``charts/step_time_s``, the learner's own time per step (draw, forward, backward, publish);
* ``wait_s``: ``charts/data_wait_s``, what it waited for rows (the collectors' share of the machine);
* ``total_s``: the two together, what a step costs the run;
* ``load``: the load average when the run started (a shared machine stretches every time).

Printed: per (engine, eval) the median and interquartile range over every step of every repeat, and
per engine the ratio of the medians, eval on over eval off. Speed is measured here, never asserted.
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

REPO = Path(__file__).resolve().parents[1]
FIGURES = ("step_s", "wait_s", "total_s")
ENGINE_SETTINGS = {"loop": [], "vllm": ["generation.engine=vllm"]}
# vLLM's CPU attention takes head sizes of 32 and up: both engines train the same 2-head model
COMMON = ["num_heads=2", "learner.log_every=1"]


def one_run(engine: str, evaluate: bool, *, steps: int, every: int, home: Path, name: str,
            overrides: list[str]) -> dict:
    """One ``run`` and its learner's per-step figures."""
    from rlhf_pipeline.learn.metrics import read_metrics

    settings = [*COMMON, *ENGINE_SETTINGS[engine], *overrides, *([f"eval.every_steps={every}"] if evaluate else [])]
    load = os.getloadavg()[0]
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", str(REPO / "pipelines" / "default.py"),
                           "--steps", str(steps), "--home", str(home), "--run-name", name,
                           *[a for s in settings for a in ("--set", s)]],
                          cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"[eval overhead] {engine} eval={'on' if evaluate else 'off'} failed "
                         f"(exit code {done.returncode}):\n{done.stderr[-3000:]}")
    records = read_metrics(home / name / "metrics.jsonl")
    evaluated = read_metrics(home / name / "eval" / "metrics.jsonl") if evaluate else []
    return {"engine": engine, "eval": evaluate, "load": load, "wall_s": time.perf_counter() - started,
            "steps": [r["step"] for r in records],
            "step_s": [r["charts/step_time_s"] for r in records],
            "wait_s": [r["charts/data_wait_s"] for r in records],
            "total_s": [r["charts/step_time_s"] + r["charts/data_wait_s"] for r in records],
            "evaluated_steps": [r["step"] for r in evaluated]}


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, first quartile, third quartile)."""
    if len(values) < 2:
        return (values[0],) * 3 if values else (float("nan"),) * 3
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return median, q1, q3


def summary(runs: list[dict], skip: int) -> list[str]:
    """The table: per (engine, eval) each figure's median [IQR] over the steps after ``skip``, then the
    ratio of medians on / off per engine."""
    def figures(engine: str, evaluate: bool) -> dict[str, list[float]]:
        chosen = [r for r in runs if r["engine"] == engine and r["eval"] == evaluate]
        return {f: [v for r in chosen for s, v in zip(r["steps"], r[f]) if s > skip] for f in FIGURES}

    lines = ["| engine | eval | steps | " + " | ".join(f"{f} median [IQR]" for f in FIGURES) + " | load |",
             "|---" * (len(FIGURES) + 4) + "|"]
    ratios = []
    for engine in dict.fromkeys(r["engine"] for r in runs):
        medians = {}
        for evaluate in (False, True):
            values = figures(engine, evaluate)
            loads = [r["load"] for r in runs if r["engine"] == engine and r["eval"] == evaluate]
            if not loads:
                continue
            cells = []
            for figure in FIGURES:
                median, q1, q3 = spread(values[figure])
                medians[(evaluate, figure)] = median
                cells.append(f"{median:.3f} [{q1:.3f}-{q3:.3f}]")
            lines.append(f"| {engine} | {'on' if evaluate else 'off'} | {len(values['step_s'])} | " + " | ".join(cells)
                         + f" | {min(loads):.1f}-{max(loads):.1f} |")
        if all((e, f) in medians for e in (False, True) for f in FIGURES):
            ratios.append(f"{engine}: eval on / off = " + ", ".join(
                f"{f} {medians[(True, f)] / max(medians[(False, f)], 1e-9):.2f}" for f in FIGURES))
    return [*lines, "", *ratios]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", nargs="+", choices=sorted(ENGINE_SETTINGS), default=["loop", "vllm"])
    parser.add_argument("--repeats", type=int, default=2, help="runs of each (engine, eval) (default %(default)s)")
    parser.add_argument("--steps", type=int, default=40, help="learner steps per run (default %(default)s)")
    parser.add_argument("--every", type=int, default=10, help="eval.every_steps when on (default %(default)s)")
    parser.add_argument("--skip", type=int, default=2, help="first steps left out: start-up (default %(default)s)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a pipeline setting for every run (repeatable)")
    parser.add_argument("--json", type=Path, default=None, help="also write every run's record here")
    args = parser.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-eval-overhead-") as home:
        for repeat in range(args.repeats):
            for engine in args.engines:
                for evaluate in ((False, True) if repeat % 2 == 0 else (True, False)):
                    name = f"{engine}-{'on' if evaluate else 'off'}-{repeat}"
                    print(f"[eval overhead] {name} (load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
                    runs.append(one_run(engine, evaluate, steps=args.steps, every=args.every, home=Path(home),
                                        name=name, overrides=args.overrides))
                    if args.json is not None:
                        args.json.write_text(json.dumps(runs, indent=1))
    print(f"learner seconds per step, steps {args.skip + 1}-{args.steps} of {args.repeats} run(s) each; "
          f"eval.every_steps={args.every} when on")
    print("\n".join(summary(runs, args.skip)))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    from rlhf_pipeline.bench.page import script_main

    sys.exit(script_main(__file__, main, sys.argv[1:]))
