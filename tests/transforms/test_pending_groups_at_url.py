"""Pending groups of a buffer at a URL (moto's S3 server and Azurite on loopback) live in the store's
own commit record, its writer state: found by a buffer built with nothing local (another machine),
a crash between the transform and the append settled as in a directory, a planted state refused."""

from __future__ import annotations

import io

import pytest
import torch
from helpers import make_batch

from rlhf_pipeline.files.state_files import StateFileError
from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage.torchrl_glue import make_replay_buffer
from rlhf_pipeline.storage.zarr import ZarrTrajectoryStore
from rlhf_pipeline.transforms import GroupAdvantage

SCHEMA = StoreSchema(optional=("advantage",))


@pytest.fixture(params=["s3", "azure"])
def server(request):
    return request.getfixturevalue(f"{request.param}_server")


def _trajectory_ids(store) -> list[int]:
    store.refresh()
    if store.next_row == 0:
        return []
    return sorted(store.read_global(torch.arange(store.next_row))["trajectory_id"].tolist())


def _machine(server, buffer_url: str):
    """What a collector on a machine of its own builds: the shard opened for appending, its buffer
    with the write path, nothing on local disk."""
    store = ZarrTrajectoryStore.open(buffer_url, "a", storage_options=server.options)
    ga = GroupAdvantage(4)
    return store, make_replay_buffer(store, transforms=[ga]), ga


def test_pending_groups_live_under_the_url_and_another_machine_completes_them(server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    buffer_url = f"{server.url('run')}/buffer/shard-0000"
    ZarrTrajectoryStore.create(buffer_url, SCHEMA, storage_options=server.options).close()
    batch = make_batch(2, 4)
    store, rb, ga = _machine(server, buffer_url)
    assert rb.extend(batch.select([0, 1, 4])).numel() == 0
    store.close()  # the machine goes away; its successor has only the URL

    store, rb, again = _machine(server, buffer_url)
    assert sorted(again.pending.trajectory_ids().tolist()) == [0, 1, 4]
    assert again.metrics()["rows_in"] == 3  # the counters travel with the rows
    assert rb.extend(batch.select([2, 3])).numel() == 4
    assert _trajectory_ids(store) == [0, 1, 2, 3]
    assert sorted(again.pending.trajectory_ids().tolist()) == [4]
    store.close()
    assert list(tmp_path.iterdir()) == []  # nothing written beside the process


def test_a_crash_between_transform_and_append_at_a_url_neither_loses_nor_doubles(server, monkeypatch):
    buffer_url = f"{server.url('run')}/buffer/shard-0000"
    ZarrTrajectoryStore.create(buffer_url, SCHEMA, storage_options=server.options).close()
    batch = make_batch(1, 4)
    store, rb, _ = _machine(server, buffer_url)
    rb.extend(batch.select([0, 1]))

    class Killed(BaseException):
        pass

    def killed(*args, **kwargs):
        raise Killed

    monkeypatch.setattr(ZarrTrajectoryStore, "_append_validated", killed)
    with pytest.raises(Killed):
        rb.extend(batch.select([2, 3]))  # the group completed in the transform; the append never came
    monkeypatch.undo()
    store.close()
    store, rb, again = _machine(server, buffer_url)
    assert store.next_row == 0 and sorted(again.pending.trajectory_ids().tolist()) == [0, 1]
    assert rb.extend(batch.select([2, 3])).numel() == 4
    assert _trajectory_ids(store) == [0, 1, 2, 3]
    store.close()
    store, rb, last = _machine(server, buffer_url)
    assert last.pending.num_rows == 0  # written once, not pending again
    store.close()


def test_a_writer_state_that_would_run_code_is_refused(server):
    buffer_url = f"{server.url('run')}/buffer/shard-0000"
    store = ZarrTrajectoryStore.create(buffer_url, SCHEMA, storage_options=server.options)
    # a torch file whose unpickling would call a function: what someone with write access could plant
    planted = io.BytesIO()
    torch.save({"format": 2, "writer": print, "write_path": []}, planted)
    store.append(None, writer_state=planted.getvalue())
    with pytest.raises(StateFileError, match=f"refusing to load the writer state {buffer_url}"):
        make_replay_buffer(store, transforms=[GroupAdvantage(4)])
    store.close()
