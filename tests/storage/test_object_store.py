"""Zarr stores at ``s3://`` and ``az://`` URLs, one suite for both clouds: moto's S3 server and
Azurite (the Azure Blob Storage emulator) on loopback, through the same code (only
``files/cloud_objects.py`` knows which cloud it talks to). A URL prefix of shards on S3 is in
``test_object_store_shards.py``.

On both clouds: append and publish, a reader in another process, a writer killed with ``kill -9``
in a loop of appends, the leased writer lock (refusal, takeover, fencing of a writer whose lease
was taken over) and the error when the cloud's extra is missing. On Azure also: waiting out a dead
holder's lease on the server's clock, a URL prefix of shards read as their union and inspected by
the CLI, and the errors for a missing container and missing credentials. The ``az://`` cases skip,
saying what to install, without the ``azure`` extra or Azurite.
"""

from __future__ import annotations

import json
import logging
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from store_worker import check_resumes_after_a_kill, check_rows, checksummed_batch
import preloaded
from helpers import a_holder_that_dies_once_waited_on

from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage import NotAStoreError, StoreLockedError, open_buffer, open_store
from rlhf_pipeline.storage.buffers import list_shards
from rlhf_pipeline.storage.errors import StorageExtraMissingError, StoreError, StoreNotFoundError
from rlhf_pipeline.storage.zarr import ZarrTrajectoryStore

WORKER = Path(__file__).with_name("store_worker.py")
REPO = Path(__file__).resolve().parents[2]
# the kill test's draws, one seed per cloud (as when each cloud had its own suite)
KILL_SEEDS = {"s3": 7, "az": 11}


@pytest.fixture(params=["s3", "azure"])
def server(request):
    return request.getfixturevalue(f"{request.param}_server")


def test_append_publish_and_read_back(server):
    url, options = server.url(), server.options
    with ZarrTrajectoryStore.create(url, StoreSchema(), segment_rows=16, storage_options=options) as store:
        for start in range(0, 40, 8):  # fragments, two sealed segments, a tail
            assert store.append(checksummed_batch(start, 8)).tolist() == list(range(start, start + 8))
        # refresh_interval_s=0: every len() re-reads the record (the default reads it at most once a second)
        reader = ZarrTrajectoryStore.open(url, storage_options=options, refresh_interval_s=0)
        assert len(reader) == 40
        check_rows(reader.read(torch.arange(40)))
        store.append(checksummed_batch(40, 5))
        assert len(reader) == 45  # refreshed from the commit record
        check_rows(reader.read(torch.arange(40, 45)))
        reader.close()
    keys = server.keys(url)
    assert "zarr.json" in keys and "writer.lock" not in keys  # the lock object goes with the writer
    record = json.loads(server.get(url, "zarr.json"))
    assert record["attributes"]["rlhf_pipeline"]["next_row"] == 45
    with pytest.raises(FileExistsError, match="already holds a Zarr node"):
        ZarrTrajectoryStore.create(url, StoreSchema(), storage_options=options)


