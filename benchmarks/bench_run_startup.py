"""Start-up of ``run pipelines/tool_use.py`` from one or more checkouts, beside TRL's trainer,
alternating: time to the first optimizer step, wall time, and the CPU seconds of every process.

Each repeat runs every side once (the order reversed every other repeat), from the same saved
initial weights, as ``bench tool-use`` runs its sides: ``run PIPELINE --steps N --set seed=S --set
init_weights=...`` in the checkout (its own code: the command runs with the checkout as working
directory and on ``PYTHONPATH``), and with ``--trl`` this checkout's
``rlhf_pipeline.bench.trl_tool_side`` with one torch thread. CPU is user + sys of the command and
every process under it (``RUSAGE_CHILDREN``: each process is waited for by its parent). The table
gives the median of each figure over the repeats, its range, and the load average at the starts::

    python benchmarks/bench_run_startup.py --checkout main=/path/to/main --checkout new=. --trl --repeat 4

(``/path/to/main``: e.g. ``git worktree add /tmp/main main``.) ``--init`` takes saved weights; without
it they are built once with the pipeline's warm start (a minute or more), as ``bench tool-use`` does.
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


def run_once(name: str, checkout: Path | None, steps: int, seed: int, init: Path, home: Path) -> dict:
    """One run of ``name``: a checkout's ``run``, or (checkout None) TRL; its figures."""
    env = dict(os.environ)
    if checkout is None:
        command = [sys.executable, "-m", "rlhf_pipeline.bench.trl_tool_side", str(REPO / "pipelines" / "tool_use.py"),
                   "--init", str(init), "--steps", str(steps), "--out", str(home / "trl.json"), "--threads", "1",
                   "--set", f"seed={seed}"]
        cwd = REPO
    else:
        command = [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", str(checkout / "pipelines" / "tool_use.py"),
                   "--steps", str(steps), "--home", str(home), "--run-name", "r", "--set", f"seed={seed}",
                   "--set", f"init_weights={init}"]
        cwd = checkout
        env["PYTHONPATH"] = os.pathsep.join([str(checkout), *filter(None, [env.get("PYTHONPATH")])])
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = os.getloadavg()[0]
    started = time.time()
    result = subprocess.run(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            check=False)
    wall = time.time() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(f"{name} failed (exit code {result.returncode}):\n{result.stderr[-3000:]}")
    if checkout is None:
        first = json.loads((home / "trl.json").read_text())["first_step_time"]
    else:
        first = json.loads((home / "r" / "metrics.jsonl").read_text().splitlines()[0])["time"]
    return {"side": name, "wall_s": wall, "time_to_first_step_s": first - started,
            "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), "load": load}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", action="append", default=[], metavar="NAME=PATH",
                        help="a checkout to run `run` from (repeatable; default: this one, as 'this')")
    parser.add_argument("--trl", action="store_true", help="also run TRL's trainer (needs the bench-trl extra)")
    parser.add_argument("--repeat", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init", type=Path, default=None, help="saved initial weights (default: warm start once)")
    parser.add_argument("--json", action="store_true", help="print every run as JSON lines instead of the table")
    args = parser.parse_args(argv)
    sides: list[tuple[str, Path | None]] = [(c.split("=", 1)[0], Path(c.split("=", 1)[1]).resolve())
                                           for c in args.checkout] or [("this", REPO)]
    if args.trl:
        sides.append(("TRL", None))
    with tempfile.TemporaryDirectory(prefix="bench-run-startup-") as scratch:
        init = args.init
        if init is None:
            from rlhf_pipeline.bench.tool_use_bench import (
                default_pipeline,
                initial_weights,
            )

            init = Path(scratch) / "init.pt"
            initial_weights(default_pipeline(), [f"seed={args.seed}"], init)
        runs = []
        for repeat in range(args.repeat):
            for name, checkout in (sides if repeat % 2 == 0 else sides[::-1]):
                home = Path(tempfile.mkdtemp(dir=scratch))
                record = run_once(name, checkout, args.steps, args.seed, init, home)
                runs.append(record)
                print(json.dumps(record) if args.json else f"{name}: {record['time_to_first_step_s']:.2f} s to the first "
                      f"step, {record['wall_s']:.2f} s, {record['cpu_s']:.2f} CPU s, load {record['load']:.1f}",
                      file=sys.stdout if args.json else sys.stderr, flush=True)
    if args.json:
        return 0
    print(f"`python benchmarks/bench_run_startup.py {' '.join(argv)}`: {args.steps} steps, seed {args.seed}, "
          f"medians of {args.repeat} [range]")
    print("| side | `time_to_first_step_s` | `wall_s` | CPU s | load at the starts |")
    print("|---|---|---|---|---|")
    for name, _ in sides:
        mine = [r for r in runs if r["side"] == name]
        cells = []
        for key in ("time_to_first_step_s", "wall_s", "cpu_s", "load"):
            values = [r[key] for r in mine]
            cells.append(f"{min(values):.1f}–{max(values):.1f}" if key == "load" else
                         f"{statistics.median(values):.1f} [{min(values):.1f}–{max(values):.1f}]")
        print(f"| {name} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    from rlhf_pipeline.bench.page import script_main

    sys.exit(script_main(__file__, main, sys.argv[1:]))
