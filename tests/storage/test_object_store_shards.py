"""Object-storage follow-ups against moto's S3 server on loopback: a URL prefix of shards read
as their union, the reader's refresh throttle, and a writer waiting out another's lease.
"""

from __future__ import annotations

import json
import logging
import re
import time

import pytest
import torch
from store_worker import check_rows, checksummed_batch
from helpers import a_holder_that_dies_once_waited_on

from s3_server import BUCKET

from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage import StoreLockedError, open_buffer
from rlhf_pipeline.storage.buffers import list_shards
from rlhf_pipeline.storage.zarr import ZarrTrajectoryStore


def _shard(s3_server, prefix: str, index: int, start: int, rows: int) -> None:
    with ZarrTrajectoryStore.create(f"{prefix}/shard-{index:04d}", StoreSchema(), segment_rows=16,
                                    storage_options=s3_server.options) as store:
        store.append(checksummed_batch(start, rows))


def test_a_url_prefix_of_shards_reads_as_their_union_and_picks_up_new_shards(s3_server):
    prefix = s3_server.url("buffer")
    _shard(s3_server, prefix, 0, 0, 10)
    _shard(s3_server, prefix, 1, 100, 6)
    assert [i for i, _ in list_shards(prefix + "/", s3_server.options)] == [0, 1]

    reader = open_buffer(prefix + "/", storage_options=s3_server.options, refresh_interval_s=3600)
    assert reader.backend_name == "sharded" and sorted(reader.shards) == [0, 1]
    assert len(reader) == 16
    rows = reader.read(torch.arange(16))
    check_rows(rows)
    assert rows["trajectory_id"].tolist() == list(range(10)) + list(range(100, 106))  # shard order
    with pytest.raises(Exception, match="read-only union of shards"):
        reader.append(checksummed_batch(0, 1))

    _shard(s3_server, prefix, 2, 200, 4)  # a collector started later
    assert len(reader) == 16  # asked again within refresh_interval_s: nothing listed or read
    assert reader.refresh(force=True) == 20 and sorted(reader.shards) == [0, 1, 2]
    check_rows(reader.read(torch.arange(20)))
    assert reader.stats().rows == 20
    reader.close()



def test_the_shards_of_a_url_buffer_refresh_together_not_one_after_another(s3_server, tmp_path):
    """Each shard's commit-record GET waits on a barrier that only opens when all of them are in
    flight at once: one after another, the first would wait alone and the barrier break."""
    import threading

    prefix = s3_server.url("buffer")
    shards = 6
    for index in range(shards):
        _shard(s3_server, prefix, index, 100 * index, 3 + index)
    together = open_buffer(prefix + "/", storage_options=s3_server.options, refresh_interval_s=3600)
    one_by_one = open_buffer(prefix + "/", storage_options=s3_server.options, refresh_interval_s=3600,
                             refresh_threads=1)
    rows = sum(3 + index for index in range(shards))
    assert len(together) == len(one_by_one) == rows
    assert torch.equal(together.read(torch.arange(rows))["trajectory_id"],
                       one_by_one.read(torch.arange(rows))["trajectory_id"])

    def gated(reader, barrier):
        for store in reader.shards.values():
            refresh = store.refresh

            def waiting_refresh(*args, _refresh=refresh, **kwargs):
                barrier.wait()
                return _refresh(*args, **kwargs)

            store.refresh = waiting_refresh

    gated(together, threading.Barrier(shards, timeout=10))
    _shard(s3_server, prefix, 0 + shards, 900, 2)  # a new shard: opened alongside, not gated
    assert together.refresh(force=True) == rows + 2
    gated(one_by_one, threading.Barrier(shards, timeout=0.5))
    with pytest.raises(threading.BrokenBarrierError):
        one_by_one.refresh(force=True)
    together.close()
    one_by_one.close()

    local = tmp_path / "buffer"
    with ZarrTrajectoryStore.create(str(local / "shard-0000"), StoreSchema(), segment_rows=16) as store:
        store.append(checksummed_batch(0, 2))
    reader = open_buffer(str(local))
    assert reader._pool is None  # local shards refresh from the page cache, on the calling thread
    reader.close()



