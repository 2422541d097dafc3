"""A paced run of the default pipeline with ``generation.stream_groups`` trains on the rows of the same run
without it: the same rows, policy versions, rewards and losses, step by step (a streamed round is several
appends of whole groups in request order; what reads by position sees the same buffer)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.storage import open_buffer

from test_paced_run_repeats import REPO, assert_trained_the_same, run_default, what_was_trained


@pytest.mark.slow
def test_a_streamed_run_trains_on_the_rows_of_a_whole_rounds_run(tmp_path):
    whole = run_default(tmp_path, "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    streamed = run_default(tmp_path, "streamed", "--set", "generation.stream_groups=true")
    assert streamed.returncode == 0, streamed.stderr[-3000:]
    assert_trained_the_same(what_was_trained(tmp_path / "whole"), what_was_trained(tmp_path / "streamed"))
    rounds = read_metrics(tmp_path / "streamed" / "collector" / "metrics-0000.jsonl")
    assert all(r["first_group_s"] <= r["round_s"] for r in rounds)
    assert max(r["chunks"] for r in rounds) > 1  # some rounds really went in several appends


@pytest.mark.slow
def test_a_tool_use_run_streams_groups_of_whole_trajectories(tmp_path):
    """The agent collector with ``generation.stream_groups``: rounds in several appends of whole groups."""
    small = ["warm_start_steps=20", "warm_start_check_tasks=0", "learner.batch_size=16", "learner.new_rows_per_step=16",
             "learner.sample_window=32", "log_rounds_every=1", "generation.stream_groups=true",
             "group_size=2", "tasks_per_round=8"]  # small groups: some end at their first turn
    tool_use = subprocess.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", str(REPO / "pipelines" / "tool_use.py"),
                               # 5 steps: these seeds' rounds 3 and 4 go in two appends (no round is written
                               # past the last step's batch any more, so 3 steps leave only rounds 1-2)
                               "--steps", "5", "--home", str(tmp_path), "--run-name", "agents",
                               *[arg for setting in small for arg in ("--set", setting)]], cwd=REPO,
                              capture_output=True, text=True, timeout=500)
    assert tool_use.returncode == 0, tool_use.stderr[-3000:]
    rounds = read_metrics(tmp_path / "agents" / "collector" / "metrics-0000.jsonl")
    assert rounds and all(r["rows_written"] == r["rows"] for r in rounds)
    assert max(r["chunks"] for r in rounds) > 1  # groups went to the buffer before their round ended
    with open_buffer(tmp_path / "agents" / "buffer", mode="r") as store:
        rows = store.read(torch.arange(len(store)), fields=("trajectory_id", "step"))
    ids, steps = rows["trajectory_id"].tolist(), rows["step"].tolist()
    assert ids == sorted(ids)  # in request order, each trajectory's turns together
    assert all(s == (0 if k == 0 or ids[k - 1] != t else steps[k - 1] + 1) for k, (t, s) in enumerate(zip(ids, steps)))
