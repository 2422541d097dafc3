"""Commit records sent between data-parallel ranks as changes: what a rank rebuilds is rank 0's records.

Real commit records of real Zarr shards (local directories: the records are the same as at a URL but
for the writer token, which counts as a changing key), packed by rank 0's SharedView and unpacked by
another rank's DataParallel, draw after draw.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from helpers import make_batch

from rlhf_pipeline.learn.distributed import (
    AS_HELD,
    DataParallel,
    ReceivedRecords,
    SharedView,
    ViewChanges,
    pack_changes,
    split_record,
)
from rlhf_pipeline.learn.shard_rows import RowNames
from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage.zarr.store import ZarrTrajectoryStore

SHARDS = 24


@pytest.fixture
def shards(tmp_path):
    writers = [ZarrTrajectoryStore.create(str(tmp_path / f"shard-{k:04d}"), StoreSchema(), segment_rows=16)
               for k in range(SHARDS)]
    for k, writer in enumerate(writers):
        writer.append(make_batch(1, 4, seed=k, first_trajectory_id=100 * k))
    yield writers
    for writer in writers:
        writer.close()


def records_of(writers) -> dict[str, dict]:
    return {f"shard-{k:04d}": dict(writer.published_record) for k, writer in enumerate(writers)}


def test_the_opening_sends_the_shared_fixed_part_once_and_a_rank_rebuilds_every_record(shards):
    records = records_of(shards)
    opening = SharedView().opened(records)
    assert len(opening.fixed) == 1 and sorted(opening.records) == sorted(records)
    assert DataParallel(rank=1, world_size=2).received_records(opening) == records
    # what goes over the draw channel: the fixed part (~1.8 KB) once instead of once per shard
    assert len(pickle.dumps(opening)) * 5 < len(pickle.dumps(records))


def test_draw_after_draw_only_changing_keys_travel_and_the_records_rebuilt_are_rank_zeros(shards):
    rank0, rank1 = SharedView(), DataParallel(rank=1, world_size=2)
    rank1.received_records(rank0.opened(records_of(shards)))
    for draw in range(4):
        for k in range(draw, SHARDS, 3):  # some shards grow between draws, the others do not
            shards[k].append(make_batch(1, 4, seed=1000 + draw * SHARDS + k, policy_version=draw + 1))
        records = records_of(shards)
        names = RowNames(list(records), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), view=records)
        shared = rank0.changes(names)
        changed = {f"shard-{k:04d}" for k in range(draw, SHARDS, 3)}
        assert set(shared.view.records) == changed
        assert shared.view.fixed == [] and {index for index, _ in shared.view.records.values()} == {AS_HELD}
        got = rank1.received(shared).view
        assert got == {key: records[key] for key in changed}  # exactly rank 0's records, keys and values


def test_a_shard_new_to_the_receivers_or_with_a_new_fixed_part_is_sent_whole(shards):
    records = records_of(shards)
    held = {key: record for key, record in records.items() if key != "shard-0003"}
    upgraded = dict(records["shard-0005"], format_version=3, chunk_checksum="other")  # a writer changed its layout
    changes = pack_changes({"shard-0003": records["shard-0003"], "shard-0005": upgraded}, held)
    assert changes.records["shard-0003"][0] != AS_HELD and changes.records["shard-0005"][0] != AS_HELD
    assert len(changes.fixed) == 2
    receiver = ReceivedRecords()
    receiver.unpack(pack_changes(held, {}))
    assert receiver.unpack(changes) == {"shard-0003": records["shard-0003"], "shard-0005": upgraded}


def test_changes_for_a_record_never_sent_are_refused(shards):
    records = records_of(shards)
    changes = pack_changes({"shard-0001": records["shard-0001"]}, records)  # as if the opening was sent
    assert changes.records["shard-0001"][0] == AS_HELD
    with pytest.raises(RuntimeError, match="shard-0001.*never sent"):
        ReceivedRecords().unpack(changes)


def test_a_record_splits_into_what_its_writer_changes_and_what_it_was_made_with(shards):
    fixed, changing = split_record(shards[0].published_record)
    assert set(changing) == {"first_row", "next_row", "units", "unit_constants"}  # no writer token locally
    assert {"schema", "codec", "arrays", "segment_rows"} <= set(fixed)
    assert isinstance(pack_changes({}, {}), ViewChanges) and len(pack_changes({}, {})) == 0
