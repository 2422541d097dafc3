"""Retention in a run: the floors (kept checkpoints, branches, the learner) on a real run directory,
and ``rlhf-pipeline run`` with ``retention.max_rows`` keeping its shard bounded while it trains.

The branch floors run per location (``run_home``: a directory, an ``s3://`` URL on moto, an ``az://``
URL on Azurite), through one code path (``runs/retention.py``): the parent's shard is a real store
(Zarr at a URL); its branch is made as ``branch`` makes one (its ``parent-rows/`` selection written by
``write_parent_rows`` and published in the branch's store, then its ``branch.json``). While the
branch reads rows ``[144, 220)``, retention drops none of them, and neither while a branch is
half-made (``branch.making``) or its selection unreadable; a branch detached with ``detach`` (its own
copy of the rows) or deleted lets them go, after which the branch still reads every row it named,
unless it was continued online (its buffer still reads the parent's shard in place: held). At a URL
looking for branches lists the home: only when a drop is due.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import make_batch
import preloaded

from rlhf_pipeline.coordination.pacing import LearnerIntake, PacingPublisher
from rlhf_pipeline.learn.checkpoint import CheckpointManager, Progress
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.learn.settings import LearnerSettings
from rlhf_pipeline.pipeline import RunPaths
from rlhf_pipeline.runs.branch import PARENT_ROWS, write_parent_rows
from rlhf_pipeline.runs.lineage import BRANCH_MAKING, PARENT_ROWS_MANIFEST
from rlhf_pipeline.runs.detach import detach
from rlhf_pipeline.runs.lineage import run_lineage, run_store_at
from rlhf_pipeline.runs.retention import ShardRetention
from rlhf_pipeline.storage import create_store, open_buffer
from rlhf_pipeline.storage.continues import write_continued_rows
from rlhf_pipeline.storage.retention import RetentionSettings
from rlhf_pipeline.storage.selection import publish_selection, write_selection

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
    result = preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", str(REPO / "pipelines" / "default.py"),
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
    shown = preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "inspect", str(run)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert "retention  max_rows=48" in shown.stdout and f"shard-0000: {first}" in shown.stdout
    # a selection of the run's rows reads them in place, so its retention will drop them from it: said as it is made
    selected = preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "filter", str(run), str(tmp_path / "s.sel"),
                              "--selection", "--quiet", "--where", "reward >= 0"], cwd=REPO, capture_output=True,
                             text=True, timeout=120)
    assert selected.returncode == 0, selected.stderr[-3000:]
    assert "drops old rows (retention.max_rows=48)" in selected.stdout and "filter without --selection" in selected.stdout


def test_an_agent_run_drops_whole_trajectories_and_groups(tmp_path):
    """Turns are rows: a trajectory's turns, and a group's trajectories, straddle segment boundaries."""
    settings = ["--set", "warm_start_steps=20", "--set", "warm_start_check_tasks=0", "--set", "learner.batch_size=16",
                "--set", "learner.new_rows_per_step=16", "--set", "learner.sample_window=32",
                "--set", "learner.checkpoint_every=5", "--set", "segment_rows=16", "--set", "retention.max_rows=32"]
    result = preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", str(REPO / "pipelines" / "tool_use.py"),
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
    with branches_settled(paths.store):
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
    with branches_settled(paths.store):
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


# ============================================================ branch floors, per location
def make_branch(parent: RunPaths, name: str, rows: int, tmp_path) -> str:
    """A branch of ``parent`` at step 5 beside it, reading the parent's shard rows below ``rows``."""
    url = f"{parent.home}/{name}"
    branch = run_store_at(url)
    branch.create(BRANCH_MAKING, json.dumps({"parent": parent.location, "step": 5}).encode())
    shard = parent.shard_location(0).rsplit("/", 1)[-1]
    local = tmp_path / name / PARENT_ROWS
    write_parent_rows(parent.buffer_location, local, {shard: rows}, 5)
    publish_selection(local, branch, PARENT_ROWS)
    branch.create("settings.json", b"{}")
    branch.create("branch.json", json.dumps({"parent": parent.location, "step": 5, "buffer_rows": {shard: rows},
                                             "replay_source": None}).encode())
    branch.delete(BRANCH_MAKING)
    return url


