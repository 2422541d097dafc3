"""A machine's shared copies of a run's objects (``files/machine_cache.py``): one GET per object
version for every process of a machine (counted on moto's S3 server), copies named by etag (a run
started again at the URL reuses names; on moto and on Azurite), never a torn copy, no stale lock,
and pruning. The processes that
share a cache in ``tests/coordination/test_weights_machine_cache.py`` are collectors' pollers."""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from rlhf_pipeline.files.atomic import PARTIAL_SUFFIX
from rlhf_pipeline.files.machine_cache import LOCK_NAME, MachineCache
from rlhf_pipeline.files.object_run_store import ObjectRunStore, RetryPolicy

FAST_RETRIES = RetryPolicy(attempts=3, first_delay_s=0.01, max_delay_s=0.05, budget_s=20.0)
KEY = "weights/policy_00000001.safetensors"


@pytest.fixture()
def run(s3_server):
    url = s3_server.url("run")
    return url, ObjectRunStore(url, storage_options=s3_server.options, retry=FAST_RETRIES)


@pytest.fixture(params=["s3", "azure"])
def any_cloud(request):
    """A run's store on moto or on Azurite: what a copy's name rests on (the etag) on both clouds."""
    server = request.getfixturevalue(f"{request.param}_server")
    return ObjectRunStore(server.url("run"), storage_options=server.options, retry=FAST_RETRIES)


def weight_gets(entries) -> list[str]:
    return [path for method, path in entries if method == "GET" and "/weights/" in path and "list-type" not in path]


def test_processes_sharing_a_directory_fetch_each_version_once(s3_server, run, tmp_path):
    url, learner = run
    learner.create(KEY, b"version 1")
    etag = learner.list_etags("weights")["policy_00000001.safetensors"]
    # two collectors of one machine: each its own store and cache object, one directory
    first, second = (ObjectRunStore(url, storage_options=s3_server.options) for _ in range(2))
    here = MachineCache(tmp_path / "machine-a")
    with s3_server.requests.recording() as entries:
        copies = [cache.fetch(store, KEY, etag) for cache, store in ((here, first), (MachineCache(here.directory), second))]
        other_machine = MachineCache(tmp_path / "machine-b").fetch(second, KEY, etag)
    assert copies[0] == copies[1] and copies[0].read_bytes() == b"version 1"
    assert other_machine.read_bytes() == b"version 1" and other_machine.parent != copies[0].parent
    assert len(weight_gets(entries)) == 2  # one per machine
    assert copies[0].name.startswith("policy_00000001.") and copies[0].suffix == ".safetensors"


def test_a_run_started_again_at_the_url_is_not_served_the_old_runs_copy(any_cloud, tmp_path):
    store = any_cloud
    cache = MachineCache(tmp_path / "cache")
    store.create(KEY, b"run A's version 1")
    old = cache.fetch(store, KEY, store.list_etags("weights")["policy_00000001.safetensors"])
    store.delete(KEY)
    store.create(KEY, b"run B's version 1")  # same key, same version number
    new = cache.fetch(store, KEY, store.list_etags("weights")["policy_00000001.safetensors"])
    assert new != old and new.read_bytes() == b"run B's version 1"


def test_an_object_replaced_after_the_listing_is_kept_under_its_new_etag(any_cloud, tmp_path):
    store = any_cloud
    cache = MachineCache(tmp_path / "cache")
    store.create(KEY, b"listed")
    listed = store.list_etags("weights")["policy_00000001.safetensors"]
    store.delete(KEY)
    store.create(KEY, b"what the GET returns")
    got = cache.fetch(store, KEY, listed)
    assert got.read_bytes() == b"what the GET returns"
    assert not cache.path_for(KEY, listed).exists()  # the listed etag never names other bytes
    assert got == cache.path_for(KEY, store.list_etags("weights")["policy_00000001.safetensors"])


def test_a_pruned_object_raises_file_not_found(any_cloud, tmp_path):
    store = any_cloud
    with pytest.raises(FileNotFoundError, match="policy_00000001"):
        MachineCache(tmp_path / "cache").fetch(store, KEY, '"gone"')


