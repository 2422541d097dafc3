"""Evaluation beside a real run (``run --set eval.every_steps=N``), a kill -9 of its evaluator, and
``rlhf-pipeline eval RUN`` afterwards: real processes, real stores, the default pipeline's tiny model,
in a directory and at an ``s3://`` URL on moto (the ``run_home`` fixture; at a URL the eval stores are
Zarr stores beside the buffer). Not on ``az://``: above the object client a run at a URL is one program
for both clouds, and Azure's side of these stores (a Zarr store at an ``az://`` URL written, its writer
killed mid-append and resumed, its lease waited out) is ``tests/storage/test_object_store.py``'s."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import command_here, kill_when, run_child_pids
import preloaded

from rlhf_pipeline.coordination.eval_pins import EVAL_METRICS, EvalPins
from rlhf_pipeline.coordination.weights import published_objects, published_versions
from rlhf_pipeline.dataio.model_export import available_versions
from rlhf_pipeline.evaluation.evaluator import ID_STRIDE, EvalProgress, set_store_location
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.runs.lineage import run_store_at
from rlhf_pipeline.storage import NotAStoreError, StoreNotFoundError, open_store

pytestmark = pytest.mark.slow
AT_A_URL_ON_S3 = pytest.mark.parametrize("run_home", ["local", "s3"], indirect=True)
REPO = Path(__file__).resolve().parents[2]
DEFAULT = str(REPO / "pipelines" / "default.py")
SMALL = ["--set", "warm_start_steps=5", "--set", "prompts_per_round=4", "--set", "group_size=4",
         "--set", "learner.batch_size=16", "--set", "learner.sample_window=32",
         "--set", "learner.new_rows_per_step=16", "--set", "learner.checkpoint_every=4"]
HELD_OUT = 40  # prompts of the default pipeline's held-out set
SAMPLED_5 = ["--set", "eval.samples=2", "--set", "eval.temperature=1.0", "--set", "eval.max_prompts=5"]


def cli(*args: str, timeout: float = 300, **options) -> subprocess.CompletedProcess:
    return preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", *args], cwd=REPO,
                         capture_output=True, text=True, timeout=timeout, **options)


def logged(run: str, log: str = "metrics.jsonl") -> list[dict]:
    """The lines of the run's log ``log``, wherever the run lives."""
    return read_metrics(log, store=run_store_at(run)) if "://" in run else read_metrics(Path(run) / log)


def kept_versions(run: str) -> list[int]:
    """The policy versions a run keeps, wherever it lives: published weights and checkpoints."""
    return sorted(available_versions(run))


def stored(run: str, name: str):
    """(rows, progress) of an evaluation's store."""
    store = open_store(set_store_location(run, name))
    try:
        return store.read(torch.arange(len(store))), EvalProgress.of(store)
    finally:
        store.close()


def zarr_at_a_url(run_home: str) -> list[str]:
    """A run at a URL keeps its buffer there, in a Zarr store; short writer-lock leases, so the
    evaluator resumed after a kill -9 waits seconds, not the default 30, for its dead predecessor's."""
    return ["--set", "buffer_backend=zarr", "--set", "buffer_lock_lease_s=3"] if "://" in run_home else []


def samples_of(rows) -> Counter:
    """How often each (version, prompt, sample) is stored."""
    return Counter(zip(rows["policy_version"].tolist(), rows["trajectory_id"].tolist()))


def watching_releases(run: str, *args: str) -> tuple[subprocess.CompletedProcess, list[tuple[int, set[int]]]]:
    """``rlhf-pipeline ARGS`` (its output, stderr in stdout) and what a reader polling as keep_best's pruning
    reads saw while it ran: the versions below which the run's evaluator has released every version it wants
    (read first), and the versions whose scores were stored (read second)."""
    pins = EvalPins(run_store_at(run), every_steps=2, publish_every=1, before_training=True)
    seen = []
    with tempfile.TemporaryFile("w+") as output:
        process = preloaded.Popen([sys.executable, "-m", "rlhf_pipeline.cli.main", *args], cwd=REPO, stdout=output,
                                  stderr=subprocess.STDOUT, text=True)
        while process.poll() is None:
            released = pins.pinned_from()
            seen.append((released, {int(line["eval/policy_version"]) for line in logged(run, EVAL_METRICS)}))
            # at a URL a poll is requests that this process's S3 server serves beside the run's
            time.sleep(0.25 if "://" in run else 0.05)
        output.seek(0)
        return subprocess.CompletedProcess(args, process.returncode, output.read(), ""), seen


