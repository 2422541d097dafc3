"""Pending groups in the store's writer state: reload, a crash on either side of the append, a write
the store refuses, rb state, and a real SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import make_batch

from rlhf_pipeline.schema import StoreSchema, TrajectoryValidationError
from rlhf_pipeline.schema.ragged import RaggedTensor
from rlhf_pipeline.storage.memmap import MemmapTrajectoryStore
from rlhf_pipeline.storage.torchrl_glue import make_replay_buffer
from rlhf_pipeline.transforms import GroupAdvantage, attach_write_path, group_advantages
from rlhf_pipeline.transforms.pending_groups import decode_batch, encode_batch

SCHEMA = StoreSchema(optional=("advantage",))


def _store(path: Path) -> MemmapTrajectoryStore:
    return MemmapTrajectoryStore.create(path, SCHEMA, durable=False, exist_ok=True)


def _buffer(store):
    """A restarted writer's buffer: its write path's state as the store last published it."""
    ga = GroupAdvantage(4)
    return make_replay_buffer(store, transforms=[ga]), ga


def _all_trajectory_ids(store) -> list[int]:
    if store.next_row == 0:
        return []
    return store.read_global(torch.arange(store.next_row))["trajectory_id"].tolist()


def test_encode_decode_round_trip():
    batch = make_batch(2, 3)
    assert decode_batch(encode_batch(batch)).equal(batch)


def test_pending_rows_survive_a_new_buffer_on_the_store(tmp_path):
    store = _store(tmp_path / "buf")
    rb, _ = _buffer(store)
    batch = make_batch(1, 4)
    assert rb.extend(batch.select([0, 2])).numel() == 0  # no rows yet: the pending ones are published
    store.close()
    store = _store(tmp_path / "buf")
    rb, again = _buffer(store)  # what a restarted collector builds
    assert sorted(again.pending.trajectory_ids().tolist()) == [0, 2]
    assert again.metrics()["rows_in"] == 2  # the counters travel with the rows
    assert rb.extend(batch.select([1, 3])).numel() == 4
    assert sorted(_all_trajectory_ids(store)) == [0, 1, 2, 3] and again.pending.num_rows == 0
    store.close()
    with MemmapTrajectoryStore.open(tmp_path / "buf", "a") as store:
        assert _buffer(store)[1].pending.num_rows == 0  # the completed group is not pending again


def test_a_crash_between_the_transform_and_the_append_loses_nothing(tmp_path, monkeypatch):
    """The group completed in the transform, the process died before the append published: neither
    the rows nor the pending state moved, so the resent rows complete the group once."""
    store = _store(tmp_path / "buf")
    rb, _ = _buffer(store)
    batch = make_batch(1, 4)
    rb.extend(batch.select([0, 1]))

    class Killed(BaseException):
        pass

    def killed(*args, **kwargs):
        raise Killed

    monkeypatch.setattr(type(store), "_append_validated", killed)
    with pytest.raises(Killed):
        rb.extend(batch.select([2, 3]))
    monkeypatch.undo()
    store.close()
    store = _store(tmp_path / "buf")
    rb, again = _buffer(store)
    assert store.next_row == 0 and sorted(again.pending.trajectory_ids().tolist()) == [0, 1]
    assert rb.extend(batch.select([2, 3])).numel() == 4
    assert sorted(_all_trajectory_ids(store)) == [0, 1, 2, 3]
    store.close()


def test_failed_extend_keeps_pending_rows_in_process(tmp_path):
    """The store rejects the write after the group completed: resending it completes the group once."""
    store = _store(tmp_path / "buf")
    rb, ga = _buffer(store)
    batch = make_batch(1, 4)
    log_probs = batch["response_log_probs"]
    bad_values = log_probs.values.clone()
    bad_values[int(log_probs.offsets[3])] = 0.5  # a positive log-prob: the store's validation rejects it
    bad = batch.with_columns(response_log_probs=RaggedTensor(bad_values, log_probs.offsets))
    rb.extend(batch.select([0, 1]))
    with pytest.raises(TrajectoryValidationError, match="response_log_probs"):
        rb.extend(bad.select([2, 3]))
    assert store.next_row == 0 and sorted(ga.pending.trajectory_ids().tolist()) == [0, 1]
    assert rb.extend(batch.select([2, 3])).numel() == 4  # the corrected retry completes the group
    assert sorted(_all_trajectory_ids(store)) == [0, 1, 2, 3]
    assert ga.pending.num_rows == 0
    store.close()


def test_replay_buffer_state_dict_carries_pending_rows(tmp_path):
    store = _store(tmp_path / "buf")
    rb = attach_write_path(make_replay_buffer(store), GroupAdvantage(4))
    batch = make_batch(1, 4)
    rb.extend(batch.select([0, 2]))
    state = rb.state_dict()
    store.close()

    store = _store(tmp_path / "other")
    fresh = GroupAdvantage(4)
    rb2 = attach_write_path(make_replay_buffer(store), fresh)
    rb2.load_state_dict(state)
    assert sorted(fresh.pending.trajectory_ids().tolist()) == [0, 2]
    assert rb2.extend(batch.select([1, 3])).numel() == 4
    assert sorted(_all_trajectory_ids(store)) == [0, 1, 2, 3]
    store.close()


CHILD = textwrap.dedent("""
    import sys, torch
    torch.set_num_threads(1)
    sys.path.insert(0, {tests!r})
    from helpers import make_batch
    from rlhf_pipeline.schema import StoreSchema
    from rlhf_pipeline.storage.memmap import MemmapTrajectoryStore
    from rlhf_pipeline.storage.torchrl_glue import make_replay_buffer
    from rlhf_pipeline.transforms import GroupAdvantage, attach_write_path
    store = MemmapTrajectoryStore.create({path!r}, StoreSchema(optional=("advantage",)), exist_ok=True)
    rb = make_replay_buffer(store, transforms=[GroupAdvantage(4)])
    batch = make_batch(50, 4, seed=5)  # far more than the parent lets it write
    order = torch.randperm(200, generator=torch.Generator().manual_seed(3))
    sizes = [1, 2, 3, 1, 3, 2] * 40
    pos, k = 0, 0
    while pos < 200:
        rows = order[pos:pos + sizes[k]]
        rb.extend(batch.select(rows))
        print("acked", *rows.tolist(), flush=True)
        pos += sizes[k]; k += 1
    print("finished", flush=True)
