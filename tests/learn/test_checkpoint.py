"""CheckpointManager: atomic writes, keep-last-N, RNG round trip; weights publishing."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from helpers import fill

from rlhf_pipeline.learn.checkpoint import CheckpointManager, Progress, capture_rng_state, restore_rng_state
from rlhf_pipeline.coordination.weights import WeightsPoller, latest_version, load_weights, publish_weights


def test_save_load_round_trip_and_keep_last(tmp_path):
    manager = CheckpointManager(tmp_path / "ckpt", keep_last=2)
    assert manager.latest() is None
    with pytest.raises(FileNotFoundError):
        manager.load()
    for step in (5, 10, 15):
        manager.save(Progress(seed=3, step=step, policy_version=step // 5), {"w": torch.full((2,), float(step))})
    names = [p.name for p in manager.paths()]
    assert names == ["step_00000010.pt", "step_00000015.pt"]
    progress, state = manager.load()
    assert progress == Progress(seed=3, step=15, policy_version=3)
    assert torch.equal(state["w"], torch.full((2,), 15.0))


def test_partial_files_are_never_taken_for_checkpoints(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=3)
    manager.save(Progress(seed=0, step=1), {})
    # what a crash in the middle of a save leaves behind
    (tmp_path / "step_00000002.pt.partial").write_bytes(b"torn")
    assert manager.latest().name == "step_00000001.pt"
    assert manager.load()[0].step == 1


def test_keep_last_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)


def test_rng_state_round_trip():
    state = capture_rng_state()
    expected = (random.random(), float(np.random.rand()), torch.rand(3))
    random.random(), np.random.rand(), torch.rand(3)
    restore_rng_state(state)
    got = (random.random(), float(np.random.rand()), torch.rand(3))
    assert expected[0] == got[0] and expected[1] == got[1] and torch.equal(expected[2], got[2])


def test_weights_versions_only_increase_and_poller_sees_new_ones(tmp_path):
    assert latest_version(tmp_path) is None
    poller = WeightsPoller(tmp_path)
    assert poller.poll() is None
    publish_weights(tmp_path, {"w": torch.zeros(2)}, 0)
    state, version = poller.poll()
    assert version == 0 and torch.equal(state["w"], torch.zeros(2))
    assert poller.poll() is None  # nothing newer
    with pytest.raises(ValueError, match="not newer"):
        publish_weights(tmp_path, {"w": torch.ones(2)}, 0)
    for v in (1, 2, 3, 4):
        publish_weights(tmp_path, {"w": torch.full((2,), float(v))}, v, keep_last=2)
    assert latest_version(tmp_path) == 4
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["policy_00000003.safetensors",
                                                                        "policy_00000004.safetensors"]
    state, version = poller.poll()  # jumps straight to the newest
    assert version == 4 and torch.equal(state["w"], torch.full((2,), 4.0))
    assert load_weights(tmp_path, 3)[1] == 3


def test_weights_of_runs_made_before_safetensors_still_load_and_are_pruned(tmp_path):
    """A run resumed from .pt weight files: they are read, the next versions are safetensors, and
    pruning removes the old format too. Tied tensors (one storage) are published as copies."""
    weights = tmp_path / "weights"
    weights.mkdir()
    for v in (0, 1):
        torch.save({"version": v, "state_dict": {"w": torch.full((2,), float(v))}}, weights / f"policy_{v:08d}.pt")
    assert latest_version(tmp_path) == 1
    state, version = load_weights(tmp_path)
    assert version == 1 and torch.equal(state["w"], torch.ones(2))
    shared = torch.full((2,), 2.0)
    publish_weights(tmp_path, {"w": shared, "tied": shared}, 2, keep_last=2)
    assert sorted(p.name for p in weights.iterdir()) == ["policy_00000001.pt", "policy_00000002.safetensors"]
    state, version = WeightsPoller(tmp_path, current_version=1).poll()
    assert version == 2 and torch.equal(state["tied"], shared) and torch.equal(state["w"], shared)
    publish_weights(tmp_path, {"w": shared}, 3, keep_last=2)
    assert sorted(p.name for p in weights.iterdir()) == ["policy_00000002.safetensors", "policy_00000003.safetensors"]
    with pytest.raises(FileNotFoundError, match="version 1 is not under"):
        load_weights(tmp_path, 1)


def test_keep_every_keeps_rewind_points_beside_the_newest(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2, keep_every=4)
    for step in range(1, 11):
        manager.save(Progress(seed=0, step=step, policy_version=step), {},
                     record={"buffer_rows": {"shard-0000": 16 * step}})
    assert manager.steps() == [4, 8, 9, 10]
    # a pruned checkpoint's record goes with it; a kept one says where the buffer stood
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".json") == [
        f"step_{s:08d}.json" for s in (4, 8, 9, 10)]
    assert manager.record(8) == {"format": 1, "step": 8, "policy_version": 8, "draws": 0,
                                 "buffer_rows": {"shard-0000": 128}}
    assert [point["step"] for point in manager.rewind_points()] == [4, 8, 9, 10]
    # the learner saves at each rewind point too, whatever checkpoint_every is: keep_every=20 with the
    # default checkpoint_every=50 had kept only steps 100, 200... (asked for 20, 40, 60...)
    assert [step for step in range(1, 13) if manager.saves_at(step)] == [4, 8, 12]
    assert not any(CheckpointManager(tmp_path).saves_at(step) for step in range(1, 13))  # keep_every=0


def test_a_checkpoint_without_a_record_is_still_a_rewind_point(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=3)
    manager.save(Progress(seed=0, step=1), {})
    (tmp_path / "step_00000001.json").unlink()  # as a run made before records left it
    (tmp_path / "step_00000002.json").write_text("{torn")  # a record without its checkpoint counts for nothing
    assert manager.rewind_points() == [{"step": 1}]
    assert manager.record(1) is None


def test_keep_every_must_not_be_negative(tmp_path):
    with pytest.raises(ValueError, match="keep_every"):
        CheckpointManager(tmp_path, keep_every=-1)


# ====================================================================== a full disk
def test_a_full_disk_under_torch_save_is_the_os_error_naming_the_file(small_disk):
    """torch.save on a full disk raised `[enforce fail at inline_container.cc:672] unexpected pos`
    (a tensor written past Python's file buffer: the file's ENOSPC swallowed inside torch); now the
    ENOSPC itself, naming the file, which the command line says in one line as it does every other
    writer's (cli/run_cmd.py); the checkpoint before stays whole."""
    import errno

    checkpoints = CheckpointManager(small_disk / "checkpoints")
    checkpoints.save(Progress(seed=0, step=1), {"model": {"w": torch.ones(1000)}})
    fill(small_disk, leave_bytes=64 * 1024)
    with pytest.raises(OSError) as failed:
        checkpoints.save(Progress(seed=0, step=2), {"model": {"w": torch.ones(1024 * 1024)}})
    assert failed.value.errno == errno.ENOSPC, failed.value
    assert failed.value.filename == str(small_disk / "checkpoints" / "step_00000002.pt.partial")
    assert sorted(p.name for p in (small_disk / "checkpoints").iterdir()) == ["step_00000001.json",
                                                                               "step_00000001.pt"]
    progress, state = checkpoints.load()
    assert progress.step == 1 and torch.equal(state["model"]["w"], torch.ones(1000))


