"""``collect`` and ``learn`` as separate processes sharing one run directory; stop and resume."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.storage import open_store

REPO = Path(__file__).resolve().parents[2]
DEFAULT = str(REPO / "pipelines" / "default.py")
SMALL = ["--set", "warm_start_steps=5", "--set", "prompts_per_round=4", "--set", "group_size=4",
         "--set", "learner.batch_size=16", "--set", "learner.sample_window=32",
         "--set", "learner.new_rows_per_step=16", "--set", "learner.checkpoint_every=2"]


def start(command: str, home: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "rlhf_pipeline.cli.main", command, DEFAULT, "--home", str(home),
         "--run-name", "shared", *SMALL, *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def finish(process: subprocess.Popen, timeout: float = 300) -> str:
    out, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, out[-3000:]
    return out


def test_collector_and_learner_processes_share_a_buffer_and_resume(tmp_path):
    run = tmp_path / "shared"
    collector = start("collect", tmp_path)
    learner = start("learn", tmp_path, "--steps", "3")
    finish(learner)
    collector_out = finish(collector)  # ends by itself: the learner wrote STOP when done
    assert "[collector] stopped after" in collector_out

    with open_store(run / "buffer", mode="r") as store:
        versions = store.read(torch.arange(len(store)))["policy_version"]
    assert int(versions.max()) >= 1  # the collector picked up weights the learner published

    # resume without a collector: offline replay over the recorded buffer, from step 3 to 5
    learner_out = finish(start("learn", tmp_path, "--steps", "5", "--set", "learner.new_rows_per_step=0",
                               "--set", "learner.max_staleness=none"))
    assert "resuming from" in learner_out and "(step 3)" in learner_out
    assert "learner settings changed" in learner_out
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4, 5]

    # settings that define the data may not change under an existing run
    other = start("learn", tmp_path, "--steps", "6", "--set", "group_size=8")
    out, _ = other.communicate(timeout=300)
    assert other.returncode == 2
    assert "group_size: was 4, now 8" in out and "--run-name" in out
