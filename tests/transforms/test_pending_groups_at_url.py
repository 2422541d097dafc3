"""Pending groups kept in a run's store at a URL (moto's S3 server and Azurite on loopback): found
by a transform built with nothing local (another machine), the crash ordering settled there as in a
directory, a superseded writer fenced, a planted object refused; and the directory layout unchanged.
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_batch

from rlhf_pipeline.files.atomic import save_torch_atomic
from rlhf_pipeline.files.object_run_store import ObjectRunStore
from rlhf_pipeline.files.run_store import StaleWriterError
from rlhf_pipeline.files.state_files import StateFileError
from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage.memmap import MemmapTrajectoryStore
from rlhf_pipeline.storage.zarr import ZarrTrajectoryStore
from rlhf_pipeline.transforms import GroupAdvantage
from rlhf_pipeline.transforms.pending_groups import PendingGroups

SCHEMA = StoreSchema(optional=("advantage",))
PENDING = "collector/pending-shard-0000"


@pytest.fixture(params=["s3", "azure"])
def server(request):
    return request.getfixturevalue(f"{request.param}_server")


def _trajectory_ids(store) -> list[int]:
    store.refresh()
    if store.next_row == 0:
        return []
    return sorted(store.read_global(torch.arange(store.next_row))["trajectory_id"].tolist())


def _machine(server, run_url: str, buffer_url: str) -> tuple[ZarrTrajectoryStore, GroupAdvantage]:
    """What a collector on a machine of its own builds: the shard opened for appending and a fresh
    run store (no ETags remembered), nothing on local disk."""
    store = ZarrTrajectoryStore.open(buffer_url, "a", storage_options=server.options)
    run_store = ObjectRunStore(run_url, storage_options=server.options)
    return store, GroupAdvantage(4, store=store, pending_dir=PENDING, pending_store=run_store)


def test_pending_groups_live_under_the_url_and_another_machine_completes_them(server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_url = server.url("run")
    buffer_url = f"{run_url}/buffer/shard-0000"
    ZarrTrajectoryStore.create(buffer_url, SCHEMA, storage_options=server.options).close()
    batch = make_batch(2, 4)
    store, ga = _machine(server, run_url, buffer_url)
    assert ga.write(batch.select([0, 1, 4])) is None
    assert ga.pending.location == f"{run_url}/{PENDING}/state.pt"
    assert f"{PENDING}/state.pt" in server.keys(run_url)
    store.close()  # the machine goes away; its successor has only the URL

    store, again = _machine(server, run_url, buffer_url)
    assert sorted(again.pending.trajectory_ids().tolist()) == [0, 1, 4]
    assert again.metrics()["rows_in"] == 3  # the counters travel with the snapshot
    store.append(again.write(batch.select([2, 3])))
    assert _trajectory_ids(store) == [0, 1, 2, 3]
    assert sorted(again.pending.trajectory_ids().tolist()) == [4]
    store.close()
    assert list(tmp_path.iterdir()) == []  # nothing written beside the process


def test_a_crash_between_transform_and_append_at_a_url_neither_loses_nor_doubles(server):
    run_url = server.url("run")
    buffer_url = f"{run_url}/buffer/shard-0000"
    ZarrTrajectoryStore.create(buffer_url, SCHEMA, storage_options=server.options).close()
    batch = make_batch(2, 4)
    store, ga = _machine(server, run_url, buffer_url)
    ga.write(batch.select([0, 1, 4]))
    assert len(ga.write(batch.select([2, 3]))) == 4  # group 0 complete; the append never happens
    store.close()

    store, restarted = _machine(server, run_url, buffer_url)
    assert sorted(restarted.pending.trajectory_ids().tolist()) == [0, 1, 4]  # the held rows are back
    store.append(restarted.write(batch.select([2, 3, 5])))  # the unacknowledged rows, sent again
    store.close()

    store, after_append = _machine(server, run_url, buffer_url)  # the append happened: settled as written
    assert sorted(after_append.pending.trajectory_ids().tolist()) == [4, 5]
    store.append(after_append.write(batch.select([6, 7])))
    assert _trajectory_ids(store) == list(range(8))  # every row once
    store.close()


def test_a_superseded_writer_is_refused_and_does_not_overwrite_its_successor(server, tmp_path):
    store = MemmapTrajectoryStore.create(tmp_path / "buf", SCHEMA, durable=False)
    run_url = server.url("run")
    batch = make_batch(3, 4)
    old = GroupAdvantage(4, store=store, pending_dir=PENDING,
                         pending_store=ObjectRunStore(run_url, storage_options=server.options))
    old.write(batch.select([0, 1]))
    # a restart elsewhere while the old process still runs: it loads the snapshot and takes it over
    new = GroupAdvantage(4, store=store, pending_dir=PENDING,
                         pending_store=ObjectRunStore(run_url, storage_options=server.options))
    new.write(batch.select([4, 5]))
    with pytest.raises(StaleWriterError, match=f"{PENDING}/state.pt was replaced by another writer"):
        old.write(batch.select([8]))
    fresh = PendingGroups(store=store, directory=PENDING,
                          run_store=ObjectRunStore(run_url, storage_options=server.options))
    assert sorted(fresh.trajectory_ids().tolist()) == [0, 1, 4, 5]  # the successor's snapshot stands
    store.close()


def test_an_object_that_would_run_code_is_refused(server, tmp_path):
    run_url = server.url("run")
    run_store = ObjectRunStore(run_url, storage_options=server.options)
    # a torch file whose unpickling would call a function: what someone with write access could plant
    run_store.write(f"{PENDING}/state.pt", lambda f: torch.save({"format_version": 1, "rows": print}, f), fence=False)
    store = MemmapTrajectoryStore.create(tmp_path / "buf", SCHEMA, durable=False)
    with pytest.raises(StateFileError, match=f"refusing to load the pending-group state {run_url}/{PENDING}/state.pt"):
        GroupAdvantage(4, store=store, pending_dir=PENDING, pending_store=run_store)
    store.close()


def test_a_run_store_needs_the_key_prefix(tmp_path):
    from rlhf_pipeline.files.run_store import LocalRunStore

    with pytest.raises(ValueError, match="needs directory="):
        PendingGroups(run_store=LocalRunStore(tmp_path))


def test_in_a_directory_the_snapshot_is_the_file_it_always_was(tmp_path):
    """``<buffer>/pending/state.pt``, byte for byte what ``save_torch_atomic`` wrote before run
    stores existed, and no temporary file left beside it."""
    store = MemmapTrajectoryStore.create(tmp_path / "buf", SCHEMA, durable=False)
    ga = GroupAdvantage(4, store=store)
    ga.write(make_batch(1, 4).select([0, 2]))
    assert ga.pending.location == str(tmp_path / "buf" / "pending" / "state.pt")
    assert sorted(p.name for p in (tmp_path / "buf" / "pending").iterdir()) == ["state.pt"]
    reference = save_torch_atomic(ga.pending.to_payload(), tmp_path / "reference" / "state.pt")
    assert (tmp_path / "buf" / "pending" / "state.pt").read_bytes() == reference.read_bytes()
    store.close()
