"""The range form of a saved selection (storage/row_ranges.py): what a branch's ``parent-rows/`` is."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from helpers import make_batch
from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage import create_store, open_buffer
from rlhf_pipeline.storage.row_keys import parts_of
from rlhf_pipeline.storage.selection import SelectionInvalidError, write_range_selection, write_selection
from rlhf_pipeline.storage.sharded import shard_path

SCHEMA = StoreSchema(("advantage",))


def fill(store, shard: int, batches: int, seed: int = 0) -> None:
    base = shard << 40
    for i in range(batches):
        store.append(make_batch(3, 4, seed=seed + 100 * shard + i, optional=SCHEMA.optional,
                                first_group_id=base + 3 * i, first_trajectory_id=base + 12 * i, policy_version=i))


@pytest.fixture(params=["memmap", "zarr", "sharded"])
def buffer(request, tmp_path):
    """A buffer path; one store of 60 rows, or two shards of 36 and 48 rows."""
    if request.param == "sharded":
        for k, batches in ((0, 3), (1, 4)):
            with create_store(shard_path(tmp_path / "buf", k), "memmap", SCHEMA, segment_rows=8) as store:
                fill(store, k, batches)
    else:
        with create_store(tmp_path / "buf", request.param, SCHEMA, segment_rows=8) as store:
            fill(store, 0, 5)
    return tmp_path / "buf"


def prefixes(source, cut: int) -> dict[int, tuple[int, int]]:
    """Per part, its rows below ``cut`` rows past its first: what a branch names."""
    return {p.index: (p.first_row, min(p.next_row, p.first_row + cut)) for p in parts_of(source)}


def test_ranges_read_as_the_same_rows_named_one_by_one_in_a_file_that_does_not_grow(buffer, tmp_path):
    sizes = {}
    for cut in (12, 30):
        with open_buffer(buffer, mode="r") as source:
            ranges = prefixes(source, cut)
            write_range_selection(tmp_path / f"ranges-{cut}", source, ranges, where="prefix")
            index = np.concatenate([np.full(end - first, k) for k, (first, end) in ranges.items()])
            ids = np.concatenate([np.arange(first, end) for first, end in ranges.values()])
            write_selection(tmp_path / f"rows-{cut}", source, index, ids, where="prefix")
        assert sorted(p.name for p in (tmp_path / f"ranges-{cut}").iterdir()) == ["selection.json"]
        sizes[cut] = (tmp_path / f"ranges-{cut}" / "selection.json").stat().st_size
        with open_buffer(tmp_path / f"ranges-{cut}") as by_range, open_buffer(tmp_path / f"rows-{cut}") as by_row:
            assert len(by_range) == len(by_row) == ids.size
            everything = torch.arange(len(by_row))
            assert by_range.read(everything).equal(by_row.read(everything))
            order = torch.tensor([len(by_row) - 1, 0, 7, 7])
            assert by_range.read(order).equal(by_row.read(order))
            assert [a.tolist() for a in by_range.keys(everything.numpy())] == \
                [a.tolist() for a in by_row.keys(everything.numpy())]
            assert by_range.unit_bounds() == by_row.unit_bounds()
            assert by_range.stats().rows == ids.size
            by_range.load_state_dict(by_range.state_dict())
            with pytest.raises(SelectionInvalidError, match="replaced since that checkpoint"):
                by_range.load_state_dict(by_row.state_dict() | {"rows_crc32": by_range.state_dict()["rows_crc32"] + 1})
        ranged = json.loads((tmp_path / f"ranges-{cut}" / "selection.json").read_text())
        per_row = json.loads((tmp_path / f"rows-{cut}" / "selection.json").read_text())
        assert [p["probes"] for p in ranged["parts"]] == [p["probes"] for p in per_row["parts"]]  # same check
    assert abs(sizes[30] - sizes[12]) <= 8 * len(ranges)  # a few digits more, not 8 bytes a row


def test_a_copy_of_a_range_selection_opens_and_reads_the_same_rows(buffer, tmp_path):
    with open_buffer(buffer, mode="r") as source:
        write_range_selection(tmp_path / "sel", source, prefixes(source, 20))
    with open_buffer(tmp_path / "sel") as sel:
        sel.snapshot_to(str(tmp_path / "copy"))
        before = sel.read(torch.arange(len(sel)))
    with open_buffer(tmp_path / "copy") as copy:
        assert copy.read(torch.arange(len(copy))).equal(before)


def test_the_parent_must_still_hold_exactly_the_named_rows(tmp_path):
    with create_store(tmp_path / "buf", "memmap", SCHEMA, segment_rows=8) as store:
        fill(store, 0, 5)
        write_range_selection(tmp_path / "sel", store, {0: (0, 36)})
        fill(store, 0, 2, seed=9)  # rows published later leave it unchanged
    with open_buffer(tmp_path / "sel") as sel:
        assert len(sel) == 36
    shutil.rmtree(tmp_path / "buf")
    with create_store(tmp_path / "buf", "memmap", SCHEMA, segment_rows=8) as impostor:
        fill(impostor, 0, 5, seed=50)  # same ids and counts, other contents: another run at that path
    with pytest.raises(SelectionInvalidError, match="fingerprints differ"):
        open_buffer(tmp_path / "sel")
    shutil.rmtree(tmp_path / "buf")
    with create_store(tmp_path / "buf", "memmap", SCHEMA, segment_rows=8) as shorter:
        fill(shorter, 0, 1)
    with pytest.raises(SelectionInvalidError, match="has published 12 rows, it had 60 .* truncated or replaced"):
        open_buffer(tmp_path / "sel")


def test_evicted_rows_and_an_edited_range_are_refused(tmp_path):
    from rlhf_pipeline.storage.memmap import MemmapTrajectoryStore

    store = MemmapTrajectoryStore.create(tmp_path / "buf", SCHEMA, segment_rows=8, capacity_rows=64, evict_grace_s=0)
    fill(store, 0, 5)
    write_range_selection(tmp_path / "sel", store, {0: (0, 60)})
    manifest_path = tmp_path / "sel" / "selection.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["row_ranges"][0][1] = 4  # names other rows than its CRC says
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(SelectionInvalidError, match="damaged selection .*row_ranges does not match its rows_crc32"):
        open_buffer(tmp_path / "sel")
    shutil.rmtree(tmp_path / "sel")
    write_range_selection(tmp_path / "sel", store, {0: (0, 60)})
    fill(store, 0, 3, seed=7)  # the oldest segments go, and with them named rows
    with pytest.raises(SelectionInvalidError, match=r"now starts at global row \d+: kept rows from 0 were evicted"):
        open_buffer(tmp_path / "sel")
    store.close()


def test_range_rows_map_positions_as_the_ids_they_name_would():
    from rlhf_pipeline.storage.row_ranges import ListedRows, RangeRows

    generator = np.random.default_rng(0)
    ranges = [[0, 5, 5], [1, 3, 40], [2, 7 << 40, (7 << 40) + 1], [4, 0, 0], [5, 100, 164], [6, 9, 9]]
    listed = ListedRows(np.concatenate([np.arange(first, end) for _, first, end in ranges]),
                        np.concatenate([np.full(end - first, index) for index, first, end in ranges]))
    for sharded in (True, False):
        lazy = RangeRows(ranges, sharded=sharded)
        assert lazy.size == listed.size == 102
        positions = np.concatenate([np.arange(lazy.size), generator.integers(0, lazy.size, 500)])
        assert lazy.ids(positions).tolist() == listed.ids(positions).tolist()
        expected_parts = listed.parts(positions) if sharded else np.zeros(positions.size)
        assert lazy.parts(positions).tolist() == expected_parts.tolist()
        unit_starts = np.array([0, 8, 16, 24, 32, 40, 104, 112, 120, 128, 7 << 40])
        start = 0
        for _, first, end in ranges:
            stop = start + end - first
            assert lazy.unit_cuts(start, stop, unit_starts) == listed.unit_cuts(start, stop, unit_starts)
            start = stop
        for outside in ([lazy.size], [-1]):
            with pytest.raises(IndexError, match=r"must lie in \[0, 102\)"):
                lazy.ids(np.array(outside))
    assert RangeRows([], sharded=False).size == 0


def test_opening_a_range_selection_allocates_nothing_per_row(tmp_path):
    """What the per-row form cost at open was 8 bytes a row for the ids (16 with parts), built even
    for ranges: opened lazily, the ranges are all a selection holds of its rows."""
    import tracemalloc

    rows = 200_000
    with create_store(tmp_path / "buf", "memmap", SCHEMA, segment_rows=65_536) as store:
        for start in range(0, rows, 50_000):
            batch = make_batch(12_500, 4, seed=start, optional=SCHEMA.optional, first_group_id=start // 4,
                               first_trajectory_id=start)
            store.append(batch)
        write_range_selection(tmp_path / "sel", store, {0: (0, rows)})
    tracemalloc.start()
    try:
        with open_buffer(tmp_path / "sel") as sel:
            assert len(sel) == rows
            _, peak = tracemalloc.get_traced_memory()
            picks = torch.tensor([rows - 1, 0, 123_457, 65_536, 65_535])
            assert sel.read(picks, fields=("trajectory_id",))["trajectory_id"].tolist() == picks.tolist()
            assert sel.unit_bounds() == [(0, 65_536), (65_536, 131_072), (131_072, 196_608), (196_608, rows)]
    finally:
        tracemalloc.stop()
    assert peak < rows, f"opening allocated {peak} bytes at its peak for {rows} rows"
