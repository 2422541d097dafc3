"""A paced run of the default pipeline with ``generation.stream_groups`` trains on the rows of the same run
without it: the same rows, policy versions, rewards and losses, step by step (a streamed round is several
appends of whole groups in request order; what reads by position sees the same buffer)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlhf_pipeline.learn.metrics import read_metrics

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


def test_stream_groups_is_refused_by_name_where_nothing_streams(tmp_path):
    tool_use = subprocess.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", str(REPO / "pipelines" / "tool_use.py"),
                               "--home", str(tmp_path), "--set", "generation.stream_groups=true"], cwd=REPO,
                              capture_output=True, text=True, timeout=300)
    assert tool_use.returncode != 0
    assert "'generation.stream_groups' is on, but this pipeline's collector writes whole rounds" in tool_use.stderr