@AT_A_URL_ON_S3
def test_a_run_evaluates_its_versions_every_n_steps_beside_training(run_home, capsys):
    run = f"{run_home}/r"
    result, seen = watching_releases(run, "run", DEFAULT, "--steps", "6", "--home", run_home, "--run-name", "r", *SMALL,
                                     *zarr_at_a_url(run_home), "--set", "eval.every_steps=2")
    assert result.returncode == 0, result.stdout[-3000:]
    # a released version's score is stored already: keep_best's pruning takes a released version it finds no
    # score for as no candidate for the best, and prunes its checkpoint (at a URL the scores were uploaded every
    # few seconds, and a branch's best was lost so)
    assert any(released > 0 for released, _ in seen), seen
    for released, scored in seen:
        assert {v for v in (0, 2, 4, 6) if v < released} <= scored, (released, scored)
    rows, progress = stored(run, "held_out")
    assert sorted(progress.done) == [0, 2, 4, 6] and progress.failed == {}
    counts = samples_of(rows)
    assert set(counts.values()) == {1} and len(counts) == 4 * HELD_OUT  # every prompt of every version once
    assert {v for v, _ in counts} == {0, 2, 4, 6}
    lines = logged(run, "eval/metrics.jsonl")
    assert [line["step"] for line in lines] == [0, 2, 4, 6]
    assert all(0.0 <= line["eval/held_out/pass@1"] <= 1.0 for line in lines)
    assert all(line["eval/held_out/prompts"] == HELD_OUT for line in lines)
    assert not any("eval/held_out/pass@1" in line for line in logged(run))  # the learner's
    assert "[eval] step 6 (policy version 6): held_out/pass@1" in result.stdout + result.stderr
    assert "[eval] done: the learner finished and every version eval.every_steps names is evaluated" in result.stdout

    # asked again afterwards: what is stored is printed, not evaluated again
    again = command_here(capsys, "eval", run, "--step", "4")
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith(f"held_out step 4 (policy version 4): pass@1 {lines[2]['eval/held_out/pass@1']:.3f}")
    assert "[eval]" not in again.stdout  # nothing evaluated
    assert samples_of(stored(run, "held_out")[0]) == counts
    kept = kept_versions(run)
    assert 1 not in kept  # pruned: neither wanted by the evaluator nor checkpointed
    refused = command_here(capsys, "eval", run, "--step", "1")
    assert refused.returncode == 2
    where = run if "://" in run else str(Path(run).resolve())
    assert refused.stderr.strip().splitlines() == [
        f"rlhf-pipeline eval: error: --step 1: no policy of that step is kept in {where}, nor a result of it with "
        f"these eval settings (versions are published every 1 steps; kept steps: {', '.join(map(str, kept))})"]

    # a version kept only by its checkpoint (its weights pruned) is read from the checkpoint, at a URL too
    store = run_store_at(run)
    store.delete(f"weights/{published_objects(store)[4]}")
    assert 4 not in published_versions(store) and 4 in kept_versions(run)
    # other sampling is another evaluation, in a store of its own; --all-kept: every kept version (the
    # checkpoint's among them) each once. One command for all three: each CLI start imports torch again
    every = command_here(capsys, "eval", run, "--all-kept", *SAMPLED_5)
    assert every.returncode == 0, every.stderr
    assert kept_versions(run) == kept
    assert [line.split(" (policy version ")[1].split(")")[0] for line in every.stdout.splitlines()
            if line.startswith("held_out-k2-t1-n5 step ")] == [str(v) for v in kept]
    assert "held_out-k2-t1-n5 step 4 (policy version 4): pass@1" in every.stdout and "pass@2" in every.stdout
    rows, progress = stored(run, "held_out-k2-t1-n5")
    assert sorted(progress.done) == kept and set(samples_of(rows).values()) == {1}
    assert all(rows["policy_version"].tolist().count(v) == 10 for v in kept)  # 5 prompts, 2 samples each

    # stopped (here by its launcher's stop pipe, asked before it began) before it evaluated them all: what it
    # did not reach is said to be not evaluated, and how to finish; it was "failed: not evaluated"
    read_end, write_end = os.pipe()
    os.write(write_end, b"s")
    try:
        stopped = cli("eval", run, "--all-kept", "--set", "eval.samples=3", "--set", "eval.temperature=1.0",
                      "--stop-fd", str(read_end), pass_fds=(read_end,))
    finally:
        os.close(read_end)
        os.close(write_end)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    lines = [line for line in stopped.stdout.splitlines() if line.startswith("held_out-k3-t1 step ")]
    assert len(lines) == len(kept) and not any("failed" in line for line in lines), stopped.stdout
    assert lines[-1].endswith(": not evaluated; stopped before it: the same command evaluates it"), stopped.stdout

    # a step evaluated beside training whose policy is gone since (pruned by then, or deleted here: which versions
    # a run keeps past its checkpoints depends on when the evaluator let them go): its stored result is the
    # answer, not the refusal of step 1
    if 2 in published_versions(store):
        store.delete(f"weights/{published_objects(store)[2]}")
    assert 2 not in kept_versions(run)
    pruned = command_here(capsys, "eval", run, "--step", "2")
    assert pruned.returncode == 0, pruned.stderr
    evaluated = logged(run, "eval/metrics.jsonl")
    assert pruned.stdout.startswith(f"held_out step 2 (policy version 2): pass@1 "
                                    f"{evaluated[1]['eval/held_out/pass@1']:.3f}"), pruned.stdout
    assert "[eval]" not in pruned.stdout


