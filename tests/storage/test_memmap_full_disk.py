"""A memmap append that the disk refuses (a full disk's ENOSPC; here a file size limit's EFBIG, which
the kernel raises alike) names the store, so a command says in one line which disk to free; the rows
published before it stay, and the store appends on once there is room."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage import create_store, open_store

from helpers import make_batch

TESTS = Path(__file__).resolve().parents[1]

# a process of its own: the limit is process-wide; SIGXFSZ would kill it rather than fail the write
APPEND_UNTIL_REFUSED = """
import errno, json, resource, signal, sys
sys.path[:0] = [{tests!r}]
from helpers import make_batch
from rlhf_pipeline.storage import open_store
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
store = open_store({path!r}, mode="a")
resource.setrlimit(resource.RLIMIT_FSIZE, (100 << 10, resource.RLIM_INFINITY))  # past the first 64 KiB growth
for i in range(10_000):
    try:
        store.append(make_batch(4, 4, seed=i))
    except OSError as exc:
        print(json.dumps({{"errno": exc.errno, "filename": exc.filename, "rows": store.next_row}}))
        break
"""


def test_an_append_the_disk_refuses_names_the_store_and_loses_no_published_row(tmp_path):
    path = tmp_path / "shard"
    create_store(path, "memmap", schema=StoreSchema()).close()
    ran = subprocess.run([sys.executable, "-c", APPEND_UNTIL_REFUSED.format(tests=str(TESTS), path=str(path))],
                         capture_output=True, text=True, timeout=300, check=True)
    refused = json.loads(ran.stdout)
    assert refused["errno"] == 27 and refused["filename"] == str(path), refused  # EFBIG, at the store
    assert refused["rows"] > 0  # some appends were published before the limit
    with open_store(path, mode="a") as store:  # room again: nothing published was lost, and it appends on
        assert store.next_row == refused["rows"]
        store.append(make_batch(4, 4, seed=1))
        assert store.next_row == refused["rows"] + 16
        assert len(store.read(list(range(store.next_row)))["reward"]) == store.next_row
