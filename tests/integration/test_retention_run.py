"""Retention in a run: the floors (kept checkpoints, branches, the learner) on a real run directory,
and ``rlhf-pipeline run`` with ``retention.max_rows`` keeping its shard bounded while it trains."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
from helpers import make_batch

from rlhf_pipeline.coordination.pacing import LearnerIntake, PacingPublisher
from rlhf_pipeline.learn.checkpoint import CheckpointManager, Progress
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.learn.settings import LearnerSettings
from rlhf_pipeline.pipeline import RunPaths
from rlhf_pipeline.runs.retention import ShardRetention
from rlhf_pipeline.storage import create_store, open_buffer
from rlhf_pipeline.storage.retention import RetentionSettings
from rlhf_pipeline.storage.selection import write_selection

REPO = Path(__file__).resolve().parents[2]
SEGMENT, GROUP = 16, 6
LEARNER = LearnerSettings(batch_size=16, sample_window=32)  # a sampler reaches 32 rows behind its position


def checkpoint(paths: RunPaths, step: int, rows: int) -> None:
    manager = CheckpointManager(paths.checkpoints, keep_last=10)
    manager.save(Progress(seed=0, step=step), {}, record={"buffer_rows": {"shard-0000": rows}})


def test_retention_never_passes_a_branch_a_replay_a_checkpoint_or_the_learner(tmp_path):
    paths = RunPaths(tmp_path / "run")
    shard = paths.buffer / "shard-0000"
    store = create_store(shard, "memmap", segment_rows=SEGMENT, evict_grace_s=0.0)
    for r in range(20):  # 240 rows in groups of 6, so groups straddle some segment boundaries
        store.append(make_batch(2, GROUP, seed=r, first_group_id=2 * r, first_trajectory_id=12 * r))
    retention = ShardRetention(RetentionSettings(max_rows=48), paths, "shard-0000", str(shard), LEARNER)

    # no learner intake yet: every row may still be read, nothing goes
    assert retention.after_round(store, None).rows_dropped == 0 and store.first_row == 0
    PacingPublisher(paths.pacing).publish(LearnerIntake(consumed={"shard-0000": 200}))
    checkpoint(paths, 5, 120)  # a rewind to step 5 draws from rows [88, 120)

    # a branch beside the run reads rows [0, 120) through its parent-rows/ selection
    branch = tmp_path / "branch"
    branch.mkdir()
    (branch / "branch.json").write_text(json.dumps({"parent": str(paths.root), "step": 5,
                                                    "buffer_rows": {"shard-0000": 120}}))
    with open_buffer(paths.buffer, mode="r") as source:
        write_selection(branch / "parent-rows", source, np.zeros(120, dtype=np.int64), np.arange(120))
    report = retention.after_round(store, None)
    assert report.rows_dropped == 0 and store.first_row == 0 and "branch" in report.held_by

    shutil.rmtree(branch)
    # a replay of this buffer beside the run, running (this process holds its run.lock): nothing goes
    replay = tmp_path / "replay"
    replay.mkdir()
    (replay / "settings.json").write_text(json.dumps({"replay": {"buffer": str(paths.buffer)}}))
    (replay / "run.lock").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    report = retention.after_round(store, None)
    assert report.rows_dropped == 0 and "replay" in report.held_by
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (replay / "run.lock").write_text(json.dumps({"pid": int(ended.stdout), "host": socket.gethostname()}))

    # the replay ended: the checkpoint's rows now hold, below 88, at a boundary no group straddles
    report = retention.after_round(store, None)
    assert store.first_row == report.first_row == 48 and report.rows_dropped == 48  # 80 and 64 split groups
    assert "checkpoint of step 5" in report.held_by and report.bytes_freed > 0
    assert not (shard / "seg-00000000").exists()

    # only the newest checkpoint holds with hold_rewind_points=false: the learner's window (from 168) bounds it
    checkpoint(paths, 9, 200)
    released = ShardRetention(RetentionSettings(max_rows=48, hold_rewind_points=False), paths, "shard-0000",
                              str(shard), LEARNER)
    report = released.after_round(store, None)
    assert store.first_row == 144 and report.floor == 168  # 160 splits a group
    assert store.read_global([144]).group_id.item() == 24
    store.close()


def test_a_run_with_max_rows_keeps_its_shard_bounded_and_trains(tmp_path):
    settings = ["--set", "warm_start_steps=5", "--set", "prompts_per_round=4", "--set", "group_size=4",
                "--set", "learner.batch_size=16", "--set", "learner.sample_window=32",
                "--set", "learner.new_rows_per_step=16", "--set", "learner.checkpoint_every=5",
                "--set", "segment_rows=16", "--set", "retention.max_rows=48"]
    result = subprocess.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", str(REPO / "pipelines" / "default.py"),
                             "--steps", "30", "--home", str(tmp_path), "--run-name", "long", *settings],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run = tmp_path / "long"
    rounds = read_metrics(run / "collector" / "metrics-0000.jsonl")
    dropped = sum(r["retention/rows_dropped"] for r in rounds)
    with open_buffer(run / "buffer", mode="r") as buffer:
        first, written = buffer.first_row, buffer.next_row
    assert dropped > 0 and first == dropped and written >= 30 * 16
    # never past the rows the kept checkpoints draw from (their position less the sampler's reach)
    kept = CheckpointManager(run / "checkpoints").rewind_points()
    assert first <= min(p["buffer_rows"]["shard-0000"] for p in kept) - 32
    shown = subprocess.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "inspect", str(run)], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
    assert "retention  max_rows=48" in shown.stdout and f"shard-0000: {first}" in shown.stdout


def test_an_agent_run_drops_whole_trajectories_and_groups(tmp_path):
    """Turns are rows: a trajectory's turns, and a group's trajectories, straddle segment boundaries."""
    settings = ["--set", "warm_start_steps=20", "--set", "warm_start_check_tasks=0", "--set", "learner.batch_size=16",
                "--set", "learner.new_rows_per_step=16", "--set", "learner.sample_window=32",
                "--set", "learner.checkpoint_every=5", "--set", "segment_rows=16", "--set", "retention.max_rows=32"]
    result = subprocess.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", str(REPO / "pipelines" / "tool_use.py"),
                             "--steps", "20", "--home", str(tmp_path), "--run-name", "agent", *settings],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open_buffer(tmp_path / "agent" / "buffer", mode="r") as buffer:
        shard = next(iter(buffer.shards.values()))
        assert shard.first_row > 0
        rows = shard.read_global(list(range(shard.first_row, shard.next_row)),
                                 fields=["group_id", "trajectory_id", "step"])
    assert int(rows.step[0]) == 0  # the first row held is a first turn
    first_turns = {int(t) for t, s in zip(rows.trajectory_id, rows.step) if int(s) == 0}
    assert {int(t) for t in rows.trajectory_id} == first_turns  # no trajectory lost its first turns
    per_group: dict[int, set[int]] = {}
    for group, trajectory in zip(rows.group_id.tolist(), rows.trajectory_id.tolist()):
        per_group.setdefault(group, set()).add(trajectory)
    assert len({len(t) for t in per_group.values()}) == 1  # every group held has all its trajectories


def test_a_continued_branch_translates_its_floors_to_its_own_rows(tmp_path):
    """A branch continued online from the parent's row 100: its checkpoints and learner count from
    there, its own store from 0. A floor among the parent's rows holds every own row."""
    paths = RunPaths(tmp_path / "branch")
    shard = paths.buffer / "shard-0000"
    store = create_store(shard, "memmap", segment_rows=SEGMENT, evict_grace_s=0.0)
    for r in range(20):  # own rows [0, 240)
        store.append(make_batch(2, GROUP, seed=r, first_group_id=2 * r, first_trajectory_id=12 * r))
    retention = ShardRetention(RetentionSettings(max_rows=48), paths, "shard-0000", str(shard), LEARNER,
                               continues_from=100)
    PacingPublisher(paths.pacing).publish(LearnerIntake(consumed={"shard-0000": 100 + 200}))
    checkpoint(paths, 4, 90)  # the step it was branched at, among the parent's rows: holds every own row
    report = retention.after_round(store, None)
    assert report.rows_dropped == 0 and report.floor == 0 and "step 4" in report.held_by
    shutil.rmtree(paths.checkpoints)
    checkpoint(paths, 9, 100 + 120)  # own row 120, less the sampler's 32: own rows from 88 stay
    report = retention.after_round(store, None)
    assert report.floor == 88 and store.first_row == report.first_row == 48  # 80 and 64 split groups
    store.close()