def test_a_reader_in_another_process_sees_new_rows_and_never_a_torn_one(server):
    url = server.url()
    with ZarrTrajectoryStore.create(url, StoreSchema(), segment_rows=32, capacity_rows=128,
                                    storage_options=server.options) as writer:
        writer.append(checksummed_batch(0, 12))
        # the reader finds the server through the environment: the AWS variables (AWS_ENDPOINT_URL
        # and credentials), or AZURE_STORAGE_CONNECTION_STRING
        reader = subprocess.Popen([sys.executable, str(WORKER), "sample", "zarr", url, "15", "8"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=server.env())
        try:
            first = reader.stdout.readline()
            assert first.strip() == "ready", first + reader.stderr.read()[-3000:]
            out = ""
            for line in reader.stdout:
                if not line.startswith("sampled"):
                    out = line
                    break
                writer.append(checksummed_batch(writer.next_row, 12))  # crosses seals and evictions
            rest, err = reader.communicate(timeout=120)
        finally:
            if reader.poll() is None:
                reader.kill()
                reader.wait()
        assert reader.returncode == 0, out + rest + err[-3000:]
        assert out.startswith("ok samples=15"), out
        assert int(out.split("distinct_lengths=")[1].split()[0]) > 1, "the reader never saw the store grow"


def test_a_writer_killed_mid_append_loses_no_published_row_and_the_next_resumes(server):
    url, options = server.url(), server.options
    ZarrTrajectoryStore.create(url, StoreSchema(), segment_rows=32, storage_options=options).close()
    rng = random.Random(KILL_SEEDS[url.split("://")[0]])
    for kill in range(2):
        writer = subprocess.Popen([sys.executable, str(WORKER), "append", "zarr", url, str(rng.randint(3, 20)), "-1"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=server.env())
        published = 0
        for _ in range(rng.randint(2, 12)):
            line = writer.stdout.readline()
            assert line.startswith("published"), f"kill {kill}: {line!r} {writer.stderr.read()[-3000:] if not line else ''}"
            published = int(line.split()[1])
        time.sleep(rng.random() * 0.05)  # somewhere in the next append's requests
        writer.send_signal(signal.SIGKILL)
        writer.communicate()
        assert writer.returncode == -signal.SIGKILL

        # the dead writer's lock names a pid of this host that no longer runs: taken over at once
        check_resumes_after_a_kill(
            lambda: ZarrTrajectoryStore.open(url, "a", storage_options=options),
            lambda: ZarrTrajectoryStore.open(url, storage_options=options),
            published, f"kill {kill}",
        )


def test_the_lock_refuses_a_live_writer_and_a_taken_over_writer_publishes_nothing(server):
    url, options = server.url(), server.options
    # a lease of 3 s, renewed every 1 s: the server dates the lock in whole seconds, so a shorter one
    # could read as run out whenever a loaded machine held one renewal back by half a second
    first = ZarrTrajectoryStore.create(url, StoreSchema(), segment_rows=16, storage_options=options, lock_lease_s=3)
    first.append(checksummed_batch(0, 4))
    time.sleep(4)  # past the lease: renewals keep it
    with pytest.raises(StoreLockedError, match=r"already open for writing by process \d+ on .*lease: 3 s"):
        ZarrTrajectoryStore.open(url, "a", storage_options=options, lock_lease_s=3)

    # the first writer stops renewing (a process paused, a partition) and its lease runs out
    first._lock._stop.set()
    first._lock._thread.join()
    time.sleep(4.5)  # the lease and a second more: the server's clock has whole seconds
    second = ZarrTrajectoryStore.open(url, "a", storage_options=options, lock_lease_s=3)
    second.append(checksummed_batch(4, 4))
    with pytest.raises(StoreLockedError, match="another writer replaced the commit record"):
        first.append(checksummed_batch(4, 6))  # fenced: its publish fails, its rows stay invisible
    second.append(checksummed_batch(8, 4))
    second.close()
    first.close()  # its tail merge cannot publish either; the lock object is the second writer's
    with open_store(url, storage_options=options) as reader:
        assert reader.next_row == 12
        check_rows(reader.read(torch.arange(12)))


@pytest.mark.parametrize(("url", "package", "message"), [
    ("s3://some-bucket/buffer", "s3fs", r"pip install -e '\.\[s3\]'"),
    ("az://some-container/buffer", "adlfs", r"Azure Blob Storage.*'adlfs'.*pip install -e '\.\[azure\]'"),
], ids=["s3", "azure"])
def test_a_missing_extra_says_how_to_install_it(monkeypatch, url, package, message):
    monkeypatch.setitem(sys.modules, package, None)  # as if the cloud's package were not installed
    with pytest.raises(StorageExtraMissingError, match=message):
        ZarrTrajectoryStore.open(url)


# ---------------------------------------------------------------------------- Azure only
def test_a_writer_waits_out_the_lease_of_one_that_died_on_another_machine(azure_server, caplog):
    url, options = azure_server.url(), azure_server.options
    with ZarrTrajectoryStore.create(url, StoreSchema(), segment_rows=16, storage_options=options) as store:
        store.append(checksummed_batch(0, 8))
    holder = {"owner": "f" * 32, "pid": 4242, "host": "collector-node-7", "lease_s": 60, "renewal": 0}
    azure_server.put(url, "writer.lock", json.dumps(holder).encode())  # never renewed

    with pytest.raises(StoreLockedError, match=r"process 4242 on collector-node-7 .*lock_wait_s="):
        ZarrTrajectoryStore.open(url, "a", storage_options=options)  # no wait: refused at once

    # a short lease (its age is the server's since the holder's last PUT), renewed until the writer waits
    caplog.set_level(logging.WARNING, logger="rlhf_pipeline.storage.zarr.object_store")
    with a_holder_that_dies_once_waited_on(
            lambda: azure_server.put(url, "writer.lock", json.dumps({**holder, "lease_s": 3}).encode())):
        with ZarrTrajectoryStore.open(url, "a", storage_options=options, lock_wait_s=30) as store:
            store.append(checksummed_batch(8, 8))
            check_rows(store.read(torch.arange(16)))
    lines = [r.getMessage() for r in caplog.records]
    waiting = [line for line in lines if "waiting for the writer lock of process 4242 on collector-node-7" in line]
    assert waiting and "its lease runs out at" in waiting[0], lines  # the age came from the server's clock
    assert any("took over the writer lock of process 4242" in line and "not renewed for" in line
               for line in lines), lines


def test_a_url_prefix_of_shards_reads_as_their_union_and_the_cli_inspects_it(azure_server):
    prefix, options = azure_server.url("buffer"), azure_server.options
    for index, (start, rows) in enumerate([(0, 10), (100, 6)]):
        with ZarrTrajectoryStore.create(f"{prefix}/shard-{index:04d}", StoreSchema(), segment_rows=16,
                                        storage_options=options) as store:
            store.append(checksummed_batch(start, rows))
    assert [i for i, _ in list_shards(prefix + "/", options)] == [0, 1]

    reader = open_buffer(prefix + "/", storage_options=options, refresh_interval_s=3600)
    assert reader.backend_name == "sharded" and len(reader) == 16
    rows = reader.read(torch.arange(16))
    check_rows(rows)
    assert rows["trajectory_id"].tolist() == list(range(10)) + list(range(100, 106))  # shard order
    with ZarrTrajectoryStore.create(f"{prefix}/shard-0002", StoreSchema(), segment_rows=16,
                                    storage_options=options) as store:  # a collector started later
        store.append(checksummed_batch(200, 4))
    assert reader.refresh(force=True) == 20 and sorted(reader.shards) == [0, 1, 2]
    reader.close()

    out = preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "inspect", prefix + "/", "--json"],
                        check=False, cwd=REPO, env=azure_server.env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    stats = json.loads(out.stdout)
    assert stats["backend"] == "sharded" and stats["extra"]["shards"] == 3 and stats["rows"] == 20


def test_a_missing_container_or_refused_credentials_say_what_to_do(azure_server):
    from azurite_server import connection_string

    with pytest.raises(StoreNotFoundError, match=r"container 'no-such-container' does not exist.*create it"):
        ZarrTrajectoryStore.create("az://no-such-container/buffer", StoreSchema(), storage_options=azure_server.options)
    wrong_key = {"connection_string": connection_string(azure_server.endpoint, key="A" * 86 + "==")}
    with pytest.raises(StoreError, match=r"was denied .*AZURE_STORAGE_CONNECTION_STRING"):
        ZarrTrajectoryStore.create(azure_server.url(), StoreSchema(), storage_options=wrong_key)


def test_no_credentials_at_all_say_where_they_come_from(azure_server, monkeypatch):
    import adlfs

    for name in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME"):
        monkeypatch.delenv(name, raising=False)
    # as in a fresh process: fsspec keeps one file system per set of options, so one an earlier test
    # made from the environment's credentials (the same empty options) would answer instead
    adlfs.AzureBlobFileSystem.clear_instance_cache()
    with pytest.raises(NotAStoreError, match=r"cannot open az://.* on Azure Blob Storage .*AZURE_STORAGE_CONNECTION_STRING"):
        ZarrTrajectoryStore.open(azure_server.url())