def test_the_newest_copies_are_kept(any_cloud, tmp_path):
    store = any_cloud
    cache = MachineCache(tmp_path / "cache", keep=2)
    kept = []
    for version in range(4):
        key = f"weights/policy_{version:08d}.safetensors"
        store.create(key, f"version {version}".encode())
        kept.append(cache.fetch(store, key, store.list_etags("weights")[key.split("/")[1]]))
    assert sorted(p.name for p in cache.directory.iterdir() if p.name != LOCK_NAME) == sorted(p.name for p in kept[-2:])


def test_a_partial_copy_of_a_killed_downloader_is_never_read_and_is_removed(any_cloud, tmp_path):
    store = any_cloud
    store.create(KEY, b"the whole object")
    etag = store.list_etags("weights")["policy_00000001.safetensors"]
    cache = MachineCache(tmp_path / "cache")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    cache.directory.mkdir(parents=True)
    torn = cache.directory / f"{cache.path_for(KEY, etag).name}.{dead.pid}{PARTIAL_SUFFIX}"
    torn.write_bytes(b"the who")  # what a kill -9 mid-write leaves
    assert cache.fetch(store, KEY, etag).read_bytes() == b"the whole object"
    assert not torn.exists()


# a downloader stuck in its GET (an endpoint that accepts connections and never answers) that forks a
# child, then is killed: the child keeps the lock alive with the dead downloader's pid in it
DOWNLOADER = textwrap.dedent("""
    import os, signal, sys, threading, time
    from pathlib import Path
    from rlhf_pipeline.files.machine_cache import LOCK_NAME, MachineCache
    from rlhf_pipeline.files.object_run_store import ObjectRunStore

    url, endpoint, directory, child_pid_file = sys.argv[1:]
    store = ObjectRunStore(url, storage_options={"endpoint_url": endpoint, "key": "k", "secret": "s"})
    cache = MachineCache(directory)
    threading.Thread(target=cache.fetch, args=(store, "weights/policy_00000001.safetensors", '"x"'),
                     daemon=True).start()
    lock = Path(directory) / LOCK_NAME
    while not (lock.exists() and lock.read_text().startswith(f"{os.getpid()} ")):
        time.sleep(0.01)
    child = os.fork()
    if child == 0:  # holds every descriptor of its parent, the lock's too
        time.sleep(600)
        os._exit(0)
    Path(child_pid_file).write_text(str(child))
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_downloader_killed_mid_download_blocks_no_one(run, tmp_path):
    url, store = run
    store.create(KEY, b"the whole object")
    etag = store.list_etags("weights")["policy_00000001.safetensors"]
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # connections queue in the backlog; none is ever answered
    child_pid_file = tmp_path / "child.pid"
    cache = MachineCache(tmp_path / "cache")
    downloader = subprocess.Popen([sys.executable, "-c", DOWNLOADER, url, f"http://127.0.0.1:{silent.getsockname()[1]}",
                                   str(cache.directory), str(child_pid_file)])
    child = None
    try:
        assert downloader.wait(timeout=120) == -signal.SIGKILL
        child = int(child_pid_file.read_text())
        fd = os.open(cache.directory / LOCK_NAME, os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):  # still held, by the forked child
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        assert cache.fetch(store, KEY, etag).read_bytes() == b"the whole object"
    finally:
        downloader.kill()
        if child is not None:
            os.kill(child, signal.SIGKILL)
        silent.close()


def test_a_copy_is_named_by_the_etag_however_it_is_quoted(tmp_path):
    cache = MachineCache(tmp_path)
    assert cache.path_for(KEY, '"0x8D1"') == cache.path_for(KEY, "0x8D1") == cache.path_for(KEY, 'W/"0x8D1"')
    assert cache.path_for(KEY, '"0x8D1"') != cache.path_for(KEY, '"0x8D2"')
    assert cache.path_for("weights/policy_00000002.pt", "x").name.endswith(".pt")  # loaded by its suffix
