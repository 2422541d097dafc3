"""Data-parallel ranks over a buffer of shards, without a process group: rank 0's refresh shared with
the other ranks (no record GET, no LIST of theirs, counted on moto's server) and shard affinity (each
rank's slice from its own shards). The ranks' process-group side is in test_distributed.py."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from rlhf_pipeline.files.shard_names import shard_location, spread_shard_name
from rlhf_pipeline.learn.distributed import DataParallel, SharedView
from rlhf_pipeline.learn.samplers.exact import ExactUseSampler
from rlhf_pipeline.learn.shard_rows import open_in_view, published_view, row_names
from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.schema.synthetic import synthetic_batch
from rlhf_pipeline.storage import create_store, open_buffer
from rlhf_pipeline.storage.zarr import ZarrTrajectoryStore

ROWS_PER_APPEND = 4
# the writers' lock lease: a writer renews its lock every third of it, and the tests count every request
# moto receives, so a renewal inside a count (a 30 s lease renews every 10 s: a setup that slow under load
# once put a writer's LIST of its lock into a reader's opening) would be counted as the reader's
WRITER_LEASE_S = 3600.0


def _rows(shard: int, append: int):
    """Rows whose trajectory ids name their shard and append: ``shard * 1000 + append * 10 + i``."""
    batch = synthetic_batch(ROWS_PER_APPEND, group_size=2, prompt_len=(2, 6), response_len=(2, 6),
                            seed=shard * 100 + append)
    return batch.with_columns(trajectory_id=torch.arange(ROWS_PER_APPEND) + shard * 1000 + append * 10)


def _view_requests(sent) -> list[tuple[str, str]]:
    """The requests that read a view of the buffer: a listing, or a shard's commit record."""
    return [(method, path) for method, path in sent if "list-type=2" in path or path.endswith("/zarr.json")]


def _unit_gets(sent) -> list[str]:
    return [path for method, path in sent if method == "GET" and "/units/" in path]


def test_other_ranks_adopt_rank_zeros_refresh_and_send_no_record_get_or_list(s3_server):
    prefix = s3_server.url("buffer")
    writers = [ZarrTrajectoryStore.create(f"{prefix}/shard-{k:04d}", StoreSchema(), lock_lease_s=WRITER_LEASE_S,
                                          segment_rows=64,
                                          storage_options=s3_server.options) for k in range(5)]
    try:
        for k, writer in enumerate(writers):
            writer.append(_rows(k, 0))
        options = {"storage_options": s3_server.options, "refresh_interval_s": 0}
        main, other = open_buffer(prefix, **options), open_buffer(prefix, **options)
        rank0, rank1 = DataParallel(rank=0, world_size=2), DataParallel(rank=1, world_size=2)
        sampler = ExactUseSampler(main, batch_size=10)
        stop = threading.Event()
        for step in range(3):
            for k in (1, 3):  # some collectors append between steps, the others do not
                writers[k].append(_rows(k, step + 1))
            sampled = sampler.draw(step)
            names = row_names(main, sampled.positions)  # on rank 0's prefetch thread, right after the draw
            writers[2].append(_rows(2, 10 + step))  # published after rank 0's refresh: not in its view
            shared = rank0.view_changes(names)
            # what goes to the other ranks: every shard's record the first time, then the changed ones
            assert sorted(shared.view.records) == (
                ["shard-0000", "shard-0001", "shard-0002", "shard-0003", "shard-0004"] if step == 0
                else ["shard-0001", "shard-0002", "shard-0003"])
            # each shard's fixed part (schema, codecs, layout: the same in all five) once, then none
            assert len(shared.view.fixed) == (1 if step == 0 else 0)
            with s3_server.requests.recording() as sent:
                positions = rank1.positions_in_view(other, rank1.received(shared), stop=stop, timeout_s=5)
                rows = other.read(positions)
            assert _view_requests(sent) == [], sent
            assert _unit_gets(sent) or step > 0  # this rank reads the rows itself (step 0 fetched their units)
            assert torch.equal(rows["trajectory_id"], main.read(sampled.positions)["trajectory_id"])
            # exactly rank 0's view: the append published in between is not seen
            assert [length for *_, length in other.shard_ranges()] == [length for *_, length in main.shard_ranges()]
        main.close()
        other.close()
    finally:
        for writer in writers:
            writer.close()


