"""Two paced runs of the default pipeline with one seed train on the same rows, one under load.

Which weights a collector round uses is fixed by pacing (``rlhf_pipeline/coordination/pacing.py``), not by
whether the learner published its next version before the round began, so nothing that depends
on timing reaches the numbers: the same rewards, losses and policy versions, step by step.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.storage import open_buffer

REPO = Path(__file__).resolve().parents[2]
DEFAULT = str(REPO / "pipelines" / "default.py")
STEPS = 30
# the default pipeline's pacing (one round per step: new_rows_per_step = a round's rows) at a quarter of
# its rows and a short warm start: as many pacing decisions, each racing a quicker learner
SMALL = ["--set", "warm_start_steps=5", "--set", "prompts_per_round=4", "--set", "group_size=4",
         "--set", "learner.batch_size=16", "--set", "learner.sample_window=32",
         "--set", "learner.new_rows_per_step=16"]
TIMING = ("time", "tokens_per_s", "_s")  # metrics that measure time, not what was trained


def run_default(home: Path, name: str, *settings: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--steps", str(STEPS),
                           "--home", str(home), "--run-name", name, *SMALL, *settings], cwd=REPO, capture_output=True,
                          text=True, timeout=900)


def what_was_trained(run: Path) -> dict:
    learner = [{k: v for k, v in r.items() if not k.endswith(TIMING)} for r in read_metrics(run / "metrics.jsonl")]
    with open_buffer(run / "buffer", mode="r") as store:
        rows = store.read(torch.arange(len(store)), fields=("policy_version", "reward", "response_tokens"))
    return {"learner": learner, "row_versions": rows["policy_version"].tolist(),
            "row_rewards": rows["reward"].tolist(), "row_tokens": [t.tolist() for t in rows["response_tokens"].to_list()]}


def assert_trained_the_same(first: dict, second: dict) -> None:
    """Two runs' :func:`what_was_trained`: the same rows (versions, rewards, tokens), step for step the same metrics."""
    assert len(first["learner"]) == STEPS
    assert first["row_versions"] == second["row_versions"]
    assert first["row_rewards"] == second["row_rewards"] and first["row_tokens"] == second["row_tokens"]
    for step, (a, b) in enumerate(zip(first["learner"], second["learner"], strict=True), start=1):
        assert a == b, f"step {step}: {sorted(set(a.items()) ^ set(b.items()))}"


@pytest.mark.slow
def test_two_paced_runs_with_one_seed_train_on_the_same_rows(tmp_path):
    first = run_default(tmp_path, "quiet")
    assert first.returncode == 0, first.stderr[-3000:]
    # the second run shares the CPU with a busy loop per core, to shift every wait and publish
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        second = run_default(tmp_path, "loaded")
    finally:
        for process in busy:
            process.kill()
            process.wait()
    assert second.returncode == 0, second.stderr[-3000:]
    assert_trained_the_same(what_was_trained(tmp_path / "quiet"), what_was_trained(tmp_path / "loaded"))