@pytest.fixture()
def parent(run_home):
    """A parent's shard with 240 rows, and its learner's intake: in a directory (memmap), at an S3
    URL (moto) and at an Azure one (Azurite; Zarr at a URL)."""
    paths = RunPaths.at(f"{run_home}/parent")
    at_url = "://" in run_home
    store = create_store(paths.shard_location(0), "zarr" if at_url else "memmap", segment_rows=SEGMENT,
                         **({} if at_url else {"evict_grace_s": 0.0}))
    for r in range(20):  # 240 rows in groups of 6: groups straddle some segment boundaries
        store.append(make_batch(2, GROUP, seed=r, first_group_id=2 * r, first_trajectory_id=12 * r))
    # the learner took in 200 rows: its floor is row 168
    where, run_store = paths.state_object(paths.pacing)
    PacingPublisher(where, store=run_store).publish(LearnerIntake(consumed={"shard-0000": 200}))
    yield paths, store
    store.close()


def test_a_parent_keeps_the_rows_its_branches_read(parent, tmp_path):
    paths, store = parent
    retention = ShardRetention(RetentionSettings(max_rows=48), paths, "shard-0000", paths.shard_location(0), LEARNER)
    assert retention.after_round(store, None).first_row == 144  # no branch yet: the learner's floor, 160 splits a group
    branch = make_branch(paths, "branch", 220, tmp_path)  # reads the rows [144, 220)
    # inspect lists it as a branch holding the parent's rows
    assert [(b["run"], b["parent_rows"]) for b in run_lineage(paths.location)["branches"]] == [
        (branch, {paths.shard_location(0).rsplit("/", 1)[-1]: 220})]
    for r in range(20, 40):  # 240 rows more; the learner took in 440: its floor is row 408
        store.append(make_batch(2, GROUP, seed=r, first_group_id=2 * r, first_trajectory_id=12 * r))
    where, run_store = paths.state_object(paths.pacing)
    PacingPublisher(where, store=run_store).publish(LearnerIntake(consumed={"shard-0000": 440}))
    report = retention.after_round(store, None)
    assert report.rows_dropped == 0 and store.first_row == 144 and report.held_by == f"branch {branch}"

    # at a URL rounds with nothing new to drop reuse that look: the home is listed again only before a drop
    looks = retention.branches.looks
    retention.after_round(store, None)
    assert retention.branches.looks == looks or not retention.branches.rescan_s

    # a branch being made (branch.making, no branch.json) holds every row until its selection is there
    half = run_store_at(f"{paths.home}/half")
    half.create(BRANCH_MAKING, json.dumps({"parent": paths.location, "step": 5}).encode())
    assert retention.floor(store) == (0, f"branch {paths.home}/half (half-made: run its `branch` again, or "
                                         f"delete it)")
    half.delete(BRANCH_MAKING)
    # an unreadable selection holds every row rather than guess
    run_store_at(branch).write(f"{PARENT_ROWS}/selection.json", b"{not json", fence=False)
    floor, why = retention.floor(store)
    assert floor == 0 and "unreadable" in why
    publish_selection(tmp_path / "branch" / PARENT_ROWS, run_store_at(branch), PARENT_ROWS)
    assert retention.floor(store) == (144, f"branch {branch}")

    # detached: the branch reads its own copy; the parent's rows go (the learner's floor now bounds them)
    detach(branch)
    if retention.branches.rescan_s:  # at a URL
        assert retention.after_round(store, None).rows_dropped == 0  # a recent look keeps rows a while (never drops)
        retention.branches.rescan_s = 0.0  # as once RESCAN_S passed
    report = retention.after_round(store, None)
    assert report.rows_dropped > 0 and store.first_row == report.first_row > 220 and "learner" in report.held_by
    segments = run_store_at(paths.shard_location(0)).walk()
    assert not any("00000009" in key for key in segments), segments  # the objects of rows [144, 160) are gone
    with open_buffer(f"{branch}/{PARENT_ROWS}") as rows:  # the branch still reads every row it named
        assert len(rows) == 76
        assert rows.read(torch.arange(76), fields=["group_id"]).group_id.tolist() == [r // GROUP
                                                                                     for r in range(144, 220)]


def test_the_names_retention_reads_are_those_branch_writes():
    assert PARENT_ROWS_MANIFEST == f"{PARENT_ROWS}/selection.json"