def test_a_shard_new_to_another_rank_is_opened_from_rank_zeros_listing_and_record(s3_server):
    """Shard 0 as buffers at a URL were made before spread names (``shard-0000``), shard 1 as they are
    made now (``<hh>-shard-0001``): the other rank opens it by the name in rank 0's view."""
    prefix = s3_server.url("buffer")
    with ZarrTrajectoryStore.create(f"{prefix}/shard-0000", StoreSchema(), lock_lease_s=WRITER_LEASE_S,
                                    storage_options=s3_server.options) as w:
        w.append(_rows(0, 0))
    options = {"storage_options": s3_server.options, "refresh_interval_s": 0}
    main, other = open_buffer(prefix, **options), open_buffer(prefix, **options)
    with ZarrTrajectoryStore.create(shard_location(prefix, 1), StoreSchema(), lock_lease_s=WRITER_LEASE_S,
                                    storage_options=s3_server.options) as w:
        w.append(_rows(1, 0))
    main.refresh()
    names = row_names(main, torch.arange(2 * ROWS_PER_APPEND))
    with s3_server.requests.recording() as sent:
        rank0, rank1 = DataParallel(rank=0, world_size=2), DataParallel(rank=1, world_size=2)
        positions = rank1.positions_in_view(other, rank1.received(rank0.view_changes(names)),
                                            stop=threading.Event(), timeout_s=5)
    assert other.shard_names == {0: "shard-0000", 1: spread_shard_name(1)}
    assert _view_requests(sent) == []  # the listing and the new shard's record were rank 0's
    assert other.read(positions)["trajectory_id"].tolist() == list(range(4)) + list(range(1000, 1004))
    main.close()
    other.close()


def _aws_environment(s3_server, monkeypatch) -> None:
    """The server's endpoint and credentials in the environment, as a learner rank finds them: a buffer
    opened with no ``storage_options`` (whose backend was detected with one more GET of each record)."""
    for name, value in s3_server.env().items():
        if name.startswith("AWS_"):
            monkeypatch.setenv(name, value)


def _what_was_read(sent) -> list[str]:
    """Per view request, sorted: ``LIST``, or the shard whose commit record it GETs."""
    return sorted("LIST" if "list-type=2" in path else path.rsplit("/", 2)[-2] for _, path in _view_requests(sent))


def _all_rows(store) -> list[int]:
    """The rows ``store`` holds as of its last refresh (``len()`` would refresh it)."""
    return store.read(torch.arange(int(store.next_row - store.first_row)))["trajectory_id"].tolist()


