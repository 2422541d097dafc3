"""Saved selections: a read-only view of kept rows, opened by ``open_buffer`` (storage/selection.py)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from helpers import assert_same_padded, make_batch
from rlhf_pipeline.schema.padding import pad_batch, padded_fields
from rlhf_pipeline.schema import StoreSchema, TrajectoryBatch
from rlhf_pipeline.storage import ReadOnlyStoreError, create_store, make_replay_buffer, open_buffer
from rlhf_pipeline.storage.filtering import filter_buffer
from rlhf_pipeline.storage.selection import SelectionInvalidError, SelectionStore
from rlhf_pipeline.storage.sharded import shard_path

SCHEMA = StoreSchema(("advantage", "kl"))
WHERE = "group_reward_std > 0 and policy_version != 2"


def rows(i: int, shard: int = 0) -> TrajectoryBatch:
    """Three groups of 4; the first has equal rewards (dropped by WHERE), the others not."""
    base = shard << 40
    batch = make_batch(3, 4, seed=100 * shard + i, optional=SCHEMA.optional, first_group_id=base + 3 * i,
                       first_trajectory_id=base + 12 * i, policy_version=i)
    reward = batch["reward"].clone()
    reward[:4] = 0.25
    return batch.with_columns(reward=reward)


def expected_positions(n_batches: int) -> list[int]:
    return [12 * i + j for i in range(n_batches) if i != 2 for j in range(4, 12)]


@pytest.fixture(params=["memmap", "zarr", "sharded"])
def source(request, tmp_path):
    """(buffer path, every row in position order, writers) of each layout a selection can name."""
    kind = request.param
    if kind == "sharded":
        writers = [create_store(shard_path(tmp_path / "buf", k), "memmap", SCHEMA, segment_rows=8) for k in (0, 1)]
        batches = {0: [rows(i, 0) for i in range(3)], 1: [rows(i, 1) for i in range(4)]}
        for k, w in enumerate(writers):
            for b in batches[k]:
                w.append(b)
        everything = TrajectoryBatch.cat(batches[0] + batches[1])
    else:
        writers = [create_store(tmp_path / "buf", kind, SCHEMA, segment_rows=8)]
        written = [rows(i) for i in range(5)]
        for b in written:
            writers[0].append(b)
        everything = TrajectoryBatch.cat(written)
    yield tmp_path / "buf", everything, writers
    for w in writers:
        w.close()


def keep_mask(everything: TrajectoryBatch) -> torch.Tensor:
    reward, groups = everything["reward"], everything["group_id"]
    spread = torch.tensor([bool(reward[groups == g].std(unbiased=False) > 0) for g in groups.tolist()])
    return spread & (everything["policy_version"] != 2)


def test_selection_reads_exactly_the_kept_rows_through_every_path(source, tmp_path):
    path, everything, _ = source
    filter_buffer(path, tmp_path / "sel", WHERE, selection=True)
    kept = everything.select(torch.nonzero(keep_mask(everything)).reshape(-1))
    with open_buffer(tmp_path / "sel") as sel:
        assert isinstance(sel, SelectionStore) and not sel.writable
        assert len(sel) == len(kept) and (sel.first_row, sel.next_row) == (0, len(kept))
        assert sel.schema == SCHEMA
        assert sel.read(torch.arange(len(sel))).equal(kept)
        order = torch.tensor([len(kept) - 1, 0, 5, 5, 9])  # any order, repeats, across parts
        assert sel.read(order).equal(kept.select(order))
        sub = sel.read(order, fields=["group_id", "response_tokens"])
        assert torch.equal(sub["group_id"], kept["group_id"][order])
        assert sel.supports_fused_padding
        assert_same_padded(sel.read_padded(order, pad_token_id=3),
                           pad_batch(kept.select(order).without("prompt_text", "response_text"), pad_token_id=3))
        with pytest.raises(IndexError, match=rf"\[0, {len(kept)}\)"):
            sel.read([len(kept)])
        with pytest.raises(ReadOnlyStoreError, match="read-only"):
            sel.append(rows(9))
        stats = sel.stats()
        assert (stats.rows, stats.groups) == (len(kept), len(torch.unique(kept["group_id"])))
        assert stats.response_tokens == kept["response_tokens"].values.numel()
        assert stats.reward_mean == pytest.approx(float(kept["reward"].double().mean()))
        assert stats.extra["where"] == WHERE
    with pytest.raises(ReadOnlyStoreError):
        open_buffer(tmp_path / "sel", mode="a")


def source_unit(selection: SelectionStore, part: int, global_id: int) -> int:
    """The unit of the source part holding a row, by the source's own account (segments of 8 here)."""
    store = selection._sources[part]
    if not hasattr(store, "unit_bounds"):
        return global_id // 8
    starts = [start + store.first_row for start, _ in store.unit_bounds()]
    return int(np.searchsorted(starts, global_id, side="right"))