""")


@pytest.mark.slow
def test_sigkill_mid_collection_then_resume_writes_every_row_once(tmp_path):
    path = tmp_path / "buf"
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(tests=str(Path(__file__).resolve().parents[1]), path=str(path)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    acked: list[int] = []
    for line in child.stdout:
        acked += [int(x) for x in line.split()[1:]]
        if len(acked) >= 20:
            child.send_signal(signal.SIGKILL)  # lands wherever the child is by now
            break
    child.wait()
    assert child.returncode == -signal.SIGKILL

    store = MemmapTrajectoryStore.open(path, "a")
    ga = GroupAdvantage(4)
    rb = make_replay_buffer(store, transforms=[ga])  # the pending rows published with the last append
    held = set(_all_trajectory_ids(store)) | set(ga.pending.trajectory_ids().tolist())
    assert set(acked) <= held  # every acknowledged row is stored or pending
    assert len(held) < 200  # the kill came mid-collection
    batch = make_batch(50, 4, seed=5)
    rb.extend(batch.select([i for i in range(200) if i not in held]))
    ids = _all_trajectory_ids(store)
    assert sorted(ids) == list(range(200))  # every row exactly once
    assert ga.pending.num_rows == 0
    stored = store.read_global(torch.arange(200))
    expected, _ = group_advantages(stored["reward"], stored["group_id"], 50)
    torch.testing.assert_close(stored["advantage"], expected, atol=1e-6, rtol=0)
    store.close()
