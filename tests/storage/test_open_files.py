"""What a long-lived reader or writer keeps open does not grow with the segments it has read.

A learner samples a buffer that keeps growing for hours; if every segment it ever read kept
its files open, it would die of ``EMFILE`` under the usual ``ulimit -n 1024`` (issue 18).
"""

from __future__ import annotations

import os

import pytest
import torch

from helpers import assert_same_padded, make_batch
from rlhf_pipeline.schema import TrajectoryBatch
from rlhf_pipeline.storage import create_store, open_buffer, open_store
from rlhf_pipeline.storage.sharded import shard_path

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd (Linux)")]

SEGMENTS = 200
ROWS_PER_SEGMENT = 2


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def mappings() -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


def write_segments(location, backend: str, segments: int = SEGMENTS) -> list[TrajectoryBatch]:
    """A store of ``segments`` sealed segments (one batch each); the batches written."""
    batches = [make_batch(1, ROWS_PER_SEGMENT, seed=i, first_group_id=i, first_trajectory_id=2 * i)
               for i in range(segments)]
    options = {"durable": False} if backend == "memmap" else {}
    with create_store(location, backend, segment_rows=ROWS_PER_SEGMENT, **options) as writer:
        before = open_fds()
        for batch in batches:
            writer.append(batch)
        # the writer keeps the open tail's files, never every sealed segment's
        assert open_fds() - before <= 20
    return batches


def read_every_segment(store, batches: list[TrajectoryBatch]) -> None:
    """Reads each segment's rows (one segment at a time, as a sampler over a growing store
    does) and checks them."""
    for i, batch in enumerate(batches):
        rows = torch.arange(i * ROWS_PER_SEGMENT, (i + 1) * ROWS_PER_SEGMENT)
        assert store.read(rows).equal(batch), f"segment {i}"


@pytest.mark.parametrize("backend", ["memmap", "zarr"])
def test_a_reader_of_many_segments_keeps_a_bounded_number_of_files_open(tmp_path, backend):
    batches = write_segments(tmp_path / "s", backend)
    before = open_fds()
    with open_store(tmp_path / "s", "r") as reader:
        read_every_segment(reader, batches)
        read_every_segment(reader, batches)  # again, after whatever the reader let go
        grown = open_fds() - before
    # before the fix a memmap reader kept one descriptor per file of every segment read: 3,600
    assert grown <= 8, f"{grown} more descriptors open after reading {SEGMENTS} segments"


def test_a_memmap_reader_keeps_at_most_mapped_segments_mapped(tmp_path):
    batches = write_segments(tmp_path / "s", "memmap")
    expected = TrajectoryBatch.cat(batches)
    order = torch.randperm(len(expected), generator=torch.Generator().manual_seed(0))
    with open_store(tmp_path / "s", "r", mapped_segments=8) as reader, open_store(tmp_path / "s", "r") as unbounded:
        read_every_segment(reader, batches[:8])
        with_eight = mappings()
        read_every_segment(reader, batches)
        # one batch over every segment, and padded reads: segments unmapped and mapped again
        assert reader.read(order).equal(expected.select(order))
        for start in range(0, len(order), 64):
            rows = order[start:start + 64]
            assert_same_padded(reader.read_padded(rows), unbounded.read_padded(rows))
        unbounded.close()  # its mappings are not the bounded reader's
        grown = mappings() - with_eight
    assert grown <= 16, f"{grown} more mappings after reading {SEGMENTS} segments with 8 mapped at most"


def test_a_sharded_reader_keeps_a_bounded_number_of_files_open(tmp_path):
    buffer = tmp_path / "buffer"
    shards = [write_segments(shard_path(buffer, k), "memmap", segments=SEGMENTS // 2) for k in (0, 1)]
    before = open_fds()
    with open_buffer(buffer) as reader:
        rows = torch.arange(len(reader))
        got = reader.read(rows)
        assert len(got) == SEGMENTS * ROWS_PER_SEGMENT
        for shard, batches in enumerate(shards):
            # the union orders shard 0's rows before shard 1's
            start = shard * (SEGMENTS // 2) * ROWS_PER_SEGMENT
            for i, batch in enumerate(batches):
                part = reader.read(torch.arange(start + i * ROWS_PER_SEGMENT, start + (i + 1) * ROWS_PER_SEGMENT))
                assert part.equal(batch)
        grown = open_fds() - before
    assert grown <= 12, f"{grown} more descriptors open after reading {SEGMENTS} segments of two shards"


@pytest.mark.slow
def test_a_long_run_under_a_low_descriptor_limit_finishes(tmp_path):
    """600 learner-like steps over 150 segments of a store without capacity (each of ~18 files: 20 times
    the descriptor limit's worth), with a collector-like writer in the same process, under ``ulimit -n 128``
    (before the fix: EMFILE at segment ~6), reading anywhere with 16 segments mapped at most (a ninth of
    them)."""
    import re
    import resource
    import subprocess
    import sys
    from pathlib import Path

    limit, mapped_segments = 128, 16

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    worker = Path(__file__).with_name("fd_limit_worker.py")
    result = subprocess.run([sys.executable, str(worker), str(tmp_path / "buffer"), "600", str(mapped_segments)],
                            preexec_fn=low_limit, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    found = re.search(r"segments (\d+) fds (\d+)->(\d+) maps (\d+)->(\d+)", result.stdout)
    assert found, result.stdout
    segments, fds_early, fds_late, maps_early, maps_late = map(int, found.groups())
    assert segments == 151
    assert fds_late <= fds_early + 2
    # one mapping per file of a mapped segment (18 at most), plus the row index's arrays
    assert maps_late <= maps_early + mapped_segments * 18
