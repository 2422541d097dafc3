"""``TrajectoryStore.unit_bounds()``: the position ranges a backend reads as a whole, on real stores."""

from __future__ import annotations

import pytest
import torch
from backends import BACKENDS
from helpers import make_batch

from rlhf_pipeline.storage import ShardedStoreReader, open_buffer, open_store
from rlhf_pipeline.storage.sharded import shard_path

SEGMENT_ROWS = 8


def write(store, n_batches: int, *, rows_per_batch: int = 6, first: int = 0, high_bits: int = 0) -> None:
    for i in range(first, first + n_batches):
        store.append(make_batch(2, rows_per_batch // 2, seed=i, first_group_id=high_bits + 100 * i,
                                first_trajectory_id=high_bits + 1000 * i))


def assert_tiles(bounds: list[tuple[int, int]], rows: int) -> None:
    """The ranges cover ``[0, rows)`` in order, without gaps, overlaps or empty ranges."""
    assert bounds and bounds[0][0] == 0 and bounds[-1][1] == rows
    for (a, b), (c, _) in zip(bounds, bounds[1:]):
        assert a < b == c


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_units_tile_the_store_and_each_lies_in_one_segment(tmp_path, backend):
    store = BACKENDS[backend].create(tmp_path / "b", segment_rows=SEGMENT_ROWS)
    write(store, 5)  # 30 rows: 3 sealed segments and an open tail
    if backend == "zarr":
        store.flush()  # full segments are sealed on a background thread
    for view in (store, open_store(tmp_path / "b", mode="r")):
        bounds = view.unit_bounds()
        assert_tiles(bounds, 30)
        for a, b in bounds:  # never across a segment boundary: a unit is read as one piece
            assert a // SEGMENT_ROWS == (b - 1) // SEGMENT_ROWS
    if backend == "memmap":
        assert store.unit_bounds() == [(0, 8), (8, 16), (16, 24), (24, 30)]
    else:  # the open segment's appends are separate fragments until the writer closes
        assert [b for b in store.unit_bounds() if b[0] < 24] == [(0, 8), (8, 16), (16, 24)]
    store.close()


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_units_follow_eviction(tmp_path, backend):
    store = BACKENDS[backend].create(tmp_path / "b", segment_rows=SEGMENT_ROWS, capacity_rows=16)
    write(store, 5)  # 30 rows written, the oldest whole segments evicted
    assert store.first_row > 0
    bounds = store.unit_bounds()
    assert_tiles(bounds, len(store))
    # position 0 is the first held row, at the start of a segment
    assert (store.first_row + bounds[1][0]) % SEGMENT_ROWS == 0
    store.close()


def test_a_sharded_buffer_lists_each_shards_units_at_its_place(tmp_path):
    for k, backend in enumerate(sorted(BACKENDS)):
        shard = BACKENDS[backend].create(shard_path(tmp_path / "buf", k), segment_rows=SEGMENT_ROWS)
        write(shard, 2 + k, high_bits=k << 40)
        shard.close()
    union = open_buffer(tmp_path / "buf")
    assert isinstance(union, ShardedStoreReader)
    bounds = union.unit_bounds()
    assert_tiles(bounds, len(union))
    # the rows of each unit come from one shard, and one segment of it
    for a, b in bounds:
        shards, local = union.locate(torch.arange(a, b))
        assert shards.unique().numel() == 1
        assert (local // SEGMENT_ROWS).unique().numel() == 1
    union.close()


def test_an_empty_store_has_no_units(tmp_path):
    store = BACKENDS["memmap"].create(tmp_path / "b", segment_rows=SEGMENT_ROWS)
    assert store.unit_bounds() == []
    store.close()
