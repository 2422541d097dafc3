"""A reader in another process samples while this process appends: it never sees a torn row."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from backends import BACKENDS
from store_worker import check_rows, checksummed_batch

from rlhf_pipeline.schema import StoreSchema

pytestmark = pytest.mark.slow  # processes of their own (the quick subset leaves it out)

WORKER = Path(__file__).with_name("store_worker.py")


@pytest.mark.parametrize("backend_name", sorted(BACKENDS))
def test_subprocess_reader_never_sees_a_partial_row(backend_name, tmp_path):
    torch.set_num_threads(1)
    backend = BACKENDS[backend_name]
    path = str(tmp_path / "buffer")
    batch_rows = 24
    # small segments and a capacity, so the reader also crosses seals and evictions
    with backend.create(path, StoreSchema(), segment_rows=64, capacity_rows=512) as writer:
        writer.append(checksummed_batch(0, batch_rows))
        reader = subprocess.Popen(
            [sys.executable, str(WORKER), "sample", backend_name, path, "200", "16"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        try:
            first_line = reader.stdout.readline()
            assert first_line.strip() == "ready", first_line + reader.stderr.read()[-3000:]
            # one append per sample the reader reports: they overlap, and the rows stay bounded
            for line in reader.stdout:
                if not line.startswith("sampled"):
                    out = line
                    break
                writer.append(checksummed_batch(writer.next_row, batch_rows))
            else:
                out = ""
            rest, err = reader.communicate(timeout=60)
        finally:
            if reader.poll() is None:
                reader.kill()
                reader.wait()
        assert reader.returncode == 0, out + rest + err[-3000:]
        assert out.startswith("ok samples=200"), out
        distinct_lengths = int(out.split("distinct_lengths=")[1].split()[0])
        assert distinct_lengths > 1, "the reader never saw the store grow while it sampled"
        check_rows(writer.read(torch.arange(len(writer))))