def test_a_learner_on_a_full_disk_stops_at_its_checkpoint_and_resumes_from_the_last_one(small_disk):
    """The learner's side of a full disk at a checkpoint: the OSError, the checkpoint before whole,
    and once space is freed the same learner resumes from it."""
    import errno

    from test_learner import learner, make_run

    paths = make_run(small_disk)
    checkpoint_bytes = []

    def fill_the_disk_at_step_3(step, sampled, batch, metrics):
        if step == 3:  # room left for metrics lines, not for the checkpoint of step 4
            checkpoint_bytes.append((paths.checkpoints / "step_00000002.pt").stat().st_size)
            fill(small_disk, leave_bytes=checkpoint_bytes[0] // 2)

    run = learner(paths, steps=4, checkpoint_every=2, publish_every=100)
    run.on_step = fill_the_disk_at_step_3
    run.setup()
    with pytest.raises(OSError) as failed:
        run.train()
    run.cleanup()
    assert failed.value.errno == errno.ENOSPC and failed.value.filename == str(
        paths.checkpoints / "step_00000004.pt.partial"), failed.value
    assert sorted(p.name for p in paths.checkpoints.iterdir()) == ["step_00000002.json", "step_00000002.pt"]
    progress, _ = CheckpointManager(paths.checkpoints).load()
    assert progress.step == 2

    (small_disk / "filler").unlink()  # space freed: the same learner resumes from step 2
    resumed = learner(paths, steps=4, checkpoint_every=2, publish_every=100)
    resumed.setup()
    assert resumed.progress.step == 2
    assert resumed.train() is True
    resumed.cleanup()
    assert resumed.checkpoints.steps() == [2, 4]
