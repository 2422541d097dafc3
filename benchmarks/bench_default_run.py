"""The README's first command, ``rlhf-pipeline run pipelines/default.py``, timed from start to exit.

Each repeat runs the command as the README has it, in a fresh home (``--home`` a new directory,
so nothing is resumed), with this Python; ``--set`` passes settings on to every repeat. Per run:
the wall time, the CPU seconds of the command and every process under it (``RUSAGE_CHILDREN``:
each process is waited for by its parent), the load average at its start, and the outcome the
command prints, the mean training reward of the first and last tenth of the steps: the run is
the demo that the pipeline learns, so its figures come with whether it did. The table gives the
median of each figure over the repeats and its range::

    python benchmarks/bench_default_run.py --repeat 3 --page docs/benchmarks.md

The README's figure is for a fresh clone with only the base install; a checkout with more extras
installed imports more at each start (docs/benchmarks.md, "The default run").
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_once(pipeline: Path, settings: list[str], home: Path) -> dict:
    """One run of the command in ``home``: its figures, or SystemExit with its error."""
    command = [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", str(pipeline), "--home", str(home),
               *(word for setting in settings for word in ("--set", setting))]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = os.getloadavg()[0]
    started = time.time()
    result = subprocess.run(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            check=False)
    wall = time.time() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(f"the run failed (exit code {result.returncode}):\n{result.stderr[-3000:]}")
    metrics = sorted(home.glob("*/metrics.jsonl"))
    rewards = [record["charts/reward_mean"] for record in map(json.loads, metrics[0].read_text().splitlines())
               if "charts/reward_mean" in record]
    tenth = max(1, len(rewards) // 10)
    return {"wall_s": wall, "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "load": load, "steps": len(rewards), "reward_first": statistics.fmean(rewards[:tenth]),
            "reward_last": statistics.fmean(rewards[-tenth:])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs, one after another (default 3)")
    parser.add_argument("--pipeline", type=Path, default=REPO / "pipelines" / "default.py",
                        help="the pipeline file (default: pipelines/default.py, the README's)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", dest="settings",
                        help="a setting for every run, as `run --set` takes it (repeatable)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-default-run-") as scratch:
        for repeat in range(args.repeat):
            record = run_once(args.pipeline.resolve(), args.settings, Path(scratch) / f"home-{repeat}")
            runs.append(record)
            print(f"run {repeat + 1}/{args.repeat}: {record['wall_s']:.1f} s, {record['cpu_s']:.1f} CPU s, load "
                  f"{record['load']:.1f}, reward {record['reward_first']:.3f} -> {record['reward_last']:.3f}",
                  file=sys.stderr, flush=True)
    shown = " ".join(["run", str(args.pipeline.resolve().relative_to(REPO)) if args.pipeline.resolve().is_relative_to(REPO)
                      else str(args.pipeline), *(f"--set {setting}" for setting in args.settings)])
    print(f"`rlhf-pipeline {shown}`, {args.repeat} runs one after another, each in a fresh home: "
          f"median [range]")
    print("| wall s | CPU s | steps | reward, first tenth of the steps | reward, last tenth | load at the starts |")
    print("|---|---|---|---|---|---|")
    cells = []
    for key in ("wall_s", "cpu_s", "steps", "reward_first", "reward_last"):
        values = [run[key] for run in runs]
        digits = 0 if key == "steps" else 3 if key.startswith("reward") else 1
        cells.append(f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}–{max(values):.{digits}f}]")
    loads = [run["load"] for run in runs]
    print(f"| {' | '.join(cells)} | {min(loads):.1f}–{max(loads):.1f} |")
    learned = sum(run["reward_last"] > run["reward_first"] for run in runs)
    print(f"The mean reward rose from the first tenth of the steps to the last in {learned} of {len(runs)} runs.")
    return 0


if __name__ == "__main__":
    from rlhf_pipeline.bench.page import script_main

    sys.exit(script_main(__file__, main, sys.argv[1:]))
