"""Two paced runs of the default pipeline with one seed train on the same rows, one of them with its
learner and collector paused at random moments.

Which weights a collector round uses is fixed by pacing (``rlhf_pipeline/coordination/pacing.py``), not by
whether the learner published its next version before the round began, so nothing that depends
on timing reaches the numbers: the same rewards, losses and policy versions, step by step.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from helpers import run_child_pids
import preloaded

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


def run_default(home: Path, name: str) -> list[str]:
    return [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--steps", str(STEPS), "--home", str(home),
            "--run-name", name, *SMALL]


def pause_at_random(home: Path, name: str, done: threading.Event) -> int:
    """Until ``done``: the run's learner or collector, picked at random, stopped (SIGSTOP) for up to
    50 ms at random moments, so that each wait and publish of one process shifts against the other's
    (two busy loops did this once, burning both cores for the whole run). Returns how many pauses landed."""
    rng, paused, pids = random.Random(7), 0, {}
    while not done.wait(rng.uniform(0.005, 0.05)):
        role = rng.choice(("learn", "collect"))
        if role not in pids:  # looked up until found: the children start after the launcher
            pids.update({role: found[0] for found in [run_child_pids(role, str(home), name)] if found})
            continue
        try:
            os.kill(pids[role], signal.SIGSTOP)
        except ProcessLookupError:
            # gone: the run is ending, or what was found was a short-lived process forked from that
            # child (it carries the child's name); looked up again until ``done``
            del pids[role]
            continue
        try:
            done.wait(rng.uniform(0.001, 0.05))
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids[role], signal.SIGCONT)
        paused += 1
    return paused


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
    first = preloaded.run(run_default(tmp_path, "quiet"), cwd=REPO, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    loaded = preloaded.Popen(run_default(tmp_path, "paused"), cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    done, pauses = threading.Event(), []
    pausing = threading.Thread(target=lambda: pauses.append(pause_at_random(tmp_path, "paused", done)))
    pausing.start()
    try:
        err = loaded.communicate(timeout=900)[1]
    finally:
        done.set()
        pausing.join()
        if loaded.poll() is None:
            loaded.kill()
    assert loaded.returncode == 0, err[-3000:]
    assert pauses[0] > 0  # the run was paused on its way
    assert_trained_the_same(what_was_trained(tmp_path / "quiet"), what_was_trained(tmp_path / "paused"))
