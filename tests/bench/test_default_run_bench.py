"""``benchmarks/bench_default_run.py`` times the README's ``run`` command in fresh homes and says, beside
the figures, whether each run's reward rose, per seed: a real run of the command, kept short by its
settings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_each_run_starts_afresh_and_the_table_gives_its_figures_and_outcome_per_seed():
    ran = subprocess.run([sys.executable, "benchmarks/bench_default_run.py", "--repeat", "1", "--seeds", "0", "1",
                          "--set", "steps=3", "--set", "warm_start_steps=2", "--set", "prompts_per_round=2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert ran.returncode == 0, ran.stderr[-3000:]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in ran.stdout.splitlines() if line.startswith("| ")]
    assert rows[0][:4] == ["seed", "wall s", "CPU s", "steps"] and len(rows) == 3
    assert [row[0] for row in rows[1:]] == ["0", "1"]
    assert all(row[3] == "3 [3–3]" for row in rows[1:])  # each trained its 3 steps: none resumed another's home
    assert all(float(row[1].split()[0]) > 0 and float(row[2].split()[0]) > 0 for row in rows[1:])
    assert "in a fresh home" in ran.stdout and ran.stdout.splitlines()[-1].endswith("of 2 runs.")
    progress = ran.stderr.splitlines()[-2:]
    assert progress[0].startswith("run 1/2 (seed=0)") and progress[1].startswith("run 2/2 (seed=1)")
