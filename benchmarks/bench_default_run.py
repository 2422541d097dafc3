"""The README's first command, ``rlhf-pipeline run pipelines/default.py``, timed from start to exit.

Each repeat runs the command as the README has it, in a fresh home (``--home`` a new directory,
so nothing is resumed), with this Python; ``--set`` passes settings on to every run, ``--seeds``
and ``--threads`` run it once per seed and torch thread count (``--set seed=S --set threads=T``) in
each repeat. Per run: the wall time, the CPU seconds of the command and every process under it
(``RUSAGE_CHILDREN``: each process is waited for by its parent), the load average at its start,
and the outcome the command prints, the mean training reward of the first and last tenth of the
steps: the run is the demo that the pipeline learns, and that must hold for any seed and thread
count, not for one run's figures. The table gives, per seed and thread count, the median of each
figure over the repeats and its range::

    python benchmarks/bench_default_run.py --repeat 3 --page docs/benchmarks.md
    python benchmarks/bench_default_run.py --seeds 0 1 2 --threads 1 2 --page docs/benchmarks.md

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
    from rlhf_pipeline.runs.run import reward_first_and_last

    metrics = sorted(home.glob("*/metrics.jsonl"))
    records = [json.loads(line) for line in metrics[0].read_text().splitlines()]
    _, first, last = reward_first_and_last(records)  # what the command's last line reports
    return {"wall_s": wall, "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "load": load, "steps": sum("charts/reward_mean" in record for record in records),
            "reward_first": first, "reward_last": last}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs of each seed and thread count (default 3)")
    parser.add_argument("--pipeline", type=Path, default=REPO / "pipelines" / "default.py",
                        help="the pipeline file (default: pipelines/default.py, the README's)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", dest="settings",
                        help="a setting for every run, as `run --set` takes it (repeatable)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, metavar="S",
                        help="run each of these seeds (default: the pipeline's)")
    parser.add_argument("--threads", type=int, nargs="+", default=None, metavar="T",
                        help="run with each of these torch thread counts (default: the pipeline's)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    cells = [(seed, threads) for seed in (args.seeds or [None]) for threads in (args.threads or [None])]
    runs: dict[tuple, list[dict]] = {cell: [] for cell in cells}
    total, done = args.repeat * len(cells), 0
    with tempfile.TemporaryDirectory(prefix="bench-default-run-") as scratch:
        for repeat in range(args.repeat):
            for seed, threads in cells:  # one after another, all cells in each repeat: they share its load
                extra = [*([f"seed={seed}"] if seed is not None else []),
                         *([f"threads={threads}"] if threads is not None else [])]
                done += 1
                record = run_once(args.pipeline.resolve(), [*args.settings, *extra], Path(scratch) / f"home-{done}")
                runs[(seed, threads)].append(record)
                print(f"run {done}/{total} ({' '.join(extra) or 'as set'}): {record['wall_s']:.1f} s, "
                      f"{record['cpu_s']:.1f} CPU s, load {record['load']:.1f}, reward {record['reward_first']:.3f} -> "
                      f"{record['reward_last']:.3f}", file=sys.stderr, flush=True)
    pipeline = args.pipeline.resolve()
    shown = " ".join(["run", str(pipeline.relative_to(REPO)) if pipeline.is_relative_to(REPO) else str(pipeline),
                      *(f"--set {setting}" for setting in args.settings)])
    print(f"`rlhf-pipeline {shown}`, {total} runs one after another, each in a fresh home: median [range] of "
          f"{args.repeat} per row")
    varied = [name for name, values in (("seed", args.seeds), ("threads", args.threads)) if values]
    print(f"| {''.join(name + ' | ' for name in varied)}wall s | CPU s | steps | reward, first tenth of the steps "
          f"| reward, last tenth | load at the starts |")
    print("|---" * (len(varied) + 6) + "|")
    for (seed, threads), mine in runs.items():
        row = [str(value) for value, name in ((seed, "seed"), (threads, "threads")) if name in varied]
        for key in ("wall_s", "cpu_s", "steps", "reward_first", "reward_last"):
            values = [run[key] for run in mine]
            digits = 0 if key == "steps" else 3 if key.startswith("reward") else 1
            row.append(f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}–{max(values):.{digits}f}]")
        loads = [run["load"] for run in mine]
        row.append(f"{min(loads):.1f}–{max(loads):.1f}")
        print(f"| {' | '.join(row)} |")
    every = [run for mine in runs.values() for run in mine]
    learned = sum(run["reward_last"] > run["reward_first"] for run in every)
    print(f"The mean reward rose from the first tenth of the steps to the last in {learned} of {len(every)} runs.")
    return 0


if __name__ == "__main__":
    from rlhf_pipeline.bench.page import script_main

    sys.exit(script_main(__file__, main, sys.argv[1:]))