@AT_A_URL_ON_S3
def test_kill_9_of_the_evaluator_mid_set_never_stops_training_and_eval_resumes_each_sample_once(run_home, capsys):
    # 4 samples of each of the 40 prompts: 160 rows a version, appended 32 at a time
    evaluation = ["--set", "eval.every_steps=2", "--set", "eval.samples=4", "--set", "eval.temperature=1.0"]
    name = "held_out-k4-t1"
    run = f"{run_home}/r"
    location = set_store_location(run, name)

    def mid_first_version() -> bool:
        try:
            store = open_store(location)
        except (StoreNotFoundError, NotAStoreError, OSError):  # not made, or made but not published yet
            return False
        try:
            # an append or more before version 0's last: seen at 128, the evaluator could finish the version
            # while a loaded machine takes the kill to it
            return 0 < len(store) <= 96
        finally:
            store.close()

    launcher = preloaded.Popen([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--steps", "4",
                                 "--home", run_home, "--run-name", "r", *SMALL, *zarr_at_a_url(run_home),
                                 *evaluation], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = kill_when(launcher, mid_first_version, victims=lambda: run_child_pids("eval", run_home),
                       poll_s=0.05 if "://" not in run_home else 0.2)
    assert launcher.returncode == 0, output[-3000:]  # training went on without its evaluator
    assert "[run] the evaluator ended early (was killed by SIGKILL, leaving no error of its own" in output, \
        output[-3000:]
    assert "[run] done: 4 learner steps" in output
    rows, progress = stored(run, name)
    assert 0 < len(rows) < 160 * 3 and 0 not in progress.done  # killed inside version 0
    # the learner kept every version the evaluator had not done (coordination/eval_pins.py)
    assert {0, 2, 4} <= set(published_versions(run_store_at(run)))

    resumed = command_here(capsys, "eval", run, *evaluation[2:])  # at a URL, after the killed one's writer lock lease
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows, progress = stored(run, name)
    counts = samples_of(rows)
    assert set(counts.values()) == {1}  # no (version, prompt, sample) twice
    kept = set(kept_versions(run))
    assert {v for v, _ in counts} == kept == set(progress.done)
    for version in kept:  # none missing: every prompt's 4 samples
        first = version * ID_STRIDE * 4
        assert sorted(t for v, t in counts if v == version) == list(range(first, first + 4 * HELD_OUT))


def test_eval_of_a_default_run_with_too_few_sums_to_hold_out_is_refused_naming_max_operand(tmp_path, capsys):
    """max_operand=3 gives 9 sums, and a tenth of them is none: it was refused as a pipeline that
    "declares no held-out sets", telling the user to give it eval_sets=."""
    result = command_here(capsys, "run", str(REPO / "pipelines" / "default.py"), "--steps", "2", "--home",
                          str(tmp_path), "--set", "eval.every_steps=2", "--set", "max_operand=3")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "rlhf-pipeline run: error: setting 'max_operand' (3) gives 9 sums, too few to hold a tenth of them out for "
        "eval.every_steps: raise max_operand to 4 or more, or leave eval.every_steps at 0")
    assert not any(tmp_path.iterdir())


def test_eval_on_a_pipeline_without_held_out_sets_is_refused_before_anything_is_made(tmp_path, capsys):
    result = command_here(capsys, "run", str(REPO / "pipelines" / "examples" / "reverse_words.py"), "--steps", "2",
                 "--home", str(tmp_path), "--set", "eval.every_steps=2")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "rlhf-pipeline run: error: the pipeline declares no held-out sets to evaluate: give its Pipeline eval_sets= "
        "(a function returning rlhf_pipeline.evaluation.sets.EvalSet objects; docs/evaluation.md), or leave "
        "eval.every_steps at 0")
    assert not (tmp_path / "reverse_words" / "weights").exists()


def test_eval_of_a_run_whose_pipeline_has_no_held_out_sets_names_only_what_eval_can_use(tmp_path, capsys):
    """``eval RUN`` asks for held-out sets whatever ``eval.every_steps`` is: the run's refusal's "or leave
    eval.every_steps at 0" is no way out there."""
    ran = preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run",
                         str(REPO / "pipelines" / "examples" / "reverse_words.py"), "--steps", "1", "--home",
                         str(tmp_path), "--set", "warm_start_steps=2"],
                        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    result = command_here(capsys, "eval", str(tmp_path / "reverse_words"))
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "rlhf-pipeline eval: error: the pipeline declares no held-out sets to evaluate: give its Pipeline eval_sets= "
        "(a function returning rlhf_pipeline.evaluation.sets.EvalSet objects; docs/evaluation.md)")

