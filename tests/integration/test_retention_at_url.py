"""Retention of a run at an ``s3://`` or ``az://`` URL (moto's S3 server, Azurite) with branches beside it:
the parent's collector never drops a row a branch at the URL reads (``runs/retention_url.py``).

The parent's shard is a real Zarr store at its URL; its branch is made as ``branch`` makes one (its
``parent-rows/`` selection written by ``write_parent_rows`` and uploaded to the branch's URL, then
its ``branch.json``). While the branch reads rows ``[0, 120)``, retention drops none of them, and
neither while a branch is half-made (``branch.making``) or its selection unreadable; a branch
detached with ``detach`` (its own copy of the rows) or deleted lets them go, after which the branch
still reads every row it named, unless it was continued online (its buffer still reads the
parent's shard in place: held, at a URL and in a directory). Looking for branches lists the home:
only when a drop is due.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_batch

from rlhf_pipeline.coordination.pacing import LearnerIntake, PacingPublisher
from rlhf_pipeline.files.object_run_store import ObjectRunStore
from rlhf_pipeline.files.run_paths import RunPaths
from rlhf_pipeline.learn.settings import LearnerSettings
from rlhf_pipeline.runs.branch import PARENT_ROWS, write_parent_rows
from rlhf_pipeline.runs.branch_reads import BRANCH_MAKING, PARENT_ROWS_MANIFEST
from rlhf_pipeline.runs.branch_url import MAKING, walk
from rlhf_pipeline.runs.detach import detach
from rlhf_pipeline.runs.lineage_url import url_run_lineage
from rlhf_pipeline.runs.retention import ShardRetention, branch_rows_needed
from rlhf_pipeline.storage import create_store, open_buffer
from rlhf_pipeline.storage.continues import write_continued_rows
from rlhf_pipeline.storage.retention import RetentionSettings
from rlhf_pipeline.storage.selection_url import upload_selection

SEGMENT, GROUP = 16, 6
LEARNER = LearnerSettings(batch_size=16, sample_window=32)


def make_branch(parent: RunPaths, name: str, rows: int, tmp_path) -> str:
    """A branch of ``parent`` at step 5 beside it, reading the parent's shard rows below ``rows``."""
    url = f"{parent.home}/{name}"
    branch = ObjectRunStore(url)
    branch.create(MAKING, json.dumps({"parent": parent.url, "step": 5}).encode())
    shard = parent.shard_location(0).rsplit("/", 1)[-1]
    local = tmp_path / name / PARENT_ROWS
    write_parent_rows(parent.buffer_location, local, {shard: rows}, 5)
    upload_selection(local, f"{url}/{PARENT_ROWS}")
    branch.create("settings.json", b"{}")
    branch.create("branch.json", json.dumps({"parent": parent.url, "step": 5, "buffer_rows": {shard: rows},
                                             "replay_source": None}).encode())
    branch.delete(MAKING)
    return url


@pytest.fixture(params=["s3", "az"])
def parent(request, tmp_path, monkeypatch):
    """A parent's shard at the URL with 240 rows, and its learner's intake; on S3 (moto) and Azure (Azurite)."""
    if request.param == "s3":
        request.getfixturevalue("s3_env")
        home = request.getfixturevalue("s3_server").url("runs")
    else:
        server = request.getfixturevalue("azure_server")
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", server.env()["AZURE_STORAGE_CONNECTION_STRING"])
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        home = server.url("runs")
    paths = RunPaths.at_url(home + "/parent")
    store = create_store(paths.shard_location(0), "zarr", segment_rows=SEGMENT)
    for r in range(20):  # 240 rows in groups of 6: groups straddle some segment boundaries
        store.append(make_batch(2, GROUP, seed=r, first_group_id=2 * r, first_trajectory_id=12 * r))
    # the learner took in 200 rows: its floor is row 168
    where, run_store = paths.state_object(paths.pacing)
    PacingPublisher(where, store=run_store).publish(LearnerIntake(consumed={"shard-0000": 200}))
    yield paths, store
    store.close()