def test_a_deleted_branch_holds_nothing(parent, tmp_path):
    paths, store = parent
    retention = ShardRetention(RetentionSettings(max_rows=48), paths, "shard-0000", paths.shard_location(0), LEARNER)
    branch = make_branch(paths, "gone", 100, tmp_path)
    assert retention.floor(store)[0] == 0
    run_store_at(branch).delete_prefix()
    retention.branches.rescan_s = 0.0  # as once RESCAN_S passed since the look that found it
    report = retention.after_round(store, None)
    assert store.first_row == 144 and "learner" in report.held_by


def test_a_detached_branch_continued_online_still_holds_the_parents_rows(parent, tmp_path):
    """Its ``parent-rows/`` names its own copy, but its buffer continues the parent's shard in place."""
    paths, store = parent
    retention = ShardRetention(RetentionSettings(max_rows=48), paths, "shard-0000", paths.shard_location(0), LEARNER)
    branch = make_branch(paths, "online", 120, tmp_path)
    name = paths.shard_location(0).rsplit("/", 1)[-1]
    write_continued_rows(f"{branch}/buffer", paths.buffer_location, {name: 120})  # as its first online start does
    detach(branch)
    floor, why = retention.floor(store)
    assert floor == 0 and "continued online" in why
    run_store_at(branch).delete("buffer.continues.json")  # (a branch never continued: its copy is all it reads)
    assert "learner" in retention.floor(store)[1]


def test_a_running_replay_of_the_parents_buffer_beside_it_holds_every_row(parent):
    """A replay at the URL beside the parent whose source is the parent's buffer, running now (its
    run.lock lease live), holds every row; one whose process ended here, or that released its lease, does not."""
    import os
    import socket
    import subprocess
    import sys

    from rlhf_pipeline.files.run_lease import ObjectLease

    paths, store = parent
    if paths.store.is_local:
        pytest.skip("a local replay holds run.lock, not a lease: test_retention_never_passes_a_branch_a_replay_...")
    retention = ShardRetention(RetentionSettings(max_rows=48), paths, "shard-0000", paths.shard_location(0), LEARNER)
    replay = run_store_at(f"{paths.home}/replay")
    replay.write("settings.json", json.dumps({"replay": {"buffer": paths.buffer_location}}).encode(), fence=False)
    lease = ObjectLease(replay, "run.lock", record={"command": "replay"}).acquire()  # this process replays
    try:
        report = retention.after_round(store, None)
        assert report.rows_dropped == 0 and store.first_row == 0
        assert report.held_by == f"replay {paths.home}/replay (running)"
    finally:
        lease.release()  # the replay ended: its run.lock is gone
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    replay.write("run.lock", json.dumps({"pid": int(ended.stdout), "host": socket.gethostname(),
                                         "lease_s": 30.0}).encode(), fence=False)  # killed here: its lease left
    assert int(ended.stdout) != os.getpid()
    assert retention.after_round(store, None).rows_dropped == 0  # a recent look keeps rows a while (never drops)
    retention.branches.rescan_s = 0.0  # as once RESCAN_S passed
    report = retention.after_round(store, None)
    assert report.rows_dropped > 0 and store.first_row == 144 and "learner" in report.held_by


def test_a_branch_made_while_a_drop_is_under_way_names_only_the_rows_left(parent):
    """At a URL the parent's collector marks a drop under way (``retention.drop_under_way``) around its look
    at the branches and its drop; ``branch`` puts up its ``branch.making`` and then waits for the mark
    to go before it names the parent's rows: it never names rows a drop decided without it."""
    import threading

    from rlhf_pipeline.cli.main import main
    from rlhf_pipeline.learn.checkpoint import Progress, run_checkpoints
    from rlhf_pipeline.runs.retention import drop_under_way

    paths, store = parent
    if paths.store.is_local:
        pytest.skip("in a directory `branch` and retention share a lock instead: "
                    "test_a_branch_made_while_retention_drops_names_only_rows_left_and_one_made_first_is_held")
    shard = paths.shard_location(0).rsplit("/", 1)[-1]  # the key a collector's retention and checkpoints use
    paths.store.write("settings.json", b"{}", fence=False)
    run_checkpoints(paths).save(Progress(seed=0, step=5), {"model": {"weight": torch.zeros(2)}},
                                record={"buffer_rows": {shard: 120}, "policy_version": 5})
    done: list[int] = []
    with drop_under_way(paths.store, shard):  # what the parent's retention holds while it drops
        branching = threading.Thread(target=lambda: done.append(main(["branch", paths.location, "--from-step", "5",
                                                                      "late"])))
        branching.start()
        branching.join(1.0)
        assert branching.is_alive() and not run_store_at(f"{paths.home}/late").exists("branch.json")
        store.drop_rows_before(48)  # decided before the branch was made
    branching.join(60)
    assert done == [0]
    with open_buffer(f"{paths.home}/late/{PARENT_ROWS}") as rows:  # only the rows left: all there
        assert len(rows) == 120 - 48
    assert not paths.store.exists(f"retention/dropping-{shard}.json")


