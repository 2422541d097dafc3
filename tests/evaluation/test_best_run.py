"""``learner.keep_best`` on real runs of the default pipeline's tiny model: the best checkpoint by a
held-out score is kept beside the newest (never pruned), shown by ``inspect``, exported by
``export-model --best`` (it loads in transformers), branched from by ``branch --from-step best`` as from
its step, refused at launch when it names no summary of the run's evaluation, and the same after a
``kill -9`` of the run mid-step and its resume as in an unbroken run. A gamed training reward and the
early best it leaves: ``test_hackable_reward.py``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import command_here, kill_when
import preloaded

from rlhf_pipeline.coordination.eval_pins import eval_scores
from rlhf_pipeline.files.run_paths import RunPaths
from rlhf_pipeline.learn.checkpoint import run_best, run_checkpoints
from rlhf_pipeline.learn.metrics import read_metrics

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
DEFAULT = str(REPO / "pipelines" / "default.py")
METRIC = "eval/held_out-k2-t1-n8/mean_score"  # two samples at temperature 1: scores differ between versions
SETTINGS = ["--set", "warm_start_steps=5", "--set", "prompts_per_round=4", "--set", "group_size=4",
            "--set", "learner.batch_size=16", "--set", "learner.sample_window=32",
            "--set", "learner.new_rows_per_step=16", "--set", "learner.checkpoint_every=100",
            "--set", "learner.keep_checkpoints=1", "--set", "eval.every_steps=2", "--set", "eval.samples=2",
            "--set", "eval.temperature=1.0", "--set", "eval.max_prompts=8", "--set", f"learner.keep_best={METRIC}"]
STEPS = 8


def command(home: Path, name: str, *extra: str, steps: int = STEPS) -> list[str]:
    return [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--steps", str(steps),
            "--home", str(home), "--run-name", name, *SETTINGS, *extra]


def expected_best(run: Path) -> tuple[int, float]:
    """(step, score) of the best candidate by the evaluator's lines: the highest, the earliest of equals."""
    scores = eval_scores(RunPaths(run).store, METRIC)
    assert sorted(scores) == [0, 2, 4, 6, 8]  # the starting policy is scored too, but has no checkpoint
    value, step = max((scores[v], -v) for v in (2, 4, 6, 8))
    return -step, value


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A run of STEPS steps keeping its best checkpoint (its directory, and what the run printed), for the
    tests to read and branch from; the kill test's reference."""
    home = tmp_path_factory.mktemp("best")
    result = preloaded.run(command(home, "unbroken"), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    return home / "unbroken", result


def test_the_best_checkpoint_is_kept_shown_exported_and_branched_from_as_its_step(unbroken, tmp_path, capsys):
    run, result = unbroken
    step, value = expected_best(run)
    best = run_best(RunPaths(run))
    assert (best.step, best.policy_version, best.metric, best.value) == (step, step, METRIC, value)
    assert run_checkpoints(RunPaths(run)).steps() == sorted({step, STEPS})  # the newest and the best, no other
    assert f"[run] best checkpoint by {METRIC}: step {step} (policy version {step})" in result.stderr

    shown = command_here(capsys, "inspect", str(run))
    assert shown.returncode == 0, shown.stderr
    assert f"best checkpoint  step {step} (policy version {step}): {METRIC} {value:.4g}" in shown.stdout
    assert json.loads(command_here(capsys, "inspect", str(run), "--json").stdout)["run"]["best"]["step"] == step

    exported = command_here(capsys, "export-model", str(run), str(tmp_path / "best"), "--best")
    assert exported.returncode == 0, exported.stderr
    assert f"policy version {step} " in exported.stdout and f"the best checkpoint, step {step}" in exported.stdout
    numbered = command_here(capsys, "export-model", str(run), str(tmp_path / "numbered"), "--version", str(step))
    assert numbered.returncode == 0
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "best")
    numbered = load_file(tmp_path / "numbered" / "model.safetensors")
    assert numbered and all(tensor.equal(numbered[name]) for name, tensor in model.state_dict().items()
                            if name in numbered)

    # the best scored again with more samples (its first score was two samples' at temperature 1)
    rescored = command_here(capsys, "eval", str(run), "--step", "best", "--set", "eval.samples=4")
    assert rescored.returncode == 0, rescored.stderr
    assert rescored.stdout.startswith(f"the best checkpoint, step {step} (policy version {step}): {METRIC} ")
    assert f"held_out-k2-t1-n8 step {step} (policy version {step}): " not in rescored.stdout  # a new evaluation's
    assert f"held_out-k4-t1-n8 step {step} (policy version {step}): pass@1 " in rescored.stdout, rescored.stdout
    assert sorted(eval_scores(RunPaths(run).store, METRIC.replace("k2", "k4"))) == [step]

    # branches are made beside their parent (the kill test reads the parent only: branching leaves it as it was)
    home = run.parent
    assert command_here(capsys, "branch", str(run), "--from-step", "best", "from-best").returncode == 0
    assert command_here(capsys, "branch", str(run), "--from-step", str(step), "from-step").returncode == 0
    lineages = [json.loads((home / name / "branch.json").read_text()) for name in ("from-best", "from-step")]
    for lineage in lineages:
        lineage.pop("created")
    assert lineages[0]["step"] == step and lineages[0] == lineages[1]
    checkpoint = f"checkpoints/step_{step:08d}.pt"
    assert (home / "from-best" / checkpoint).read_bytes() == (home / "from-step" / checkpoint).read_bytes()
    assert sorted(os.listdir(home / "from-best")) == sorted(os.listdir(home / "from-step"))
    # the branch keeps its own best, from its own evaluations: none yet
    refused = command_here(capsys, "export-model", str(home / "from-best"), str(tmp_path / "none"), "--best")
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "has no best checkpoint yet" in refused.stderr
    refused = command_here(capsys, "eval", str(home / "from-best"), "--step", "best")
    assert refused.returncode == 2 and "has no best checkpoint yet" in refused.stderr, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and not refused.stdout
    # continued online, it evaluates from its branch point on: the versions below are the parent's, scored in
    # the parent's eval store (version 0 too, which eval.before_training scored there)
    continued = preloaded.run(command(home, "from-best", steps=step + 2), cwd=REPO, capture_output=True, text=True,
                              timeout=600)
    assert continued.returncode == 0, continued.stderr[-3000:] + continued.stdout[-3000:]
    branch_scores = eval_scores(RunPaths(home / "from-best").store, METRIC)
    assert sorted(branch_scores) == [step, step + 2]
    assert branch_scores[step] == value  # the parent's policy at the branch point, sampled with the same seeds
    assert run_best(RunPaths(home / "from-best")).step in (step, step + 2)


