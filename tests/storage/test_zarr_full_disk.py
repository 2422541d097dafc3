"""A Zarr append on a nearly full disk fails and keeps the store; it never acknowledges a torn record.

The disk fills at every byte of the commit record (``full_disk_worker.py``: a file size limit
armed when the record's temporary file is opened, in a process of its own). Every cut append
must raise an ``OSError`` naming ``zarr.json.partial``, leave the acknowledged ``zarr.json``
byte for byte, and take its unit back; once the record fits, the append goes through and every
row reads back in a fresh reader.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_pipeline.storage.buffers import verify_buffer

pytestmark = pytest.mark.slow  # processes of their own (the quick subset leaves it out)

WORKER = Path(__file__).with_name("full_disk_worker.py")


def test_an_append_whose_record_is_cut_at_any_byte_fails_and_keeps_the_store(tmp_path):
    done = subprocess.run([sys.executable, str(WORKER), str(tmp_path)], capture_output=True, text=True,
                          timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    sweeps = {s["store"]: s for s in map(json.loads, done.stdout.splitlines())}
    assert set(sweeps) == {"fragment", "segment", "not-durable"}
    assert sweeps["fragment"]["cuts"] == sweeps["fragment"]["record_bytes"] > 1000  # every byte of it
    for name in sweeps:
        assert [r.problems for r in verify_buffer(str(tmp_path / name))] == [[]]