def test_unit_bounds_partition_the_selection_one_source_unit_each(source, tmp_path):
    path, everything, _ = source
    filter_buffer(path, tmp_path / "sel", WHERE, selection=True)
    with open_buffer(tmp_path / "sel") as sel:
        bounds = sel.unit_bounds()
        assert bounds[0][0] == 0 and bounds[-1][1] == len(sel)
        assert all(a < b for a, b in bounds) and all(b == c for (_, b), (c, _) in zip(bounds[:-1], bounds[1:]))
        parts, ids = sel.keys(np.arange(len(sel)))
        unit = parts * 10**6 + np.array([source_unit(sel, int(p), int(g)) for p, g in zip(parts, ids)])
        for a, b in bounds:
            assert len(set(unit[a:b].tolist())) == 1  # one source unit per range...
        starts = [a for a, _ in bounds[1:]]
        assert all(unit[s] != unit[s - 1] for s in starts)  # ...and as long as it can be


def test_torchrl_replay_buffer_and_state_dict_over_a_selection(source, tmp_path):
    path, everything, _ = source
    filter_buffer(path, tmp_path / "sel", WHERE, selection=True)
    kept = everything.select(torch.nonzero(keep_mask(everything)).reshape(-1))
    with open_buffer(tmp_path / "sel") as sel:
        rb = make_replay_buffer(sel, batch_size=8, sampler="without_replacement")
        seen = torch.cat([rb.sample()["trajectory_id"] for _ in range(len(sel) // 8)])
        assert sorted(seen.tolist()) == sorted(kept["trajectory_id"].tolist())
        state = sel.state_dict()
    with open_buffer(tmp_path / "sel") as again:
        again.load_state_dict(state)
        with pytest.raises(SelectionInvalidError, match="replaced since that checkpoint"):
            again.load_state_dict(dict(state, rows_crc32=state["rows_crc32"] + 1))


def test_rows_appended_later_leave_the_selection_unchanged(source, tmp_path):
    path, everything, writers = source
    filter_buffer(path, tmp_path / "sel", WHERE, selection=True)
    with open_buffer(tmp_path / "sel") as sel:
        before = sel.read(torch.arange(len(sel)))
    writers[0].append(rows(7))
    with open_buffer(tmp_path / "sel") as sel:
        assert sel.read(torch.arange(len(sel))).equal(before)


def test_a_selection_of_a_selection_names_the_original_rows(tmp_path):
    with create_store(tmp_path / "buf", "memmap", SCHEMA, segment_rows=8) as store:
        for i in range(5):
            store.append(rows(i))
    filter_buffer(tmp_path / "buf", tmp_path / "a", "group_reward_std > 0", selection=True)
    filter_buffer(tmp_path / "a", tmp_path / "b", "policy_version != 2", selection=True)
    with open_buffer(tmp_path / "b") as b, open_buffer(tmp_path / "buf") as buf:
        assert b.source_location == str((tmp_path / "buf").resolve())
        assert b.where == "(group_reward_std > 0) and (policy_version != 2)"
        assert b.read(torch.arange(len(b))).equal(buf.read(torch.tensor(expected_positions(5))))
    filter_buffer(tmp_path / "b", tmp_path / "copy", "reward > -100")  # a selection copies into a real store
    with open_buffer(tmp_path / "copy") as copy, open_buffer(tmp_path / "b") as b:
        assert copy.backend_name == "memmap" and copy.read(torch.arange(len(copy))).equal(b.read(torch.arange(len(b))))


# ====================================================================== invalidation
def make_source_and_selection(tmp_path, **options):
    store = create_store(tmp_path / "buf", "memmap", SCHEMA, segment_rows=8, **options)
    for i in range(5):
        store.append(rows(i))
    filter_buffer(tmp_path / "buf", tmp_path / "sel", WHERE, selection=True)
    return store


def test_evicted_rows_make_the_selection_a_clear_error(tmp_path):
    from rlhf_pipeline.storage.memmap import MemmapTrajectoryStore

    store = MemmapTrajectoryStore.create(tmp_path / "buf", SCHEMA, segment_rows=8, capacity_rows=64, evict_grace_s=0)
    for i in range(5):
        store.append(rows(i))
    filter_buffer(tmp_path / "buf", tmp_path / "sel", WHERE, selection=True)
    sel = open_buffer(tmp_path / "sel")
    for i in range(5, 8):
        store.append(rows(i))  # the oldest segments go, and with them kept rows
    with pytest.raises(SelectionInvalidError, match="evicted"):
        sel.read(torch.arange(len(sel)))
    with pytest.raises(SelectionInvalidError, match=r"now starts at global row \d+: kept rows from 4 were evicted") \
            as refused:
        open_buffer(tmp_path / "sel")
    assert "copy the rows instead (`filter` without --selection)" in str(refused.value)  # how to keep them next time
    sel.close()
    store.close()


def test_a_different_store_at_the_source_path_is_refused(tmp_path):
    make_source_and_selection(tmp_path).close()
    shutil.rmtree(tmp_path / "buf")
    with create_store(tmp_path / "buf", "memmap", SCHEMA, segment_rows=8) as impostor:
        for i in range(5):  # same ids and row counts, other contents: a rerun into the same path
            impostor.append(make_batch(3, 4, seed=50 + i, optional=SCHEMA.optional, first_group_id=3 * i,
                                       first_trajectory_id=12 * i, policy_version=i))
    with pytest.raises(SelectionInvalidError, match="fingerprints differ"):
        open_buffer(tmp_path / "sel")
    shutil.rmtree(tmp_path / "buf")
    with create_store(tmp_path / "buf", "memmap", SCHEMA, segment_rows=8) as shorter:
        shorter.append(rows(0))
    with pytest.raises(SelectionInvalidError, match="has published 12 rows, it had 60 .* truncated or replaced"):
        open_buffer(tmp_path / "sel")
    shutil.rmtree(tmp_path / "buf")
    create_store(tmp_path / "buf", "zarr", SCHEMA, segment_rows=8).close()
    with pytest.raises(SelectionInvalidError, match="is a zarr store, it was a memmap store"):
        open_buffer(tmp_path / "sel")


def test_a_damaged_rows_file_is_refused_and_a_moved_pair_still_opens(tmp_path):
    make_source_and_selection(tmp_path).close()
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.move(tmp_path / "buf", moved / "buf")
    shutil.move(tmp_path / "sel", moved / "sel")
    with open_buffer(moved / "sel") as sel:  # found through the relative path
        assert sel.read(torch.arange(len(sel))).equal(
            open_buffer(moved / "buf").read(torch.tensor(expected_positions(5))))
    raw = bytearray((moved / "sel" / "rows.npy").read_bytes())
    raw[-1] ^= 1
    (moved / "sel" / "rows.npy").write_bytes(bytes(raw))
    with pytest.raises(SelectionInvalidError, match="does not match its CRC"):
        open_buffer(moved / "sel")


def test_read_padded_fields_skip_text(tmp_path):
    make_source_and_selection(tmp_path).close()
    with open_buffer(tmp_path / "sel") as sel:
        got = sel.read([0, 3], fields=padded_fields(sel.schema))
        assert "prompt_text" not in got.field_names and len(got) == 2