def test_a_branch_made_while_retention_drops_names_only_rows_left_and_one_made_first_is_held(tmp_path):
    """The parent's retention looks for branches and drops under the same lock as ``branch`` names
    its rows and appears (``lineage.branches_settled``): a branch is either seen by the look or made
    after the drop, never given rows a drop decided without it."""
    import threading

    from rlhf_pipeline.runs.branch import branch_run
    from rlhf_pipeline.runs.lineage import branches_settled
    paths = RunPaths(tmp_path / "run")
    shard = paths.buffer / "shard-0000"
    store = create_store(shard, "memmap", segment_rows=SEGMENT, evict_grace_s=0.0)
    for r in range(20):
        store.append(make_batch(2, GROUP, seed=r, first_group_id=2 * r, first_trajectory_id=12 * r))
    paths.root.joinpath("settings.json").write_text("{}")
    before = paths.root.joinpath("settings.json").stat().st_mtime_ns
    PacingPublisher(paths.pacing).publish(LearnerIntake(consumed={"shard-0000": 200}))
    import torch  # the checkpoint a branch takes its weights from

    CheckpointManager(paths.checkpoints, keep_last=10).save(
        Progress(seed=0, step=5), {"model": {"weight": torch.zeros(2)}},
        record={"buffer_rows": {"shard-0000": 120}, "policy_version": 5})
    retention = ShardRetention(RetentionSettings(max_rows=48, hold_rewind_points=False), paths, "shard-0000",
                               str(shard), LEARNER)

    # a drop under way (the parent's retention holds the lock): `branch` waits for it to end
    made: list = []
    with branches_settled(paths.root):
        branching = threading.Thread(target=lambda: made.append(branch_run(paths.root, 5, tmp_path / "late")))
        branching.start()
        branching.join(0.5)
        assert branching.is_alive() and not (tmp_path / "late").exists()
        store.drop_rows_before(48)  # what retention's drop does, decided without the branch
    branching.join(30)
    assert made and made[0]["buffer_rows"] == {"shard-0000": 120}
    with open_buffer(tmp_path / "late" / "parent-rows") as rows:  # names only the rows left: all there
        assert len(rows) == 120 - 48

    # a drop about to be made waits for a branch being made (`branch` holds the lock), then sees it
    shutil.rmtree(tmp_path / "late")
    CheckpointManager(paths.checkpoints, keep_last=10).save(  # a newer checkpoint: rows from 168 held, 48-143 may go
        Progress(seed=0, step=9), {"model": {"weight": torch.zeros(2)}},
        record={"buffer_rows": {"shard-0000": 200}, "policy_version": 9})
    reports: list = []
    with branches_settled(paths.root):
        dropping = threading.Thread(target=lambda: reports.append(retention.after_round(store, None)))
        dropping.start()
        dropping.join(0.5)
        assert dropping.is_alive()  # it would drop: it waits for the lock to look again
        early = tmp_path / "early"  # what `branch` writes under the lock: its selection, then its branch.json
        early.mkdir()
        with open_buffer(paths.buffer, mode="r") as source:
            write_selection(early / "parent-rows", source, np.zeros(72, dtype=np.int64), np.arange(48, 120))
        (early / "branch.json").write_text(json.dumps({"parent": str(paths.root), "step": 5,
                                                       "buffer_rows": {"shard-0000": 120}}))
    dropping.join(30)
    assert reports[0].rows_dropped == 0 and store.first_row == 48 and "early" in reports[0].held_by
    assert paths.root.joinpath("settings.json").stat().st_mtime_ns == before  # the lock writes nothing
    store.close()
