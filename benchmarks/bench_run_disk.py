"""The disk a whole run takes as it goes, by part, from one or more checkouts, alternating.

    python benchmarks/bench_run_disk.py --checkout before=/tmp/older --checkout after=. --repeat 2

Each repeat runs every checkout's ``run pipelines/default.py`` once (the order reversed every other
repeat) in a fresh home, and looks at the run directory every ``--every-s`` seconds while it runs:
the bytes of its weights (``weights/`` and any weights a collector's position history keeps), of
its buffer, of its checkpoints and of all of it, each file counted once however many hard links it
has (a history's links to ``weights/`` cost nothing until the learner prunes the file). The table
gives the peak and the end of each, and the weights versions held, as medians over the repeats with
their range. A checkout runs its own code: the command runs with it as working directory and on
``PYTHONPATH``. ``--set`` items go to every run (e.g. ``learner.checkpoint_every=100``).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_WEIGHTS = re.compile(r"^policy_(\d{8})")
PARTS = ("weights", "buffer", "checkpoints", "run")


def measure(run_dir: Path) -> dict[str, float]:
    """Bytes by part (each inode once) and the weights versions held, as the run directory is now."""
    seen: set[int] = set()
    sizes = dict.fromkeys(PARTS, 0)
    versions: set[int] = set()
    for root, _, files in os.walk(run_dir):
        top = Path(root).relative_to(run_dir).parts[:1]
        for name in files:
            try:
                info = os.lstat(os.path.join(root, name))
            except FileNotFoundError:  # pruned while we looked
                continue
            first = info.st_ino not in seen
            seen.add(info.st_ino)
            if not first:
                continue
            sizes["run"] += info.st_size
            if match := _WEIGHTS.match(name):
                versions.add(int(match.group(1)))
                sizes["weights"] += info.st_size
            elif top and top[0] in ("buffer", "checkpoints"):
                sizes[top[0]] += info.st_size
    return {**sizes, "versions": len(versions)}


def run_once(checkout: Path, overrides: list[str], every_s: float, scratch: Path, steps: int | None = None) -> dict:
    home = Path(tempfile.mkdtemp(dir=scratch))
    command = [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", "pipelines/default.py", "--home", str(home),
               "--run-name", "r", *(["--steps", str(steps)] if steps else []),
               *(word for item in overrides for word in ("--set", item))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(checkout), *filter(None, [os.environ.get("PYTHONPATH")])])}
    peaks = dict.fromkeys([*PARTS, "versions"], 0.0)
    done = threading.Event()

    def watch() -> None:
        while not done.wait(every_s):
            if (home / "r").is_dir():
                for key, value in measure(home / "r").items():
                    peaks[key] = max(peaks[key], value)

    watcher = threading.Thread(target=watch, daemon=True)
    load, started = os.getloadavg()[0], time.time()
    watcher.start()
    result = subprocess.run(command, cwd=checkout, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, check=False)
    done.set()
    watcher.join()
    if result.returncode != 0:
        raise SystemExit(f"the run from {checkout} failed (exit code {result.returncode}):\n{result.stderr[-3000:]}")
    end = measure(home / "r")
    peaks = {key: max(value, end[key]) for key, value in peaks.items()}
    return {"peak": peaks, "end": end, "wall_s": time.time() - started, "load": load}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", action="append", default=[], metavar="NAME=PATH",
                        help="a checkout to run `run` from (repeatable; default: this one, as 'this')")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None, help="learner steps (default: the pipeline's, 300)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--every-s", type=float, default=0.5, help="how often the run directory is looked at")
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.every_s <= 0:
        parser.error("--repeat must be >= 1 and --every-s > 0")
    sides = [(c.split("=", 1)[0], Path(c.split("=", 1)[1]).resolve()) for c in args.checkout] or [("this", REPO)]
    runs: dict[str, list[dict]] = {name: [] for name, _ in sides}
    with tempfile.TemporaryDirectory(prefix="bench-run-disk-") as scratch:
        for repeat in range(args.repeat):
            for name, checkout in (sides if repeat % 2 == 0 else sides[::-1]):
                record = run_once(checkout, args.overrides, args.every_s, Path(scratch), args.steps)
                runs[name].append(record)
                print(f"[bench run-disk] {name} {repeat + 1}/{args.repeat}: weights peak "
                      f"{record['peak']['weights'] / 2**20:.1f} MiB ({record['peak']['versions']:.0f} versions), "
                      f"{record['wall_s']:.0f} s, load {record['load']:.1f}", file=sys.stderr, flush=True)

    def cell(values: list[float], scale: float = 2**20, digits: int = 1) -> str:
        values = [v / scale for v in values]
        return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"

    given = " ".join([*([f"--steps {args.steps}"] if args.steps else []), *(f"--set {item}" for item in args.overrides)])
    print(f"`run pipelines/default.py {given}`".replace(" `", "`") + f": MiB on disk (each file once), medians of "
          f"{args.repeat} runs [range], sampled every {args.every_s} s")
    print(f"| | {' | '.join(name for name, _ in sides)} |")
    print(f"|---|{'---|' * len(sides)}")
    for when in ("peak", "end"):
        for part in PARTS:
            print(f"| {part}, {when} | {' | '.join(cell([r[when][part] for r in runs[name]]) for name, _ in sides)} |")
        print(f"| weights versions held, {when} | "
              f"{' | '.join(cell([r[when]['versions'] for r in runs[name]], 1, 0) for name, _ in sides)} |")
    print(f"| wall s | {' | '.join(cell([r['wall_s'] for r in runs[name]], 1, 0) for name, _ in sides)} |")
    print(f"| load at the starts | {' | '.join(cell([r['load'] for r in runs[name]], 1) for name, _ in sides)} |")
    if len(sides) > 1:
        base = statistics.median(r["peak"]["weights"] for r in runs[sides[0][0]])
        print(f"\npeak weights against {sides[0][0]}: " + ", ".join(
            f"{name} {statistics.median(r['peak']['weights'] for r in runs[name]) / base:.2f}x" for name, _ in sides[1:]))
    return 0


if __name__ == "__main__":
    from rlhf_pipeline.bench.page import script_main

    sys.exit(script_main(__file__, main, sys.argv[1:]))