def test_one_refresh_of_a_url_buffer_sends_one_list_and_one_get_per_shard(s3_server):
    """docs/scaling.md's request model, counted on the server: nothing more. (s3fs sends a HEAD
    before each whole-object GET unless max_concurrency is 1: twice the requests.)"""
    prefix = s3_server.url("buffer")
    for index in range(3):
        _shard(s3_server, prefix, index, 100 * index, 4)
    reader = open_buffer(prefix + "/", storage_options=s3_server.options, refresh_interval_s=3600)
    with s3_server.requests.recording() as sent:
        assert reader.refresh(force=True) == 12
    reader.close()
    methods = sorted(method for method, _ in sent)
    assert methods == ["GET"] * 4, sent
    assert sum("list-type=2" in path for _, path in sent) == 1
    assert sorted(path for _, path in sent if path.endswith("/zarr.json")) == sorted(
        f"{prefix.removeprefix('s3:/')}/shard-{index:04d}/zarr.json" for index in range(3))


def test_a_reader_rereads_the_commit_record_at_most_once_per_refresh_interval(s3_server):
    url = s3_server.url()
    with ZarrTrajectoryStore.create(url, StoreSchema(), segment_rows=16, storage_options=s3_server.options) as writer:
        writer.append(checksummed_batch(0, 8))
        default = ZarrTrajectoryStore.open(url, storage_options=s3_server.options)
        assert default.refresh_interval_s == 1.0  # an object store's default; 0 for local stores
        hourly = ZarrTrajectoryStore.open(url, storage_options=s3_server.options, refresh_interval_s=3600)
        short = ZarrTrajectoryStore.open(url, storage_options=s3_server.options, refresh_interval_s=0.2)
        every_time = ZarrTrajectoryStore.open(url, storage_options=s3_server.options, refresh_interval_s=0)
        writer.append(checksummed_batch(8, 8))
        assert len(every_time) == 16
        assert len(hourly) == 8  # the record was read less than an hour ago: not again
        assert hourly.refresh(force=True) == 16
        time.sleep(0.3)
        assert len(short) == 16  # its interval has passed: read again
        check_rows(short.read(torch.arange(16)))
        for reader in (default, hourly, short, every_time):
            reader.close()
    with pytest.raises(ValueError, match="refresh_interval_s must be >= 0"):
        ZarrTrajectoryStore.open(url, storage_options=s3_server.options, refresh_interval_s=-1)


def _fake_holder(s3_server, url: str, lease_s: float) -> None:
    """A writer lock held by a process on another machine, which will never renew it."""
    bucket, key = url.split("/", 3)[2], url.split("/", 3)[3] + "/writer.lock"
    body = {"owner": "f" * 32, "pid": 4242, "host": "collector-node-7", "lease_s": lease_s, "renewal": 0}
    s3_server.client().put_object(Bucket=bucket, Key=key, Body=json.dumps(body).encode())


def test_a_writer_waits_out_the_lease_of_one_that_died_on_another_machine(s3_server, caplog):
    url = s3_server.url()
    with ZarrTrajectoryStore.create(url, StoreSchema(), segment_rows=16, storage_options=s3_server.options) as store:
        store.append(checksummed_batch(0, 8))
    _fake_holder(s3_server, url, lease_s=60)

    with pytest.raises(StoreLockedError, match=r"process 4242 on collector-node-7 .*lock_wait_s="):
        ZarrTrajectoryStore.open(url, "a", storage_options=s3_server.options)  # no wait: refused at once

    caplog.set_level(logging.WARNING, logger="rlhf_pipeline.storage.zarr.object_store")
    with a_holder_that_dies_once_waited_on(lambda: _fake_holder(s3_server, url, lease_s=2)):
        with ZarrTrajectoryStore.open(url, "a", storage_options=s3_server.options, lock_wait_s=30) as store:
            store.append(checksummed_batch(8, 8))
            check_rows(store.read(torch.arange(16)))
    lines = [r.getMessage() for r in caplog.records]
    waiting = [line for line in lines if "waiting for the writer lock of process 4242 on collector-node-7" in line]
    assert waiting and "its lease runs out at" in waiting[0] and "UTC" in waiting[0], lines
    assert any("took over the writer lock of process 4242" in line for line in lines), lines


def test_a_live_writer_keeps_its_lock_through_a_waiting_writer(s3_server):
    url = s3_server.url()
    with ZarrTrajectoryStore.create(url, StoreSchema(), segment_rows=16, storage_options=s3_server.options,
                                    lock_lease_s=3) as holder:
        started = time.monotonic()
        # the server dates the lock in whole seconds: with a lease of 3 s (renewed every 1 s) a loaded
        # machine must hold a renewal back ~2 s before the waiter may take the lock for abandoned
        with pytest.raises(StoreLockedError, match=r"waited 4 s for it: lock_wait_s"):
            ZarrTrajectoryStore.open(url, "a", storage_options=s3_server.options, lock_wait_s=4)
        assert time.monotonic() - started >= 4  # longer than the lease, renewed: never abandoned
        holder.append(checksummed_batch(0, 4))  # still the writer: not fenced
        assert len(holder) == 4


