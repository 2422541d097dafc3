"""Zarr stores at ``s3://`` URLs against a real S3-compatible server (moto) on loopback.

Append and publish, a reader in another process, a writer killed with ``kill -9`` in a
loop of appends, the leased writer lock (refusal, takeover, fencing of a writer whose
lease was taken over) and the error when the ``s3`` extra is missing.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from store_worker import check_resumes_after_a_kill, check_rows, checksummed_batch

from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage import StoreLockedError, open_store
from rlhf_pipeline.storage.errors import StorageExtraMissingError
from rlhf_pipeline.storage.zarr import ZarrTrajectoryStore

WORKER = Path(__file__).with_name("store_worker.py")


def test_append_publish_and_read_back(s3_server):
    url = s3_server.url()
    with ZarrTrajectoryStore.create(url, StoreSchema(), segment_rows=16, storage_options=s3_server.options) as store:
        for start in range(0, 40, 8):  # fragments, two sealed segments, a tail
            assert store.append(checksummed_batch(start, 8)).tolist() == list(range(start, start + 8))
        # refresh_interval_s=0: every len() re-reads the record (the default reads it at most once a second)
        reader = ZarrTrajectoryStore.open(url, storage_options=s3_server.options, refresh_interval_s=0)
        assert len(reader) == 40
        check_rows(reader.read(torch.arange(40)))
        store.append(checksummed_batch(40, 5))
        assert len(reader) == 45  # refreshed from the commit record
        check_rows(reader.read(torch.arange(40, 45)))
        reader.close()
    keys = s3_server.keys(url)
    assert "zarr.json" in keys and "writer.lock" not in keys  # the lock object goes with the writer
    record = json.loads(s3_server.client().get_object(Bucket=url.split("/")[2], Key=url.split("/", 3)[3] +
                                                        "/zarr.json")["Body"].read())
    assert record["attributes"]["rlhf_pipeline"]["next_row"] == 45
    with pytest.raises(FileExistsError, match="already holds a Zarr node"):
        ZarrTrajectoryStore.create(url, StoreSchema(), storage_options=s3_server.options)


def test_a_reader_in_another_process_sees_new_rows_and_never_a_torn_one(s3_server):
    url = s3_server.url()
    with ZarrTrajectoryStore.create(url, StoreSchema(), segment_rows=32, capacity_rows=128,
                                    storage_options=s3_server.options) as writer:
        writer.append(checksummed_batch(0, 12))
        # the reader finds the server through AWS_ENDPOINT_URL and the AWS credentials variables
        reader = subprocess.Popen([sys.executable, str(WORKER), "sample", "zarr", url, "15", "8"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=s3_server.env())
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


def test_a_writer_killed_mid_append_loses_no_published_row_and_the_next_resumes(s3_server):
    url = s3_server.url()
    ZarrTrajectoryStore.create(url, StoreSchema(), segment_rows=32, storage_options=s3_server.options).close()
    rng = random.Random(7)
    for kill in range(2):
        writer = subprocess.Popen([sys.executable, str(WORKER), "append", "zarr", url, str(rng.randint(3, 20)), "-1"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=s3_server.env())
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
            lambda: ZarrTrajectoryStore.open(url, "a", storage_options=s3_server.options),
            lambda: ZarrTrajectoryStore.open(url, storage_options=s3_server.options),
            published, f"kill {kill}",
        )


def test_the_lock_refuses_a_live_writer_and_a_taken_over_writer_publishes_nothing(s3_server):
    url = s3_server.url()
    options = s3_server.options
    first = ZarrTrajectoryStore.create(url, StoreSchema(), segment_rows=16, storage_options=options, lock_lease_s=1)
    first.append(checksummed_batch(0, 4))
    time.sleep(2.5)  # past the lease: renewals keep it
    with pytest.raises(StoreLockedError, match=r"already open for writing by process \d+ on .*lease: 1 s"):
        ZarrTrajectoryStore.open(url, "a", storage_options=options, lock_lease_s=1)

    # the first writer stops renewing (a process paused, a partition) and its lease runs out
    first._lock._stop.set()
    first._lock._thread.join()
    time.sleep(2.5)  # the server's clock has whole seconds
    second = ZarrTrajectoryStore.open(url, "a", storage_options=options, lock_lease_s=1)
    second.append(checksummed_batch(4, 4))
    with pytest.raises(StoreLockedError, match="another writer replaced the commit record"):
        first.append(checksummed_batch(4, 6))  # fenced: its publish fails, its rows stay invisible
    second.append(checksummed_batch(8, 4))
    second.close()
    first.close()  # its tail merge cannot publish either; the lock object is the second writer's
    with open_store(url, storage_options=options) as reader:
        assert reader.next_row == 12
        check_rows(reader.read(torch.arange(12)))


def test_a_missing_s3_extra_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "s3fs", None)  # as if s3fs were not installed
    with pytest.raises(StorageExtraMissingError, match=r"pip install -e '\.\[s3\]'"):
        ZarrTrajectoryStore.open("s3://some-bucket/buffer")
