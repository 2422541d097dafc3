"""A learner killed beside several collectors trains its steps past the checkpoint again on the rows
it trained before the kill, also when killed again while it does: the same metrics and, under the same
version numbers, the same weights.

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
CHECKPOINT_EVERY = 6
# a round of each collector is a batch (default: 4 prompts x 4; tool_use: 2 tasks x 4 episodes, one
# row a turn): a block takes all of one collector's round or part of each, as the shards stand then
SMALL = {
    "default": ["warm_start_steps=5", "prompts_per_round=4", "group_size=4", "learner.batch_size=16",
                "learner.sample_window=32", "learner.new_rows_per_step=16"],
    "tool_use": ["warm_start_steps=20", "tasks_per_round=2", "learner.batch_size=8", "learner.new_rows_per_step=8",
                 "learner.sample_window=16", "log_rounds_every=0"],
}
# how full the buffer was when a step drew: a step taken again finds more rows written
BUFFER_FILL = ("buffer_rows", "rows_generated")


# tool_use.py makes memmap shards, which a run at a URL refuses: at a URL the default pipeline only
@pytest.mark.parametrize(("pipeline", "run_home"), [("default", "local"), ("default", "s3"), ("tool_use", "local")],
                         indirect=["run_home"])
def test_a_learner_killed_beside_two_collectors_trains_its_steps_again_on_the_same_rows(pipeline, run_home, tmp_path):
    run = f"{run_home}/twin"
    settings = [*SMALL[pipeline], f"learner.checkpoint_every={CHECKPOINT_EVERY}",
                *(["buffer_backend=zarr"] if "://" in run_home else [])]
    command = [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", str(REPO / "pipelines" / f"{pipeline}.py"),
               "--collectors", "2", "--home", run_home, "--run-name", "twin",
               *(word for setting in settings for word in ("--set", setting))]
    paths = RunPaths.at_url(run) if "://" in run else RunPaths(Path(run))
    where, state_store = paths.state_object(paths.pacing)

    def learner_step() -> int:  # what the learner took in (its metrics at a URL are sent every few seconds)
        intake = read_intake(where, store=state_store)
        return 0 if intake is None else intake.step

    first = preloaded.Popen([*command, "--steps", "40"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    # two steps past the checkpoint at least: room for a second kill between
    out = kill_when(first, lambda: learner_step() > CHECKPOINT_EVERY + 1,
                    victims=lambda: run_child_pids("learn", run_home, "twin"), poll_s=0.1)
    assert first.returncode != 0 and "the learner failed" in out and "was killed by SIGKILL" in out, out[-3000:]
    store = run_store_at(run)
    killed_at = max(published_versions(store))  # a version a step
    checkpoint = run_checkpoints(paths).latest_step()
    assert checkpoint == CHECKPOINT_EVERY < killed_at - 1, (checkpoint, killed_at)  # steps to take again
    published = published_versions(store)  # (a kill that came steps late: the oldest may be pruned)
    weights = {version: load_weights(store, version)[0] for version in range(checkpoint + 1, killed_at + 1)
               if version in published}
    before = trained(logged(run), BUFFER_FILL)  # (at a URL, the lines sent before the kill)
    recorded = read_intake(where, store=state_store).taken_since_checkpoint
    assert [draws for draws, _ in recorded][:2] == [checkpoint + 1, checkpoint + 2]  # (a step, a draw)

    # killed again while it takes those steps again, after the first of them: the rest stay on record
    seen = set()

    def retaking() -> bool:  # (the killed learner's step until the new one republishes its checkpoint's)
        seen.add(learner_step())
        return checkpoint in seen and checkpoint < learner_step() < killed_at

    again = preloaded.Popen([*command, "--steps", "40"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    out = kill_when(again, retaking, victims=lambda: run_child_pids("learn", run_home, "twin"), poll_s=0.05)
    assert again.returncode != 0 and "was killed by SIGKILL" in out, out[-3000:]
    # what it took in again is as recorded, and what it had not yet is still on record
    assert read_intake(where, store=state_store).taken_since_checkpoint[:len(recorded)] == recorded

    # to the step of the first kill: the versions taken again are among the newest, kept
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