def test_other_ranks_open_the_buffer_from_the_records_rank_zero_read_and_send_nothing(s3_server, monkeypatch):
    """Opening, shared like the refresh: rank 0 lists the buffer and GETs each shard's record once;
    a reader opened from those records sends no request at all and holds exactly rank 0's rows."""
    _aws_environment(s3_server, monkeypatch)
    prefix = s3_server.url("buffer")
    # the collectors stay open: closing merges a shard's fragments, and a reader of the old one rereads the record
    writers = [ZarrTrajectoryStore.create(f"{prefix}/shard-{k:04d}", StoreSchema(), lock_lease_s=WRITER_LEASE_S,
                                          segment_rows=64) for k in range(4)]
    for k, writer in enumerate(writers):
        writer.append(_rows(k, 0))
    with s3_server.requests.recording() as sent:
        main = open_buffer(prefix, refresh_interval_s=0)
    assert _what_was_read(sent) == ["LIST", "shard-0000", "shard-0001", "shard-0002", "shard-0003"], sent
    # and one GET beside the prefix: whether it is a branch's buffer continuing its parent's (storage/continues.py)
    others = [path for method, path in sent if (method, path) not in _view_requests(sent)]
    assert len(sent) == 6 and len(others) == 1 and others[0].endswith("/buffer.continues.json"), sent
    writers[2].append(_rows(2, 1))  # after rank 0 read its record: a reader opened on its own would see it
    shared_view, rank1 = SharedView(), DataParallel(rank=1, world_size=2)
    opening = shared_view.opened(published_view(main))  # what rank 0 sends at setup
    assert sorted(opening.records) == ["shard-0000", "shard-0001", "shard-0002", "shard-0003"]
    assert len(opening.fixed) == 1  # the four shards' schema, codecs and layout: sent once
    with s3_server.requests.recording() as sent:
        other = open_in_view(prefix, rank1.received_records(opening), refresh_interval_s=0)
    assert sent == []
    assert sorted(other.shards) == [0, 1, 2, 3]
    assert [length for *_, length in other.shard_ranges()] == [length for *_, length in main.shard_ranges()]
    assert _all_rows(other) == _all_rows(main) == [k * 1000 + i for k in range(4) for i in range(ROWS_PER_APPEND)]
    # rank 0's first draw after the opening sends only the record that changed since; the other rank then
    # holds its rows
    main.refresh()
    names = shared_view.changes(row_names(main, torch.arange(5 * ROWS_PER_APPEND)))
    assert sorted(names.view.records) == ["shard-0002"] and names.view.fixed == []
    positions = rank1.positions_in_view(other, rank1.received(names), stop=threading.Event(), timeout_s=5)
    assert other.read(positions)["trajectory_id"].tolist() == _all_rows(main)
    # a reader like any other from then on: its own refresh sees the append, and a new shard is opened
    # with one GET of its record (not a second one right after)
    with ZarrTrajectoryStore.create(f"{prefix}/shard-0004", StoreSchema(), lock_lease_s=WRITER_LEASE_S,
                                    segment_rows=64) as writer:
        writer.append(_rows(4, 0))
    with s3_server.requests.recording() as sent:
        assert other.refresh() == 6 * ROWS_PER_APPEND
    assert _what_was_read(sent) == ["LIST"] + [f"shard-{k:04d}" for k in range(5)]
    main.close()
    other.close()
    for writer in writers:
        writer.close()


def test_a_single_store_at_a_url_opens_with_one_record_get_and_another_rank_from_it(s3_server, monkeypatch):
    _aws_environment(s3_server, monkeypatch)
    url = s3_server.url("store")
    writer = ZarrTrajectoryStore.create(url, StoreSchema(), lock_lease_s=WRITER_LEASE_S, segment_rows=64)
    writer.append(_rows(0, 0))
    with s3_server.requests.recording() as sent:
        main = open_buffer(url, refresh_interval_s=0)
    assert [path for _, path in _view_requests(sent) if path.endswith("/zarr.json")] == \
        [f"{url.removeprefix('s3:/')}/zarr.json"]  # the record, once: no GET to tell its backend
    writer.append(_rows(0, 1))
    with s3_server.requests.recording() as sent:
        other = open_in_view(url, published_view(main), refresh_interval_s=0)
    assert sent == []
    assert _all_rows(other) == _all_rows(main) == list(range(ROWS_PER_APPEND))  # rank 0's view, not newer
    assert len(other) == 2 * ROWS_PER_APPEND  # its own refresh reads the record as any reader's does
    writer.close()
    main.close()
    other.close()


def test_a_local_buffer_shares_no_view(tmp_path):
    """A local refresh is an fstat per shard: the ranks refresh themselves, as before."""
    store = create_store(tmp_path / "buffer" / "shard-0000", "zarr", schema=StoreSchema())
    store.append(_rows(0, 0))
    store.close()
    reader = open_buffer(tmp_path / "buffer")
    assert row_names(reader, torch.arange(2)).view is None
    reader.close()


def _sharded_buffer(root, shards: int, appends: int):
    for k in range(shards):
        store = create_store(root / f"shard-{k:04d}", "memmap", schema=StoreSchema(), segment_rows=8)
        for append in range(appends):
            store.append(_rows(k, append))
        store.close()
    return open_buffer(root)


