"""``benchmarks/bench_default_run.py`` times the README's ``run`` command in fresh homes and says, beside
the figures, whether each run's reward rose: a real run of the command, kept short by its settings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_each_repeat_runs_the_command_afresh_and_the_table_gives_its_figures_and_outcome():
    ran = subprocess.run([sys.executable, "benchmarks/bench_default_run.py", "--repeat", "2", "--set", "steps=3",
                          "--set", "warm_start_steps=2", "--set", "prompts_per_round=2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert ran.returncode == 0, ran.stderr[-3000:]
    rows = [line for line in ran.stdout.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| wall s | CPU s | steps |") and len(rows) == 2
    cells = [cell.strip() for cell in rows[1].strip("|").split("|")]
    assert cells[2] == "3 [3–3]"  # both runs trained their 3 steps: neither resumed the other's home
    wall, cpu = (float(cell.split()[0]) for cell in cells[:2])
    assert wall > 0 and cpu > 0
    assert "in a fresh home" in ran.stdout and "runs." in ran.stdout.splitlines()[-1]
    assert ran.stdout.splitlines()[-1].endswith("of 2 runs.")
    assert [line.startswith(f"run {k}/2: ") for k, line in enumerate(ran.stderr.splitlines()[-2:], 1)] == [True] * 2