def test_a_shard_whose_creation_was_killed_is_skipped_as_being_made_and_a_damaged_one_is_loud(s3_env, s3_server,
                                                                                               tmp_path, capsys):
    """A collector killed while it makes its shard at a URL (no rename there) leaves a prefix with no
    commit record. Its ``creating`` marker tells readers (the learner's union, ``inspect``, ``convert``)
    it is a store being made, skipped as a local ``shard-NNNN.creating`` is; its next start makes it.
    A shard that lost its record but holds units is damage, and stays loud."""
    import subprocess
    import sys

    from s3_faults import FaultyProxy

    from rlhf_pipeline.cli.main import main
    from rlhf_pipeline.storage import StoreCorruptedError, create_store
    from rlhf_pipeline.storage.buffers import shard_location

    buffer = s3_server.url("buffer")
    with create_store(shard_location(buffer, 0), "zarr", segment_rows=16) as writer:
        writer.append(checksummed_batch(0, 10))
    made = shard_location(buffer, 1)
    proxy = FaultyProxy(s3_server.endpoint)
    proxy.hold("PUT", f"{made.split('://', 1)[1].split('/', 1)[1]}/zarr.json")  # its first commit record
    creating = ("import sys; from rlhf_pipeline.storage import create_store; "
                "create_store(sys.argv[1], 'zarr', storage_options={'endpoint_url': sys.argv[2]})")
    child = subprocess.Popen([sys.executable, "-c", creating, made, proxy.endpoint], env=s3_env)
    try:
        assert proxy.held.wait(timeout=300), "the child never sent its commit record"
    finally:
        child.kill()  # kill -9 while its first commit record is on its way
        child.wait()
        proxy.stop()
    assert "creating" in s3_server.keys(made) and "zarr.json" not in s3_server.keys(made)

    with open_buffer(buffer) as union:  # the learner's reader
        assert list(union.shard_names) == [0] and len(union) == 10
    assert main(["inspect", buffer]) == 0
    out = capsys.readouterr().out
    name = made.rsplit("/", 1)[1]
    assert re.search(rf"shards not open +{name}: .* is being created by process {child.pid}", out), out
    assert main(["convert", buffer, str(tmp_path / "copy"), "--to", "memmap", "--quiet"]) == 0
    assert "not converted" in capsys.readouterr().out

    with create_store(made, "zarr", segment_rows=16) as writer:  # its collector's next start makes it
        writer.append(checksummed_batch(100, 6))
    assert "creating" not in s3_server.keys(made)
    with open_buffer(buffer) as union:
        assert len(union) == 16

    s3_server.client().delete_object(Bucket=BUCKET, Key=f"{made.split(f'{BUCKET}/', 1)[1]}/zarr.json")
    with pytest.raises(StoreCorruptedError, match="zarr.json is missing"):
        open_buffer(buffer)  # the union never reads a damaged shard as one being made
    assert main(["inspect", buffer]) == 2
    assert "zarr.json is missing" in capsys.readouterr().err


def test_a_sealed_segments_fragments_are_deleted_by_their_keys_without_a_listing(s3_server):
    """Each fragment a seal replaces goes in one DeleteObjects naming its two objects: it was a LIST of
    its prefix and then the delete, two requests for every append of a run."""
    url = s3_server.url()
    # a lease renewed only after the test (every third of it): a renewal is requests of its own
    store = ZarrTrajectoryStore.create(url, StoreSchema(), segment_rows=16, storage_options=s3_server.options,
                                       lock_lease_s=3600)
    for start in (0, 5):
        store.append(checksummed_batch(start, 5))
    with s3_server.requests.recording() as sent:
        store.append(checksummed_batch(10, 6))  # completes the segment: sealed, its three fragments replaced
        store.close()  # waits for the seal and the deletes
    assert not [path for _, path in sent if "list-type=2" in path], sent
    assert sum(method == "POST" and path.endswith("?delete") for method, path in sent) == 3, sent
    units = {key.split("/")[1] for key in s3_server.keys(url) if key.startswith("units/") and key.count("/") > 1}
    assert units == {"000000000000000-0000000016s"}, units  # the fragments' objects are gone
    reader = ZarrTrajectoryStore.open(url, storage_options=s3_server.options)
    check_rows(reader.read(torch.arange(16)))
    reader.close()
