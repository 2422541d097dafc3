"""The lease object that holds a run at a URL (``files/run_lease.py``) on moto's S3 server and on
Azurite: one holder at a time, named in the refusal; a dead holder's lease taken over; a holder that was
taken over learns it at its next renewal."""

from __future__ import annotations

import json
import time

import pytest

from rlhf_pipeline.files.object_run_store import ObjectRunStore
from rlhf_pipeline.files.run_lease import LeaseHeldError, ObjectLease


@pytest.fixture(params=["s3", "azure"])
def server(request):
    return request.getfixturevalue(f"{request.param}_server")


@pytest.fixture()
def store(server):
    return ObjectRunStore(server.url("run"), storage_options=server.options)


def test_a_second_holder_is_refused_with_the_first_ones_details(store):
    with ObjectLease(store, "run.lock", record={"command": "run"}), \
            pytest.raises(LeaseHeldError, match=r"`run` \(pid \d+ on host .*lease 30"):
        ObjectLease(store, "run.lock", record={"command": "learn"}).acquire()
    assert not store.exists("run.lock")  # released
    ObjectLease(store, "run.lock").acquire().release()


def test_a_lease_nobody_renews_is_taken_over_once_it_ran_out(store):
    # a holder on another machine that died: nothing on this host can tell, only the lease's age
    store.write("run.lock", json.dumps({"pid": 1, "host": "elsewhere", "lease_s": 1.0, "command": "run"}).encode())
    time.sleep(2.5)  # the server's clock has whole seconds
    lease = ObjectLease(store, "run.lock", record={"command": "run"}).acquire()
    try:
        assert json.loads(store.read("run.lock"))["token"] == lease._record["token"]
    finally:
        lease.release()


def test_a_holder_on_this_host_that_no_longer_runs_is_taken_over_at_once(store):
    import socket
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)

    store.write("run.lock", json.dumps({"pid": int(gone.stdout), "host": socket.gethostname(),
                                        "lease_s": 600.0}).encode())
    lease = ObjectLease(store, "run.lock").acquire()  # without waiting: a live holder's would raise LeaseHeldError
    try:
        assert json.loads(store.read("run.lock"))["token"] == lease._record["token"]
    finally:
        lease.release()


def test_a_holder_taken_over_learns_it_at_its_next_renewal(store, server):
    first = ObjectLease(store, "run.lock", lease_s=0.6).acquire()
    try:
        other = ObjectRunStore(store.location, storage_options=server.options)
        other.write("run.lock", b'{"token": "someone else"}', fence=False)
        assert first.lost.wait(5.0)
        assert not first.held
    finally:
        first.release()
    assert other.read("run.lock") == b'{"token": "someone else"}'  # not deleted by the holder that lost it
