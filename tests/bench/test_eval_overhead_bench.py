"""benchmarks/bench_eval_overhead.py at a tiny size, our loop only: one run with evaluation off and one
with it on, the on run's evaluator evaluating the versions it names, and the table with each figure's
median and quartiles and the ratio of medians (speed itself is never asserted)."""

from __future__ import annotations

import json

import pytest
from helpers import import_benchmark

pytestmark = pytest.mark.slow


def test_the_benchmark_runs_eval_off_and_on_and_prints_medians_and_ratios(tmp_path, capsys):
    bench = import_benchmark("bench_eval_overhead")
    record = tmp_path / "runs.json"
    assert bench.main(["--engines", "loop", "--repeats", "1", "--steps", "4", "--every", "2", "--skip", "1",
                       "--set", "warm_start_steps=5", "--set", "eval.max_prompts=4", "--json", str(record)]) == 0
    runs = json.loads(record.read_text())
    assert [(r["engine"], r["eval"]) for r in runs] == [("loop", False), ("loop", True)]
    assert all(r["steps"] == [1, 2, 3, 4] and len(r["step_s"]) == 4 for r in runs)
    assert runs[0]["evaluated_steps"] == [] and runs[1]["evaluated_steps"] == [0, 2, 4]
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("learner seconds per step, steps 2-4 of 1 run(s) each")
    assert [line.split(" | ")[:3] for line in printed[3:5]] == [["| loop", "off", "3"], ["| loop", "on", "3"]]
    assert printed[-1].startswith("loop: eval on / off = step_s ")
