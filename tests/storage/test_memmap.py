"""The memmap backend: the shared contract plus what is specific to its files on disk."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from contract import StoreContractTests
from helpers import assert_same_padded, make_batch

from rlhf_pipeline.schema import StoreSchema, TrajectoryBatch
from rlhf_pipeline.storage import create_store
from rlhf_pipeline.storage.base import StoreCorruptedError, StoreLockedError
from rlhf_pipeline.storage.errors import LocalOnlyStoreError
from rlhf_pipeline.files.atomic import publish_json
from rlhf_pipeline.storage.manifest import IncompatibleStoreError, read_json
from rlhf_pipeline.storage.memmap.state_slots import StateSlots
from rlhf_pipeline.storage.memmap.store import MANIFEST_NAME, MemmapTrajectoryStore
from rlhf_pipeline.storage.memmap.segments import segment_dir_name


class TestMemmapContract(StoreContractTests):
    backend = "memmap"


def test_not_durable_store_publishes_the_same_rows(tmp_path):
    """``durable=False`` changes only when data reaches the disk, never what readers see."""
    path = tmp_path / "b"
    with MemmapTrajectoryStore.create(path, segment_rows=8, durable=False) as store, \
            MemmapTrajectoryStore.open(path) as reader:
        batches = [make_batch(2, 3, seed=i) for i in range(3)]
        for b in batches:
            store.append(b)
        assert len(reader) == 18
        assert reader.read(torch.arange(18)).equal(TrajectoryBatch.cat(batches))


def test_bytes_on_disk_within_5_percent_of_raw_payload(tmp_path):
    # Each file rounds up to whole 4 KiB blocks: segments need ~1 MB of payload for the
    # rounding to stay small (the default 4096 rows of GRPO data hold ~20 MB).
    with MemmapTrajectoryStore.create(tmp_path / "b", segment_rows=1024, durable=False) as store:
        for i in range(5):  # 2560 rows: two sealed segments and a half-full tail grown ahead
            store.append(make_batch(64, 8, seed=i, prompt_len=(32, 256), response_len=(16, 512)))
        stats = store.stats()
        apparent = sum(f.stat().st_size for f in (tmp_path / "b").rglob("*") if f.is_file())
    assert stats.segments == 3
    assert stats.bytes_on_disk <= 1.05 * stats.raw_bytes, stats
    assert apparent > stats.bytes_on_disk  # the tail is grown ahead, sparsely: no blocks spent on it
    # sealed segments are trimmed to their exact payload
    with MemmapTrajectoryStore.open(tmp_path / "b") as reader:
        sealed = tmp_path / "b" / segment_dir_name(0)
        assert (sealed / "checksums.json").is_file()  # recorded when the segment was sealed
        size = sum(f.stat().st_size for f in sealed.iterdir() if f.name != "checksums.json")
        assert size == sum(
            reader.read_global(torch.arange(1024))[n].values.numel() * 4
            for n in ("prompt_tokens", "response_tokens", "response_log_probs")
        ) + _text_bytes(reader.read_global(torch.arange(1024))) + 1024 * (5 * 8 + 8 + 8 + 4 + 4 + 3 + 8)


def _text_bytes(batch: TrajectoryBatch) -> int:
    return sum(len(s.encode()) for n in ("prompt_text", "response_text") for s in batch[n])


def test_unpublished_tail_bytes_are_truncated_on_reopen(tmp_path):
    path = tmp_path / "b"
    with MemmapTrajectoryStore.create(path, segment_rows=64) as store:
        store.append(make_batch(2, 4))
    values = path / segment_dir_name(0) / "response_tokens.values"
    published = values.stat().st_size
    with open(values, "ab") as f:  # what a writer killed mid-append leaves
        f.write(b"\xff" * 1000)
    (path / segment_dir_name(1)).mkdir()  # a segment created but never published
    with MemmapTrajectoryStore.open(path, "a") as store:
        assert values.stat().st_size == published
        assert not (path / segment_dir_name(1)).exists()
        store.append(make_batch(1, 4, seed=1))
        expected = TrajectoryBatch.cat([make_batch(2, 4), make_batch(1, 4, seed=1)])
        assert store.read(torch.arange(12)).equal(expected)


def test_evicted_segment_files_are_deleted_after_the_grace_delay(tmp_path):
    path = tmp_path / "b"
    with MemmapTrajectoryStore.create(path, segment_rows=4, capacity_rows=8, evict_grace_s=3600) as store:
        reader = MemmapTrajectoryStore.open(path)
        early = reader.read(torch.arange(0))  # reader opened, nothing mapped yet
        assert len(early) == 0
        reader.refresh()
        store.append(make_batch(3, 4))  # 12 rows: segment 0 evicted, files kept
        assert store.first_row == 4 and (path / segment_dir_name(0)).exists()
        reader.close()
    # a later writer past the grace delay deletes them
    slots = StateSlots(path)
    seq, state = slots.latest()
    state["evicted"] = [[seg, t - 7200] for seg, t in state["evicted"]]
    slots.publish(seq + 1, state)
    slots.close()
    MemmapTrajectoryStore.open(path, "a").close()
    assert not (path / segment_dir_name(0)).exists()


def test_reader_keeps_serving_a_mapped_segment_after_its_files_are_deleted(tmp_path):
    path = tmp_path / "b"
    with MemmapTrajectoryStore.create(path, segment_rows=4, capacity_rows=8, evict_grace_s=0) as store:
        store.append(make_batch(2, 4))
        with MemmapTrajectoryStore.open(path) as reader:
            before = reader.read(torch.arange(8))  # maps segments 0 and 1
            store.append(make_batch(1, 4, seed=1))  # evicts and deletes segment 0
            assert not (path / segment_dir_name(0)).exists()
            # the reader has not refreshed: its positions still mean rows 0..7
            assert reader.read_global(torch.arange(8)).equal(before)
            assert reader.refresh() == 8 and reader.first_row == 4


def test_reader_of_a_deleted_unmapped_segment_gets_an_index_error(tmp_path):
    path = tmp_path / "b"
    with MemmapTrajectoryStore.create(path, segment_rows=4, capacity_rows=8, evict_grace_s=0) as store:
        store.append(make_batch(2, 4))
        with MemmapTrajectoryStore.open(path) as reader:
            assert len(reader) == 8
            store.append(make_batch(1, 4, seed=1))
            with pytest.raises(IndexError, match="evicted while being read"):
                reader.read_global(torch.arange(4))


def test_padded_reads_across_a_segment_deleted_under_the_reader(tmp_path):
    """read_padded behaves as read does when eviction deletes a segment under a reader: rows it
    already mapped keep being served; rows it never mapped raise IndexError, and it recovers."""
    path = tmp_path / "b"
    with MemmapTrajectoryStore.create(path, segment_rows=4, capacity_rows=8, evict_grace_s=0) as store:
        store.append(make_batch(2, 4))
        with MemmapTrajectoryStore.open(path) as mapped, MemmapTrajectoryStore.open(path) as unmapped:
            before = mapped.read_padded(torch.arange(8))  # indexes and maps segments 0 and 1
            assert len(unmapped) == 8
            store.append(make_batch(1, 4, seed=1))  # evicts and deletes segment 0
            assert not (path / segment_dir_name(0)).exists()
            assert_same_padded(mapped.read_padded(torch.arange(8)), before)  # no refresh yet
            with pytest.raises(IndexError, match="evicted while being read"):
                unmapped.read_padded(torch.arange(4))
            for reader in (mapped, unmapped):
                assert len(reader) == 8 and reader.first_row == 4
                positions = torch.tensor([7, 0, 3])
                assert_same_padded(reader.read_padded(positions), _padded_reference(reader, positions))


def test_create_refuses_existing_store_and_checks_options_with_exist_ok(tmp_path):
    path = tmp_path / "b"
    MemmapTrajectoryStore.create(path, segment_rows=8).close()
    with pytest.raises(FileExistsError, match="exist_ok=True"):
        MemmapTrajectoryStore.create(path, segment_rows=8)
    MemmapTrajectoryStore.create(path, segment_rows=8, exist_ok=True).close()
    with pytest.raises(ValueError, match="segment_rows"):
        MemmapTrajectoryStore.create(path, segment_rows=16, exist_ok=True)
    with pytest.raises(ValueError, match="capacity_rows"):
        MemmapTrajectoryStore.create(tmp_path / "c", segment_rows=16, capacity_rows=8)


def test_incompatible_or_damaged_manifest_is_named(tmp_path):
    path = tmp_path / "b"
    MemmapTrajectoryStore.create(path, StoreSchema(("advantage",))).close()
    manifest = read_json(path / MANIFEST_NAME)
    publish_json(path / MANIFEST_NAME, {**manifest, "format_version": 99})
    with pytest.raises(IncompatibleStoreError, match="format version 99"):
        MemmapTrajectoryStore.open(path)
    publish_json(path / MANIFEST_NAME, {**manifest, "schema": {"schema_version": 0}})
    with pytest.raises(IncompatibleStoreError, match="schema version 0"):
        MemmapTrajectoryStore.open(path)
    (path / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(StoreCorruptedError, match="not valid JSON"):
        MemmapTrajectoryStore.open(path)


def test_no_pickle_and_raw_numpy_files(tmp_path):
    path = tmp_path / "b"
    with MemmapTrajectoryStore.create(path) as store:
        batch = make_batch(1, 2)
        store.append(batch)
    seg = path / segment_dir_name(0)
    text = (seg / "response_text.values").read_bytes()
    assert text.decode() == "".join(batch["response_text"])
    ends = torch.frombuffer(bytearray((seg / "response_tokens.ends").read_bytes()), dtype=torch.int64)
    assert ends.tolist() == batch["response_tokens"].offsets[1:].tolist()
    assert sorted(os.listdir(path)) == [MANIFEST_NAME, segment_dir_name(0), "state.0", "state.1", "writer.lock"]


def test_long_rows_across_segments_read_back_in_any_order(tmp_path):
    """Long rows take the slice-copy gather path; short rows the fancy-index one."""
    with MemmapTrajectoryStore.create(tmp_path / "b", segment_rows=16, durable=False) as store:
        batches = [make_batch(2, 4, seed=i, first_trajectory_id=8 * i, prompt_len=(40, 90), response_len=(30, 200))
                   for i in range(6)]  # 48 rows over 3 segments
        for b in batches:
            store.append(b)
        everything = TrajectoryBatch.cat(batches)
        order = torch.randperm(48, generator=torch.Generator().manual_seed(0))[:20].repeat(2)
        assert store.read(order).equal(everything.select(order))
        assert store.read(order, fields=["response_log_probs"])["response_log_probs"].equal(
            everything.select(order)["response_log_probs"]
        )


def test_a_forked_child_closing_its_copy_keeps_the_parents_lock_and_tail(tmp_path):
    path = tmp_path / "b"
    with MemmapTrajectoryStore.create(path, segment_rows=64) as store:
        store.append(make_batch(2, 4))
        pid = os.fork()
        if pid == 0:  # the child: what a forked worker's garbage collection would do
            store.close()
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        store.append(make_batch(1, 4, seed=1))  # the tail files were not trimmed under us
        with pytest.raises(StoreLockedError):
            MemmapTrajectoryStore.open(path, "a")
        expected = TrajectoryBatch.cat([make_batch(2, 4), make_batch(1, 4, seed=1)])
        assert store.read(torch.arange(12)).equal(expected)


# ------------------------------------------------------------------------ fused read_padded
def _padded_reference(store, positions, pad_token_id=0):
    from rlhf_pipeline.schema.padding import pad_batch, padded_fields

    return pad_batch(store.read(positions, fields=padded_fields(store.schema)), pad_token_id=pad_token_id)


@pytest.mark.parametrize("optional", [(), ("advantage",), ("ref_log_probs", "kl", "token_rewards", "advantage")])
def test_read_padded_equals_pad_batch_of_read(tmp_path, optional):
    schema = StoreSchema(optional)
    with MemmapTrajectoryStore.create(tmp_path / "b", schema, segment_rows=8, durable=False) as store:
        for i in range(5):  # 30 rows over 4 segments, the last one open
            store.append(make_batch(2, 3, seed=i, optional=optional))
        generator = torch.Generator().manual_seed(0)
        cases = [torch.tensor([0]), torch.tensor([29, 0, 7, 8, 7, 15, 16, 29]), torch.arange(30),
                 *(torch.randint(0, 30, (12,), generator=generator) for _ in range(5))]
        for positions in cases:
            for pad_token_id in (0, 77):
                got = store.read_padded(positions, pad_token_id=pad_token_id)
                assert_same_padded(got, _padded_reference(store, positions, pad_token_id))
        # prompt / response entries stay views into the (B, T) tensors, as pad_batch documents
        got = store.read_padded(torch.tensor([3, 1]))
        assert got["tokens", "prompt"].data_ptr() == got["tokens", "full"].data_ptr()


def test_read_padded_follows_appends_evictions_and_checks_positions(tmp_path):
    path = tmp_path / "b"
    with MemmapTrajectoryStore.create(path, segment_rows=4, capacity_rows=8, evict_grace_s=0,
                                      durable=False) as store, MemmapTrajectoryStore.open(path) as reader:
        store.append(make_batch(1, 3, seed=0))
        assert len(reader) == 3
        assert_same_padded(reader.read_padded([2, 0]), _padded_reference(reader, [2, 0]))
        for i in range(1, 5):  # the open tail grows, then segments are sealed and evicted
            store.append(make_batch(1, 3, seed=i))
            n = len(reader)
            positions = torch.arange(n).flip(0)
            assert_same_padded(reader.read_padded(positions), _padded_reference(reader, positions))
            assert_same_padded(store.read_padded(positions), _padded_reference(store, positions))
        assert store.first_row > 0  # evictions happened
        cached, held = set(store._padded_cache._sources), set(store._segments)  # (no repr of mapped arrays)
        assert cached <= held
        with pytest.raises(IndexError, match="positions must lie in"):
            store.read_padded([len(store)])
        with pytest.raises(ValueError, match="empty batch"):
            store.read_padded(torch.tensor([], dtype=torch.int64))
    with pytest.raises(ValueError, match="closed"):
        store.read_padded([0])


def test_reads_work_where_the_kernel_cannot_prefault(tmp_path, monkeypatch):
    import rlhf_pipeline.storage.memmap.mapping as mapping
    import rlhf_pipeline.storage.memmap.segments as segments

    monkeypatch.setattr(segments, "_MADV_POPULATE_READ", 10_000)  # unknown advice: EINVAL, ignored
    monkeypatch.setattr(mapping, "MADV_POPULATE_READ", 10_000)
    batch = make_batch(2, 3, seed=4)
    with MemmapTrajectoryStore.create(tmp_path / "b", segment_rows=4, durable=False) as store:
        store.append(batch)
        assert store.read(torch.arange(6)).equal(batch)
        assert_same_padded(store.read_padded([5, 0, 4]), _padded_reference(store, [5, 0, 4]))


def test_read_padded_row_index_follows_a_long_run_at_bounded_memory(tmp_path):
    """A reader that keeps sampling while thousands of rows are appended and evicted: its row
    index grows, drops evicted rows and compacts, and every padded read stays exact."""
    from rlhf_pipeline.storage.memmap.row_index import RowIndex

    path = tmp_path / "b"
    generator = torch.Generator().manual_seed(3)
    with MemmapTrajectoryStore.create(path, segment_rows=64, capacity_rows=512, evict_grace_s=0,
                                      durable=False) as store, MemmapTrajectoryStore.open(path) as reader:
        for i in range(60):  # 60 x 48 rows: the capacity is passed several times over
            store.append(make_batch(12, 4, seed=i, prompt_len=(1, 5), response_len=(1, 6)))
            held = len(reader)
            positions = torch.randint(0, held, (16,), generator=generator)
            assert_same_padded(reader.read_padded(positions), _padded_reference(reader, positions))
            index: RowIndex = reader._padded_cache.index
            assert (index.first, index.next_row) == (reader.first_row, reader.next_row)
            # slots hold at most twice what is held plus one append (amortised growth)
            assert len(index.columns["prompt_start"]) <= max(2 * (held + 48), 1024)
        assert reader.first_row > 2000  # most rows were evicted along the way
        assert set(reader._padded_cache._sources) <= set(reader._segments)


@pytest.mark.parametrize("location", ["s3://bucket/run/buffer/shard-0000", Path("s3://bucket/run/buffer/shard-0000"),
                                      "az://container/buffer"])
def test_a_url_is_refused_not_made_into_a_local_directory(tmp_path, monkeypatch, location):
    """``Path("s3://b/k")`` is ``s3:/b/k``: taken as a path, a URL would become a local directory
    named ``s3:`` that a run fills while the user believes the rows are in the bucket."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LocalOnlyStoreError, match="is a URL.*Zarr store"):
        create_store(location, "memmap")
    with pytest.raises(LocalOnlyStoreError, match="is a URL"):
        MemmapTrajectoryStore.open(location, mode="a")
    assert list(tmp_path.iterdir()) == []
    # a local directory whose name merely contains a colon is still a directory
    store = create_store(tmp_path / "runs:1" / "buffer", "memmap")
    store.close()
    assert (tmp_path / "runs:1" / "buffer").is_dir()