def test_a_parent_at_a_url_keeps_the_rows_its_branches_read(parent, tmp_path):
    paths, store = parent
    retention = ShardRetention(RetentionSettings(max_rows=48), paths, "shard-0000", paths.shard_location(0), LEARNER)
    assert retention.after_round(store, None).first_row == 144  # no branch yet: the learner's floor, 160 splits a group
    branch = make_branch(paths, "branch", 220, tmp_path)  # reads the rows [144, 220)
    # inspect lists it as a branch holding the parent's rows
    assert [(b["run"], b["parent_rows"]) for b in url_run_lineage(paths.url)["branches"]] == [
        (branch, {"00-shard-0000": 220})]
    for r in range(20, 40):  # 240 rows more; the learner took in 440: its floor is row 408
        store.append(make_batch(2, GROUP, seed=r, first_group_id=2 * r, first_trajectory_id=12 * r))
    where, run_store = paths.state_object(paths.pacing)
    PacingPublisher(where, store=run_store).publish(LearnerIntake(consumed={"shard-0000": 440}))
    report = retention.after_round(store, None)
    assert report.rows_dropped == 0 and store.first_row == 144 and report.held_by == f"branch {branch}"

    # rounds with nothing new to drop reuse that look: the home is listed again only before a drop
    looks = retention.url_branches.looks
    retention.after_round(store, None)
    assert retention.url_branches.looks == looks

    # a branch being made (branch.making, no branch.json) holds every row until its selection is there
    half = ObjectRunStore(f"{paths.home}/half")
    half.create(MAKING, json.dumps({"parent": paths.url, "step": 5}).encode())
    assert retention.floor(store) == (0, f"branch {paths.home}/half (half-made: run its `branch` again, or "
                                         f"delete it)")
    half.delete(MAKING)
    # an unreadable selection holds every row rather than guess
    ObjectRunStore(branch).write(f"{PARENT_ROWS}/selection.json", b"{not json", fence=False)
    floor, why = retention.floor(store)
    assert floor == 0 and "unreadable" in why
    upload_selection(tmp_path / "branch" / PARENT_ROWS, f"{branch}/{PARENT_ROWS}")
    assert retention.floor(store) == (144, f"branch {branch}")

    # detached: the branch reads its own copy; the parent's rows go (the learner's floor now bounds them)
    detach(branch)
    assert retention.after_round(store, None).rows_dropped == 0  # a recent look keeps rows a while (never drops)
    retention.url_branches.rescan_s = 0.0  # as once RESCAN_S passed
    report = retention.after_round(store, None)
    assert report.rows_dropped > 0 and store.first_row == report.first_row > 220 and "learner" in report.held_by
    segments = walk(ObjectRunStore(paths.shard_location(0)), "")
    assert not any("00000009" in key for key in segments), segments  # the objects of rows [144, 160) are gone
    with open_buffer(f"{branch}/{PARENT_ROWS}") as rows:  # the branch still reads every row it named
        assert len(rows) == 76
        assert rows.read(torch.arange(76), fields=["group_id"]).group_id.tolist() == [r // GROUP
                                                                                     for r in range(144, 220)]


def test_the_names_retention_reads_are_those_branch_writes():
    assert BRANCH_MAKING == MAKING and PARENT_ROWS_MANIFEST == f"{PARENT_ROWS}/selection.json"


def test_a_deleted_branch_at_a_url_holds_nothing(parent, tmp_path):
    paths, store = parent
    retention = ShardRetention(RetentionSettings(max_rows=48), paths, "shard-0000", paths.shard_location(0), LEARNER)
    branch = make_branch(paths, "gone", 100, tmp_path)
    assert retention.floor(store)[0] == 0
    for key in walk(ObjectRunStore(branch), ""):
        ObjectRunStore(branch).delete(key)
    retention.url_branches.rescan_s = 0.0  # as once RESCAN_S passed since the look that found it
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
    ObjectRunStore(branch).delete("buffer.continues.json")  # (a branch never continued: its copy is all it reads)
    assert "learner" in retention.floor(store)[1]


