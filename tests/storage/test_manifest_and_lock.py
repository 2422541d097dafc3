"""The shared building blocks of local stores: atomic JSON publish, state slots, the writer lock."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from rlhf_pipeline.storage.base import NotAStoreError, StoreCorruptedError, StoreLockedError
from rlhf_pipeline.storage.locking import WriterLock
from rlhf_pipeline.files.atomic import publish_json
from rlhf_pipeline.storage.manifest import IncompatibleStoreError, ManifestWatcher, check_header, read_json
from rlhf_pipeline.storage.memmap.state_slots import StateSlots


def test_publish_json_replaces_atomically_and_leaves_no_partial(tmp_path):
    path = tmp_path / "manifest.json"
    watcher = ManifestWatcher(path)
    publish_json(path, {"n": 1})
    assert watcher.changed() and watcher.read() == {"n": 1} and not watcher.changed()
    publish_json(path, {"n": 2}, durable=False)
    assert watcher.changed() and watcher.read() == {"n": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]
    watcher.close()


def test_read_json_names_missing_and_damaged_files(tmp_path):
    with pytest.raises(NotAStoreError, match="manifest.json is missing"):
        read_json(tmp_path / "manifest.json")
    (tmp_path / "manifest.json").write_text("[1, 2")
    with pytest.raises(StoreCorruptedError, match="not valid JSON"):
        read_json(tmp_path / "manifest.json")
    with pytest.raises(IncompatibleStoreError, match="'zarr' store, not 'memmap'"):
        check_header({"backend": "zarr", "format_version": 1}, "x", backend="memmap", format_version=1)


def test_state_slots_fall_back_on_a_torn_slot_and_never_go_back(tmp_path):
    slots = StateSlots(tmp_path)
    assert slots.latest() is None
    slots.publish(1, {"rows": 10})
    slots.publish(2, {"rows": 20})
    reader = StateSlots(tmp_path)
    assert reader.latest() == (2, {"rows": 20})
    assert reader.latest(after=2) is None
    # a slot damaged after publish 3 (a flipped byte: its CRC fails, its header claims 3)
    slots.publish(3, {"rows": 30})
    torn = bytearray(slots.paths[1].read_bytes())
    torn[-3] ^= 0x20
    slots.paths[1].write_bytes(bytes(torn))
    reading = StateSlots(tmp_path).read()
    assert (reading.seq, reading.state) == (2, {"rows": 20})
    assert [(d.path, d.claimed_seq) for d in reading.damaged] == [(slots.paths[1], 3)]  # reported, not hidden
    assert reader.latest(after=2) is None  # a reader that saw 2 keeps it
    slots.publish(3, {"rows": 30})  # the writer, reopened, redoes publish 3
    assert reader.latest(after=2) == (3, {"rows": 30})
    json.dumps(reader.latest())  # plain JSON types only
    for s in (slots, reader):
        s.close()


def test_a_writer_killed_mid_publish_leaves_the_old_header_so_no_damage_is_reported(tmp_path):
    slots = StateSlots(tmp_path)
    slots.publish(1, {"rows": 10})
    slots.publish(2, {"rows": 20})
    # publish 3 goes to slot 1 payload first: killed before its header, the slot still claims 1
    record = bytearray(slots.paths[1].read_bytes())
    payload = json.dumps({"rows": 30, "pad": "x" * 40}).encode()
    record[24:24 + len(payload)] = payload
    slots.paths[1].write_bytes(bytes(record))
    reading = StateSlots(tmp_path).read()
    assert (reading.seq, reading.state, reading.damaged) == (2, {"rows": 20}, ())
    slots.close()


HOLD_LOCK = """
import sys, time
from rlhf_pipeline.storage.locking import WriterLock
WriterLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(600)
"""


def test_writer_lock_names_the_holder_and_dies_with_it(tmp_path):
    path = tmp_path / "writer.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(StoreLockedError, match=f"process {holder.pid}"):
            WriterLock(path).acquire()
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        holder.stdout.close()
    with WriterLock(path) as lock:  # kill -9 released it: no stale lock
        assert lock.held
        with pytest.raises(StoreLockedError, match=f"process {os.getpid()}"):
            WriterLock(path).acquire()  # a second open file in the same process is refused too
    assert not lock.held
