"""The writer lock passes to a new writer right after the old one is killed with SIGKILL.

The window (see ``rlhf_pipeline/storage/locking.py``): a flock lives as long as any
descriptor of the writer's open lock file, and a process forked from the writer holds one
until it exits or execs, while the lock file still names the killed writer. A new writer
must wait for that handover instead of failing with ``StoreLockedError ... by process N``
naming a process that is already gone.

The stress test runs quick kill -9 / reopen cycles for a few seconds in the suite; run it
for longer by hand with ``python tests/storage/test_lock_handover.py --seconds 600``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for entry in (str(_HERE), str(_HERE.parent)):
    if entry not in sys.path:
        sys.path.insert(0, entry)

import pytest  # noqa: E402

from rlhf_pipeline.storage import locking  # noqa: E402
from rlhf_pipeline.storage.errors import StoreLockedError  # noqa: E402
from rlhf_pipeline.storage.locking import WriterLock  # noqa: E402

STRESS_SECONDS = 2.0
STRESS_MIN_CYCLES = 6  # on a loaded machine the cycles take longer than the seconds

# Takes the lock, forks a child that inherits the open lock file (as a process forked to run a
# subprocess does until its exec), and reports both pids; the child lives for argv[2] seconds.
HOLD_AND_FORK = """
import os, sys, time
from rlhf_pipeline.storage.locking import WriterLock
WriterLock(sys.argv[1]).acquire()
child = os.fork()
if child == 0:
    time.sleep(float(sys.argv[2]))
    os._exit(0)
print(os.getpid(), child, flush=True)
time.sleep(600)
"""


def _killed_writer_with_a_forked_child(path: Path, child_lives_s: float) -> tuple[int, int]:
    writer = subprocess.Popen([sys.executable, "-c", HOLD_AND_FORK, str(path), str(child_lives_s)],
                              stdout=subprocess.PIPE, text=True)
    writer_pid, child_pid = map(int, writer.stdout.readline().split())
    os.kill(writer_pid, signal.SIGKILL)
    writer.wait()  # killed and reaped: only its forked child still holds the lock file open
    writer.stdout.close()
    return writer_pid, child_pid


def test_a_new_writer_waits_for_the_lock_a_killed_writers_child_still_holds(tmp_path):
    path = tmp_path / "writer.lock"
    writer_pid, _ = _killed_writer_with_a_forked_child(path, child_lives_s=0.5)
    assert path.read_text().split()[0] == str(writer_pid)  # the file names the dead writer
    started = time.monotonic()
    with WriterLock(path) as lock:  # waits for the handover instead of naming the dead writer
        assert lock.held
        assert time.monotonic() - started < locking.HANDOVER_WAIT_S + 1


def test_a_lock_a_forked_child_keeps_is_reported_with_the_real_holder(tmp_path, monkeypatch):
    monkeypatch.setattr(locking, "HANDOVER_WAIT_S", 0.3)
    path = tmp_path / "writer.lock"
    writer_pid, child_pid = _killed_writer_with_a_forked_child(path, child_lives_s=30)
    try:
        with pytest.raises(StoreLockedError) as raised:
            WriterLock(path).acquire()
        message = str(raised.value)
        assert f"names process {writer_pid}, which is no longer running" in message
        assert str(child_pid) in message  # the process really holding it, found in /proc
    finally:
        os.kill(child_pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while True:  # the child is gone: the lock is free again
        try:
            WriterLock(path).acquire().release()
            break
        except StoreLockedError:
            assert time.monotonic() < deadline
            time.sleep(0.05)


# ============================================================================ stress
def _writer(path: str, spawn_every: int, ready) -> None:
    """A real store writer: opens for append and appends until killed, now and then starting a
    subprocess (whose fork holds the lock file until its exec, like a collector's tools)."""
    from store_worker import checksummed_batch

    from rlhf_pipeline.storage import open_store

    store = open_store(path, mode="a")
    ready.send(store.next_row)
    appends = 0
    while True:
        store.append(checksummed_batch(store.next_row, 2))
        appends += 1
        if spawn_every and appends % spawn_every == 0:
            subprocess.run(["true"], check=False)


def stress(path: Path, seconds: float, *, min_cycles: int = 1, seed: int = 0, spawn_every: int = 3) -> dict[str, int]:
    """kill -9 / reopen cycles for ``seconds`` (and at least ``min_cycles``): every reopen must get the lock."""
    import torch
    from store_worker import check_rows

    from rlhf_pipeline.storage import create_store, open_store

    torch.set_num_threads(1)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "store_worker", "rlhf_pipeline.storage.memmap.store"])
    create_store(path, "memmap", segment_rows=64).close()
    rng = random.Random(seed)
    counts = {"cycles": 0, "refused": 0, "killed_before_open": 0}
    deadline = None  # set after the first cycle: starting the forkserver (importing torch) is not a cycle
    while deadline is None or time.monotonic() < deadline or counts["cycles"] < min_cycles:
        receive, send = context.Pipe(duplex=False)
        writer = context.Process(target=_writer, args=(str(path), spawn_every, send), daemon=True)
        writer.start()
        send.close()
        if rng.random() < 0.3:  # sometimes while it opens the store and takes the lock
            time.sleep(rng.random() * 0.005)
            counts["killed_before_open"] += not receive.poll(0)
        elif not receive.poll(60):
            raise AssertionError(f"the writer never opened the store (exit code {writer.exitcode})")
        else:
            time.sleep(rng.random() * 0.02)  # mid-append, mid-publish, mid-subprocess
        try:
            os.kill(writer.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        writer.join()
        receive.close()
        if writer.exitcode != -signal.SIGKILL:
            raise AssertionError(f"the writer ended by itself (exit code {writer.exitcode}) before it was killed")
        try:
            with open_store(path, mode="a") as store:  # right after the reap: must not be refused
                check_rows(store.read(list(range(max(0, len(store) - 4), len(store)))))
        except StoreLockedError as exc:
            counts["refused"] += 1
            print(f"refused after kill: {exc}", file=sys.stderr)
        counts["cycles"] += 1
        deadline = deadline or time.monotonic() + seconds
    return counts


def test_kill_and_reopen_cycles_never_see_a_dead_writers_lock(tmp_path):
    counts = stress(tmp_path / "buffer", STRESS_SECONDS, min_cycles=STRESS_MIN_CYCLES)
    assert counts["refused"] == 0, counts


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="kill -9 / reopen stress of the writer lock handover")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--dir", default=None, help="where to create the store (default: a temporary directory)")
    parser.add_argument("--spawn-every", type=int, default=3, help="appends between subprocesses (0: none)")
    args = parser.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        result = stress(Path(scratch) / "buffer", args.seconds, spawn_every=args.spawn_every)
    print(result)
