"""Evaluation beside a real run (``run --set eval.every_steps=N``), a kill -9 of its evaluator, and
``rlhf-pipeline eval RUN`` afterwards: real processes, real stores, the default pipeline's tiny model."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import kill_when, run_child_pids

from rlhf_pipeline.coordination.weights import published_versions
from rlhf_pipeline.dataio.model_export import available_versions
from rlhf_pipeline.evaluation.evaluator import ID_STRIDE, EvalProgress, eval_metrics_path, set_store_location
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.storage import open_store

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
DEFAULT = str(REPO / "pipelines" / "default.py")
SMALL = ["--set", "warm_start_steps=5", "--set", "prompts_per_round=4", "--set", "group_size=4",
         "--set", "learner.batch_size=16", "--set", "learner.sample_window=32",
         "--set", "learner.new_rows_per_step=16", "--set", "learner.checkpoint_every=4"]
HELD_OUT = 40  # prompts of the default pipeline's held-out set


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlhf_pipeline.cli.main", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def stored(run: Path, name: str):
    """(rows, progress) of an evaluation's store."""
    store = open_store(set_store_location(run, name))
    try:
        return store.read(torch.arange(len(store))), EvalProgress.of(store)
    finally:
        store.close()


def samples_of(rows) -> Counter:
    """How often each (version, prompt, sample) is stored."""
    return Counter(zip(rows["policy_version"].tolist(), rows["trajectory_id"].tolist()))


def test_a_run_evaluates_its_versions_every_n_steps_beside_training(tmp_path):
    result = cli("run", DEFAULT, "--steps", "6", "--home", str(tmp_path), "--run-name", "r", *SMALL,
                 "--set", "eval.every_steps=2")
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    run = tmp_path / "r"
    rows, progress = stored(run, "held_out")
    assert sorted(progress.done) == [0, 2, 4, 6] and progress.failed == {}
    counts = samples_of(rows)
    assert set(counts.values()) == {1} and len(counts) == 4 * HELD_OUT  # every prompt of every version once
    assert {v for v, _ in counts} == {0, 2, 4, 6}
    lines = read_metrics(eval_metrics_path(run))
    assert [line["step"] for line in lines] == [0, 2, 4, 6]
    assert all(0.0 <= line["eval/held_out/pass@1"] <= 1.0 for line in lines)
    assert all(line["eval/held_out/prompts"] == HELD_OUT for line in lines)
    assert not any("eval/held_out/pass@1" in line for line in read_metrics(run / "metrics.jsonl"))  # the learner's
    assert "[eval] step 6 (policy version 6): held_out/pass@1" in result.stdout + result.stderr

    # asked again afterwards: what is stored is printed, not evaluated again
    again = cli("eval", str(run), "--step", "4")
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith(f"held_out step 4 (policy version 4): pass@1 {lines[2]['eval/held_out/pass@1']:.3f}")
    assert "[eval]" not in again.stdout  # nothing evaluated
    assert samples_of(stored(run, "held_out")[0]) == counts
    # other sampling is another evaluation, in a store of its own
    sampled = cli("eval", str(run), "--step", "6", "--set", "eval.samples=2", "--set", "eval.temperature=1.0",
                  "--set", "eval.max_prompts=5")
    assert sampled.returncode == 0, sampled.stderr
    assert "held_out-k2-t1-n5 step 6 (policy version 6): pass@1" in sampled.stdout and "pass@2" in sampled.stdout
    assert len(stored(run, "held_out-k2-t1-n5")[0]) == 10
    kept = list(available_versions(run))
    assert 1 not in kept  # pruned: neither wanted by the evaluator nor checkpointed
    refused = cli("eval", str(run), "--step", "1")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        f"rlhf-pipeline eval: error: --step 1: no policy of that step is kept in {run} (versions are published "
        f"every 1 steps; kept steps: {', '.join(map(str, kept))})"]


def test_kill_9_of_the_evaluator_mid_set_never_stops_training_and_eval_resumes_each_sample_once(tmp_path):
    # 4 samples of each of the 40 prompts: 160 rows a version, appended 32 at a time
    evaluation = ["--set", "eval.every_steps=2", "--set", "eval.samples=4", "--set", "eval.temperature=1.0"]
    name = "held_out-k4-t1"
    run = tmp_path / "r"
    location = set_store_location(run, name)

    def mid_first_version() -> bool:
        if not (location / "manifest.json").exists() and not location.exists():
            return False
        try:
            store = open_store(location)
        except Exception:  # made but not published yet
            return False
        try:
            return 0 < len(store) < 160
        finally:
            store.close()

    launcher = subprocess.Popen([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--steps", "8",
                                 "--home", str(tmp_path), "--run-name", "r", *SMALL, *evaluation],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = kill_when(launcher, mid_first_version, victims=lambda: run_child_pids("eval", str(tmp_path)))
    assert launcher.returncode == 0, output[-3000:]  # training went on without its evaluator
    assert "[run] the evaluator exited (exit code -9" in output, output[-3000:]
    assert "[run] done: 8 learner steps" in output
    rows, progress = stored(run, name)
    assert 0 < len(rows) < 160 * 5 and 0 not in progress.done  # killed inside version 0
    # the learner kept every version the evaluator had not done (coordination/eval_pins.py)
    assert {0, 2, 4, 6, 8} <= set(published_versions(run))

    resumed = cli("eval", str(run), *evaluation[2:])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows, progress = stored(run, name)
    counts = samples_of(rows)
    assert set(counts.values()) == {1}  # no (version, prompt, sample) twice
    kept = set(available_versions(run))
    assert {v for v, _ in counts} == kept == set(progress.done)
    for version in kept:  # none missing: every prompt's 4 samples
        first = version * ID_STRIDE * 4
        assert sorted(t for v, t in counts if v == version) == list(range(first, first + 4 * HELD_OUT))


def test_eval_on_a_pipeline_without_held_out_sets_is_refused_before_anything_is_made(tmp_path):
    result = cli("run", str(REPO / "pipelines" / "examples" / "reverse_words.py"), "--steps", "2",
                 "--home", str(tmp_path), "--set", "eval.every_steps=2")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "rlhf-pipeline run: error: the pipeline declares no held-out sets to evaluate: give its Pipeline eval_sets= "
        "(a function returning rlhf_pipeline.evaluation.sets.EvalSet objects; docs/evaluation.md), or leave "
        "eval.every_steps at 0")
    assert not (tmp_path / "reverse_words" / "weights").exists()


def test_eval_beside_a_run_at_a_url_is_refused_in_one_line(tmp_path):
    result = cli("run", DEFAULT, "--home", "s3://bucket/runs", "--set", "buffer_backend=zarr",
                 "--set", "eval.every_steps=2")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "rlhf-pipeline run: error: setting 'eval.every_steps': a run at a URL or under --ray has no evaluator beside "
        "training yet; leave it at 0 and evaluate a run directory with `rlhf-pipeline eval RUN`"]