def test_a_kill_9_mid_step_resumes_to_the_best_of_an_unbroken_run(unbroken, tmp_path):
    metrics = tmp_path / "killed" / "metrics.jsonl"
    first = preloaded.Popen(command(tmp_path, "killed"), cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    # after the checkpoint of step 4 (a candidate), inside a later step: learner, collector and evaluator at once
    kill_when(first, lambda: metrics.is_file() and metrics.read_text().count("\n") >= 5, whole_group=True,
              poll_s=0.01, wait_s=60)
    assert first.returncode == -signal.SIGKILL
    assert len(read_metrics(metrics)) < STEPS, "the kill came after the run had finished; nothing was resumed"
    resumed = preloaded.run(command(tmp_path, "killed"), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout + resumed.stderr
    killed, reference = tmp_path / "killed", unbroken[0]
    assert eval_scores(RunPaths(killed).store, METRIC) == eval_scores(RunPaths(reference).store, METRIC)
    best, expected = run_best(RunPaths(killed)), run_best(RunPaths(reference))
    assert (best.step, best.value) == (expected.step, expected.value) == expected_best(reference)
    assert run_checkpoints(RunPaths(killed)).steps() == run_checkpoints(RunPaths(reference)).steps()


def test_keep_best_naming_no_summary_of_the_runs_evaluation_is_refused_at_launch_in_one_line(tmp_path, capsys):
    wrong = command_here(capsys, "run", DEFAULT, "--home", str(tmp_path), "--set", "eval.every_steps=2",
                "--set", "learner.keep_best=eval/held_out/pass@4")
    assert wrong.returncode == 2
    assert wrong.stderr.strip().splitlines() == [
        "rlhf-pipeline run: error: setting 'learner.keep_best' must be one of ['eval/held_out/pass@1', "
        "'eval/held_out/mean_score'] (the summaries of this run's evaluations), got 'eval/held_out/pass@4'"]
    off = command_here(capsys, "run", DEFAULT, "--home", str(tmp_path),
                       "--set", "learner.keep_best=eval/held_out/pass@1")
    assert off.returncode == 2
    assert off.stderr.strip().splitlines() == [
        "rlhf-pipeline run: error: setting 'learner.keep_best' (eval/held_out/pass@1) ranks checkpoints by the "
        "evaluation beside training, which is off (eval.every_steps=0): add --set eval.every_steps=N, or leave "
        "learner.keep_best at none"]
    assert not (tmp_path / "default" / "weights").exists()
