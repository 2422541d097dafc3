"""``benchmarks/bench_open_segment_reads.py --baseline-rev REV`` times this checkout's memmap reader beside
REV's package, each in a worker process of the same script: real runs, small."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "benchmarks/bench_open_segment_reads.py"


def test_the_table_has_both_sides_and_their_ratios():
    ran = subprocess.run([sys.executable, SCRIPT, "--baseline-rev", "HEAD", "--runs", "1", "--rounds", "4"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in ran.stdout.splitlines() if line.startswith("| ")}
    assert "baseline HEAD" in rows["what"]
    assert all(rows[what].count("x,") == 1 for what in ("append", "follow", "sample"))


def test_the_worker_runs_on_a_package_older_than_the_benchmarks_page(tmp_path):
    """A baseline revision's package may predate ``bench/page.py``, which the script imports to take
    ``--page``: its worker must not need it (it did, once, and every baseline run failed)."""
    shutil.copytree(ROOT / "rlhf_pipeline", tmp_path / "rlhf_pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "rlhf_pipeline" / "bench" / "page.py").unlink()
    ran = subprocess.run([sys.executable, str(ROOT / SCRIPT), "--worker", "--rounds", "4", "--round-rows", "16",
                          "--samples", "1", "--seed", "0"],
                         cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(tmp_path)), capture_output=True, text=True,
                         timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    timings = json.loads(ran.stdout.splitlines()[-1])
    assert {"append", "follow", "sample"} <= set(timings) and len(timings["append"]) == 4