# ============================================================ a branch at a URL, end to end with `run`
BOUND = ["segment_rows=16", "retention.max_rows=96", "retention.hold_rewind_points=false"]


@pytest.mark.parametrize("run_home", ["s3"], indirect=True)
def test_a_parent_at_a_url_keeps_its_branchs_rows_and_the_branch_drops_only_its_own(run_home, tmp_path):
    """A parent at the URL (one collector, a Zarr shard there) runs with ``retention.max_rows`` and
    ``hold_rewind_points=false`` (only its newest checkpoint holds rows), is branched at step 4, and
    runs on to step 16: its rules ask to drop rows the branch reads, and it keeps them. The branch then
    continues online to step 16 with the same rules: only its own shard's oldest segments go, their
    objects deleted, the parent's objects unchanged, and its buffer still reads the parent's rows."""
    from integration.run_location import digest, logged
    from integration.test_branch_online import AT_URL, FIELDS

    from rlhf_pipeline.cli.main import main
    from rlhf_pipeline.storage import open_store

    def bounded(name: str, steps: int) -> None:
        sets = [word for item in [*AT_URL, *BOUND] for word in ("--set", item)]
        ran = preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", str(REPO / "pipelines" /
                              "default.py"), "--steps", str(steps), "--home", run_home, "--run-name", name, *sets],
                            cwd=tmp_path, capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert ran.returncode == 0, ran.stderr[-3000:]

    def dropped(url: str) -> int:
        return int(sum(r.get("retention/rows_dropped", 0) for r in logged(url, "collector/metrics-0000.jsonl")))

    parent = f"{run_home}/parent"
    bounded("parent", 8)
    assert main(["branch", parent, "--from-step", "4", "kept"]) == 0
    kept = f"{run_home}/kept"
    lineage = json.loads(run_store_at(kept).read("branch.json"))
    (name, inherited), = lineage["buffer_rows"].items()
    selection = json.loads(run_store_at(kept).read(f"{PARENT_ROWS}/selection.json"))
    (part,) = selection["parts"]
    first_read = int(part["first_row"])

    bounded("parent", 16)  # the parent runs on beside its branch
    with open_store(part["location"]) as shard:
        held, written = shard.first_row, shard.next_row
    assert written - 96 > inherited  # max_rows asked to drop every row the branch reads...
    assert held <= first_read  # ...and the parent kept them
    with open_buffer(f"{kept}/{PARENT_ROWS}") as rows:  # the branch reads every row it names
        assert len(rows) == inherited - first_read
        rows.read(torch.arange(len(rows)), fields=list(FIELDS))

    before = digest(parent)
    bounded("kept", 16)
    assert digest(parent) == before  # the parent's objects were only read
    assert [m["step"] for m in logged(kept)] == list(range(1, 17))
    own_location = f"{kept}/buffer/{part['location'].rsplit('/', 1)[-1]}"
    with open_store(own_location) as own:
        own_first, own_next = own.first_row, own.next_row
    assert dropped(kept) == own_first > 0 and own_first % 16 == 0  # whole own segments only
    units = {int(key.split("/")[1].split("-")[0]) for key in run_store_at(own_location).walk() if key.count("/") > 1}
    assert min(units) == own_first  # the dropped segments' objects are gone
    assert sum(r.get("retention/bytes_freed", 0) for r in logged(kept, "collector/metrics-0000.jsonl")) > 0
    with open_buffer(f"{kept}/buffer") as union:  # the union's ids stay put: the branch's own rows after N
        shard = union.shards[0]
        assert (shard.first_row, shard.next_row) == (inherited + own_first, inherited + own_next)
