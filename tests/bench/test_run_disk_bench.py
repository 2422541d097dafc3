"""benchmarks/bench_run_disk.py: a file with several hard links counts once, and a short run's parts and
weights versions are measured while it runs and at its end."""

from __future__ import annotations

import os
from pathlib import Path

from helpers import import_benchmark

REPO = Path(__file__).resolve().parents[2]


def test_a_hard_linked_file_counts_once_and_weights_are_told_by_name(tmp_path):
    bench = import_benchmark("bench_run_disk")
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "policy_00000003.safetensors").write_bytes(b"w" * 100)
    (tmp_path / "collector" / "shard-0000.history").mkdir(parents=True)
    os.link(tmp_path / "weights" / "policy_00000003.safetensors",
            tmp_path / "collector" / "shard-0000.history" / "policy_00000003")
    (tmp_path / "collector" / "shard-0000.history" / "policy_00000002").write_bytes(b"v" * 10)
    (tmp_path / "buffer").mkdir()
    (tmp_path / "buffer" / "rows").write_bytes(b"r" * 7)
    assert bench.measure(tmp_path) == {"weights": 110, "buffer": 7, "checkpoints": 0, "run": 117, "versions": 2}


def test_a_short_run_is_measured_while_it_runs_and_at_its_end(tmp_path):
    bench = import_benchmark("bench_run_disk")
    record = bench.run_once(REPO, ["learner.checkpoint_every=2", "warm_start_steps=5"], 0.2, tmp_path, steps=4)
    end, peak = record["end"], record["peak"]
    assert end["versions"] >= 3 and end["weights"] > 0 and end["buffer"] > 0 and end["checkpoints"] > 0
    assert end["run"] >= end["weights"] + end["buffer"] + end["checkpoints"]
    assert all(peak[part] >= end[part] for part in end)
