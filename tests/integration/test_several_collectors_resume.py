"""A learner killed beside several collectors trains its steps past the checkpoint again on the rows
it trained before the kill: the same metrics and, under the same version numbers, the same weights.

Which rows of each shard a block of the ``exact`` sampler takes is what the shards held when the
learner drew it (timing), so after a kill it is not drawn again from the shards: it is read back from
the record of the draws taken in since the checkpoint, in ``pacing.json``
(docs/learner.md#resume-beside-several-collectors). Unlike two runs of one collector, two runs of
several differ, so the steps taken again are compared with the killed learner's own. One collector's
kills: tests/integration/test_resume_at_every_distance.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import kill_when, run_child_pids
import preloaded
from integration.run_location import logged, trained

from rlhf_pipeline.coordination.pacing import read_intake
from rlhf_pipeline.coordination.weights import load_weights, published_versions
from rlhf_pipeline.files.run_paths import RunPaths
from rlhf_pipeline.learn.checkpoint import run_checkpoints
from rlhf_pipeline.runs.lineage import run_store_at

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DEFAULT = str(REPO / "pipelines" / "default.py")
CHECKPOINT_EVERY = 6
# a round of each collector (4 prompts x 4) is one batch: a block takes all of one collector's round
# or half of each, as the shards stand when it is drawn
SMALL = ["--set", "warm_start_steps=5", "--set", "prompts_per_round=4", "--set", "group_size=4",
         "--set", "learner.batch_size=16", "--set", "learner.sample_window=32",
         "--set", "learner.new_rows_per_step=16", "--set", f"learner.checkpoint_every={CHECKPOINT_EVERY}"]
# how full the buffer was when a step drew: a step taken again finds more rows written
BUFFER_FILL = ("buffer_rows", "rows_generated")


@pytest.mark.parametrize("run_home", ["local", "s3"], indirect=True)
def test_a_learner_killed_beside_two_collectors_trains_its_steps_again_on_the_same_rows(run_home, tmp_path):
    run = f"{run_home}/twin"
    command = [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--collectors", "2",
               "--home", run_home, "--run-name", "twin", *SMALL, "--set", "buffer_backend=zarr"]
    paths = RunPaths.at_url(run) if "://" in run else RunPaths(Path(run))
    where, state_store = paths.state_object(paths.pacing)

    def learner_step() -> int:  # what the learner took in (its metrics at a URL are sent every few seconds)
        intake = read_intake(where, store=state_store)
        return 0 if intake is None else intake.step

    first = preloaded.Popen([*command, "--steps", "40"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    out = kill_when(first, lambda: learner_step() > CHECKPOINT_EVERY,
                    victims=lambda: run_child_pids("learn", run_home, "twin"), poll_s=0.1)
    assert first.returncode != 0 and "the learner failed" in out and "was killed by SIGKILL" in out, out[-3000:]
    store = run_store_at(run)
    killed_at = max(published_versions(store))  # a version a step
    checkpoint = run_checkpoints(paths).latest_step()
    assert checkpoint == CHECKPOINT_EVERY < killed_at, (checkpoint, killed_at)  # steps to take again
    retaken = range(checkpoint + 1, killed_at + 1)
    assert set(retaken) <= set(published_versions(store))
    weights = {version: load_weights(store, version)[0] for version in retaken}
    before = trained(logged(run), BUFFER_FILL)  # (at a URL, the lines sent before the kill)

    # to the step of the kill: the versions taken again are among the newest, kept
    resumed = preloaded.run([*command, "--steps", str(killed_at)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"[learner] resuming from {run}/checkpoints/" in resumed.stderr, resumed.stderr[-3000:]
    assert f"(step {checkpoint})" in resumed.stderr, resumed.stderr[-3000:]
    after = trained(logged(run), BUFFER_FILL)
    assert [r["step"] for r in after] == list(range(1, killed_at + 1))
    # both collectors' rows trained (else any draw would be the one shard's rows in order)
    consumed = read_intake(where, store=state_store).consumed
    assert len(consumed) == 2 and min(consumed.values()) > 0, consumed
    assert before[-1]["step"] > checkpoint or "://" in run
    for a, b in zip(before[checkpoint:], after[checkpoint:]):  # the steps taken again
        assert a == b, f"step {a['step']}: {sorted(set(a.items()) ^ set(b.items()))}"
    store = run_store_at(run)
    kept = [version for version in weights if version in published_versions(store)]
    assert killed_at in kept
    for version in kept:
        want, got = weights[version], load_weights(store, version)[0]
        assert all(torch.equal(got[k], want[k]) for k in want), f"version {version}"