def test_a_local_detached_branch_continued_online_still_holds_the_parents_rows(tmp_path):
    run = RunPaths(tmp_path / "parent")
    shard = run.buffer / "shard-0000"
    store = create_store(shard, "memmap", segment_rows=SEGMENT, evict_grace_s=0.0)
    for r in range(20):
        store.append(make_batch(2, GROUP, seed=r, first_group_id=2 * r, first_trajectory_id=12 * r))
    branch = tmp_path / "online"
    branch.mkdir()
    (branch / "branch.json").write_text(json.dumps({"parent": str(run.root), "step": 5, "detached": {"rows_copied": 0},
                                                    "buffer_rows": {"shard-0000": 120}}))
    write_continued_rows(branch / "buffer", str(run.buffer), {"shard-0000": 120})
    assert branch_rows_needed(run.root, str(shard)) == [(str(branch), 0)]
    write_continued_rows(branch / "buffer", str(run.buffer), {"shard-0000": 0})  # it reads none of that shard
    assert branch_rows_needed(run.root, str(shard)) == []
    store.close()


def test_a_running_replay_of_the_parents_buffer_beside_it_holds_every_row(parent):
    """A replay at the URL beside the parent whose source is the parent's buffer, running now (its
    run.lock lease live), holds every row; one whose process ended here, or that released its lease, does not."""
    import os
    import socket
    import subprocess
    import sys

    from rlhf_pipeline.files.run_lease import ObjectLease

    paths, store = parent
    retention = ShardRetention(RetentionSettings(max_rows=48), paths, "shard-0000", paths.shard_location(0), LEARNER)
    replay = ObjectRunStore(f"{paths.home}/replay")
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
    retention.url_branches.rescan_s = 0.0  # as once RESCAN_S passed
    report = retention.after_round(store, None)
    assert report.rows_dropped > 0 and store.first_row == 144 and "learner" in report.held_by


def test_a_branch_made_while_a_drop_is_under_way_names_only_the_rows_left(parent):
    """The parent's collector marks a drop under way (``retention_url.drop_under_way``) around its look
    at the branches and its drop; ``branch`` puts up its ``branch.making`` and then waits for the mark
    to go before it names the parent's rows: it never names rows a drop decided without it."""
    import threading

    from rlhf_pipeline.cli.main import main
    from rlhf_pipeline.learn.checkpoint import Progress, run_checkpoints
    from rlhf_pipeline.runs.retention_url import drop_under_way

    paths, store = parent
    shard = paths.shard_location(0).rsplit("/", 1)[-1]  # the key a collector's retention and checkpoints use
    paths.store.write("settings.json", b"{}", fence=False)
    run_checkpoints(paths).save(Progress(seed=0, step=5), {"model": {"weight": torch.zeros(2)}},
                                record={"buffer_rows": {shard: 120}, "policy_version": 5})
    done: list[int] = []
    with drop_under_way(paths.store, shard):  # what the parent's retention holds while it drops
        branching = threading.Thread(target=lambda: done.append(main(["branch", paths.url, "--from-step", "5",
                                                                      "late"])))
        branching.start()
        branching.join(1.0)
        assert branching.is_alive() and not ObjectRunStore(f"{paths.home}/late").exists("branch.json")
        store.drop_rows_before(48)  # decided before the branch was made
    branching.join(60)
    assert done == [0]
    with open_buffer(f"{paths.home}/late/{PARENT_ROWS}") as rows:  # only the rows left: all there
        assert len(rows) == 120 - 48
    assert not paths.store.exists(f"retention/dropping-{shard}.json")