@pytest.mark.parametrize("ranks", [2, 3])
def test_each_rank_reads_its_slice_from_its_own_shards_every_step(tmp_path, ranks):
    reader = _sharded_buffer(tmp_path / "buffer", shards=5, appends=3)
    sampler = ExactUseSampler(reader, batch_size=15)
    dps = [DataParallel(rank=r, world_size=ranks) for r in range(ranks)]
    for step in range(4):
        sampled = dps[0].order_by_rank(sampler.draw(step), reader)
        assert sum(sampled.rank_rows) == 15
        shard_of = reader.locate(sampled.positions)[0]
        # the global batch is still the exact sampler's: an even share (3 rows) from each of the 5 shards
        assert torch.bincount(shard_of, minlength=5).tolist() == [3] * 5
        slices = [dp.local_positions(sampled.positions, sampled.rank_rows) for dp in dps]
        assert torch.equal(torch.cat([mine for mine, _ in slices]), sampled.positions)
        for rank, (mine, filler) in enumerate(slices):
            assert not filler
            assert set(reader.locate(mine)[0].tolist()) == {k for k in range(5) if k % ranks == rank}
        names = row_names(reader, sampled.positions)
        for rank, dp in enumerate(dps):  # the names a rank reads are the same slice of the draw
            mine, _ = dp.local_names(names, sampled.rank_rows)
            assert {mine.keys[i] for i in np.unique(mine.shard)} == {f"shard-{k:04d}" for k in range(5)
                                                                         if k % ranks == rank}
    reader.close()


def test_fewer_shards_than_ranks_keep_equal_slices(tmp_path):
    reader = _sharded_buffer(tmp_path / "buffer", shards=2, appends=2)
    sampled = ExactUseSampler(reader, batch_size=8).draw(0)
    ordered = DataParallel(rank=0, world_size=3).order_by_rank(sampled, reader)
    assert ordered is sampled and ordered.rank_rows is None
    assert DataParallel(rank=2, world_size=3).local_positions(sampled.positions)[0].numel() == 2
    reader.close()


def test_a_draw_of_trajectories_is_ordered_by_rank_with_its_steps_and_weights(tmp_path):
    """Rank 0 narrows a multi-turn draw to the rows that end a trajectory, with each one's step: the
    reorder moves steps (and importance weights) with their rows, so each trajectory is read whole
    by the rank that owns its shard (its earlier turns are in the same shard)."""
    import dataclasses

    reader = _sharded_buffer(tmp_path / "buffer", shards=4, appends=1)
    positions = torch.tensor([15, 0, 9, 4, 13, 6])  # shards 3, 0, 2, 1, 3, 1
    sampled = dataclasses.replace(ExactUseSampler(reader, batch_size=4).draw(0), positions=positions,
                                  trajectory_steps=positions % 3, weights=positions.double() / 10)
    ordered = DataParallel(rank=0, world_size=2).order_by_rank(sampled, reader)
    # rank 0 owns shards 0 and 2, rank 1 shards 1 and 3; within a rank the draw's order is kept
    assert ordered.rank_rows == [2, 4]
    assert ordered.positions.tolist() == [0, 9, 15, 4, 13, 6]
    assert torch.equal(ordered.trajectory_steps, ordered.positions % 3)
    assert torch.equal(ordered.weights, ordered.positions.double() / 10)
    reader.close()


def test_a_single_store_at_a_url_is_shared_the_same_way(s3_server):
    url = s3_server.url("buffer")
    with ZarrTrajectoryStore.create(url, StoreSchema(), lock_lease_s=WRITER_LEASE_S,
                                    storage_options=s3_server.options) as writer:
        writer.append(_rows(0, 0))
        main = ZarrTrajectoryStore.open(url, storage_options=s3_server.options, refresh_interval_s=0)
        other = ZarrTrajectoryStore.open(url, storage_options=s3_server.options, refresh_interval_s=0)
        writer.append(_rows(0, 1))
        main.refresh()
        names = row_names(main, torch.arange(8))
        assert list(names.view) == ["."]
        with s3_server.requests.recording() as sent:
            rank1 = DataParallel(rank=1, world_size=2)
            positions = rank1.positions_in_view(
                other, rank1.received(DataParallel(rank=0, world_size=2).view_changes(names)), stop=threading.Event(),
                timeout_s=5)
        assert sent == [] and other.next_row - other.first_row == 8  # rank 0's record, adopted without a request
        assert other.read(positions)["trajectory_id"].tolist() == [0, 1, 2, 3, 10, 11, 12, 13]
        with pytest.raises(Exception, match="only a reader adopts"):
            writer.adopt_record(main.published_record)
        main.close()
        other.close()
