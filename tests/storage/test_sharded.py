"""The read-only union of a run's buffer shards (one store per collector): ``storage/sharded.py``."""

from __future__ import annotations

import pytest
import torch
from helpers import make_batch

from rlhf_pipeline.files.shard_names import spread_shard_name
from rlhf_pipeline.learn.samplers import DataTimeoutError
from rlhf_pipeline.learn.samplers.window import FreshRowSampler
from rlhf_pipeline.schema import StoreSchema, TrajectoryBatch
from rlhf_pipeline.schema.padding import PaddedCollator
from rlhf_pipeline.storage import (
    NotAStoreError,
    ReadOnlyStoreError,
    ShardedStoreReader,
    StoreCorruptedError,
    create_store,
    make_replay_buffer,
    open_buffer,
    open_store,
)
from rlhf_pipeline.storage.buffers import find_shard
from rlhf_pipeline.storage.sharded import list_shards, shard_path

torch.set_num_threads(1)
SCHEMA = StoreSchema(optional=("advantage",))


def shard_rows(shard: int, n_groups: int, *, start: int = 0, version: int = 0) -> TrajectoryBatch:
    """Whole groups with ids that carry the shard index, as collector ``shard`` writes them."""
    base = shard << 40
    return make_batch(n_groups, 4, seed=100 * shard + start, optional=("advantage",),
                      first_group_id=base + start, first_trajectory_id=base + 4 * start,
                      policy_version=version)


@pytest.fixture
def two_shards(tmp_path):
    buffer = tmp_path / "buffer"
    writers = [create_store(shard_path(buffer, k), "memmap", schema=SCHEMA, segment_rows=8) for k in (0, 1)]
    writers[0].append(shard_rows(0, 3))   # 12 rows
    writers[1].append(shard_rows(1, 5))   # 20 rows
    yield buffer, writers
    for w in writers:
        w.close()


def all_rows(store) -> TrajectoryBatch:
    return store.read(torch.arange(len(store)))


def assert_batches_equal(a: TrajectoryBatch, b: TrajectoryBatch) -> None:
    assert a.field_names == b.field_names
    for name in a.field_names:
        x, y = a[name], b[name]
        if isinstance(x, list):
            assert x == y, name
        elif isinstance(x, torch.Tensor):
            assert torch.equal(x, y), name
        else:  # ragged
            assert torch.equal(x.values, y.values) and torch.equal(x.offsets, y.offsets), name


def test_union_reads_equal_the_concatenation_of_shards(two_shards):
    buffer, _ = two_shards
    union = open_buffer(buffer)
    assert isinstance(union, ShardedStoreReader) and len(union) == 32
    assert union.next_row == 32 and union.first_row == 0 and union.schema == SCHEMA
    expected = TrajectoryBatch.cat([all_rows(open_store(p)) for _, p in list_shards(buffer)])
    assert_batches_equal(all_rows(union), expected)

    # any order, repeats, across shards: rows come back in the requested order
    positions = torch.tensor([31, 0, 12, 11, 5, 12, 30])
    assert_batches_equal(union.read(positions), expected.select(positions))
    sub = union.read(positions, fields=("group_id", "response_tokens"))
    assert sub.field_names == ("response_tokens", "group_id")
    assert torch.equal(sub["group_id"], expected["group_id"][positions])
    assert len(union.read([])) == 0
    with pytest.raises(IndexError, match=r"\[0, 32\)"):
        union.read([32])

    # positions map to (shard, local position) through the cumulative lengths
    shard, local = union.locate([0, 11, 12, 31])
    assert shard.tolist() == [0, 0, 1, 1] and local.tolist() == [0, 11, 0, 19]

    stats = union.stats()
    assert (stats.rows, stats.next_row, stats.groups, stats.extra["shards"]) == (32, 32, 8, 2)
    rewards = expected["reward"]
    assert stats.reward_mean == pytest.approx(float(rewards.mean()), abs=1e-5)
    assert stats.reward_std == pytest.approx(float(rewards.std(unbiased=False)), abs=1e-5)
    assert stats.response_tokens == int(expected["response_tokens"].lengths().sum())
    union.close()


def test_refresh_picks_up_new_rows_and_new_shards(two_shards):
    buffer, writers = two_shards
    union = open_buffer(buffer)
    assert len(union) == 32
    writers[0].append(shard_rows(0, 2, start=3))  # shard 0 grows: shard 1's positions move up
    assert len(union) == 40 and union.next_row == 40
    assert union.locate([19, 20])[0].tolist() == [0, 1]
    assert_batches_equal(union.read(torch.arange(12, 20)), all_rows(open_store(shard_path(buffer, 0))).select(
        torch.arange(12, 20)))

    (buffer / "shard-0002").mkdir()  # a collector starting up: not a store yet, skipped for now
    assert len(union) == 40
    with create_store(shard_path(buffer, 2), "memmap", schema=SCHEMA, exist_ok=True) as third:
        third.append(shard_rows(2, 1))
    assert len(union) == 44 and sorted(union.shards) == [0, 1, 2]
    assert int(union.read([43])["group_id"]) >> 40 == 2
    # a whole shard appearing between two refreshes, none pending: the cached listing of the
    # buffer directory must not hide it (its mtime changed)
    with create_store(shard_path(buffer, 3), "memmap", schema=SCHEMA) as fourth:
        fourth.append(shard_rows(3, 1))
    assert len(union) == 48 and sorted(union.shards) == [0, 1, 2, 3]

    # resume safety: a saved state names every shard and the rows each had
    state = union.state_dict()
    assert sorted(state["shards"]) == ["shard-0000", "shard-0001", "shard-0002", "shard-0003"]
    reopened = open_buffer(buffer)
    reopened.load_state_dict(state)
    state["shards"]["shard-0007"] = state["shards"]["shard-0000"]
    with pytest.raises(StoreCorruptedError, match="shard-0007"):
        reopened.load_state_dict(state)
    reopened.close()
    union.close()


def test_union_is_read_only_and_layouts_are_told_apart(two_shards, tmp_path):
    buffer, _ = two_shards
    union = open_buffer(buffer)
    with pytest.raises(ReadOnlyStoreError, match="each collector appends to its own shard"):
        union.append(shard_rows(0, 1))
    rb = make_replay_buffer(union, batch_size=4)
    with pytest.raises(ReadOnlyStoreError):
        rb.extend(shard_rows(0, 1))
    with pytest.raises(ReadOnlyStoreError, match="union is read-only"):
        open_buffer(buffer, mode="a")
    union.close()

    # a single store (runs made before shards) still opens as itself
    with create_store(tmp_path / "single", "memmap", schema=SCHEMA) as single:
        single.append(shard_rows(0, 1))
    with open_buffer(tmp_path / "single") as store:
        assert type(store).__name__ == "MemmapTrajectoryStore" and len(store) == 4
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotAStoreError):
        open_buffer(tmp_path / "empty")
    (tmp_path / "empty" / "shard-0000").mkdir()
    with pytest.raises(NotAStoreError, match="no readable shard"):
        open_buffer(tmp_path / "empty")

    # shards of one buffer must share a schema
    with create_store(shard_path(buffer, 3), "memmap", schema=StoreSchema()) as other:
        other.append(make_batch(1, 4, seed=9))
    with pytest.raises(StoreCorruptedError, match="one schema"):
        open_buffer(buffer)


def test_a_run_directory_opened_as_a_buffer_is_refused_with_the_call_that_reads_its_buffer(two_shards):
    """It said "(in Python, open_buffer reads a run's buffer)", read as open_buffer taking the run: the
    call that was refused. The call it names now reads the run's buffer, every shard."""
    import re

    buffer, _ = two_shards
    with pytest.raises(NotAStoreError, match="is not a replay buffer but holds one") as refused:
        open_buffer(buffer.parent)
    call = re.search(r"open_buffer\('([^']+)'\)", str(refused.value))
    with open_buffer(call[1]) as union:
        assert len(union) == 32


def test_torchrl_replay_buffer_and_learner_sampler_see_every_shard(two_shards):
    buffer, writers = two_shards
    union = open_buffer(buffer)
    rb = make_replay_buffer(union, batch_size=16, sampler="random", collate_fn=PaddedCollator())
    torch.manual_seed(0)
    seen = set()
    for _ in range(4):
        padded = rb.sample()
        assert padded["group_id"].shape == (16,)
        seen |= set((padded["group_id"] >> 40).tolist())
    assert seen == {0, 1}

    # the learner's "newest rows" window takes an even share of each shard's newest rows
    assert union.newest_positions(8).tolist() == [8, 9, 10, 11, 28, 29, 30, 31]
    assert union.newest_positions(30).tolist() == list(range(0, 12)) + list(range(14, 32))
    assert union.newest_positions(100).numel() == 32
    sampler = FreshRowSampler(union, batch_size=8, window=16, seed=0, max_staleness=None,
                              new_rows_per_draw=8, timeout_s=0.3, poll_s=0.05)
    drawn = sampler.draw(0)
    assert set((union.read(drawn.positions)["group_id"] >> 40).tolist()) == {0, 1}
    assert drawn.buffer_next_row == 32 and drawn.sampler_state == {"min_next_row": 40}
    writers[1].append(shard_rows(1, 2, start=5))  # new rows count wherever they land
    assert sampler.draw(1).buffer_next_row == 40
    union.close()


def test_learner_sampler_waits_until_every_shard_has_rows(two_shards):
    """A collector that starts late still feeds the first steps: no draw while its shard is empty."""
    buffer, writers = two_shards
    late = create_store(shard_path(buffer, 2), "memmap", schema=SCHEMA, segment_rows=8)
    try:
        union = open_buffer(buffer)
        assert union.empty_shards() == ["shard-0002"]
        sampler = FreshRowSampler(union, batch_size=8, window=32, seed=0, max_staleness=None,
                                  timeout_s=0.3, poll_s=0.05)
        with pytest.raises(DataTimeoutError, match="shard-0002.*--collector-index"):
            sampler.draw(0)  # 32 rows of shards 0 and 1 would do, were shard 2 not empty

        late.append(shard_rows(2, 1))
        drawn = sampler.draw(0)
        assert union.empty_shards() == []
        assert set((union.read(drawn.positions)["group_id"] >> 40).tolist()) <= {0, 1, 2}
        assert union.newest_positions(12).tolist()[-4:] == [32, 33, 34, 35]  # shard 2's rows are in the window
        union.close()
    finally:
        late.close()


def test_inspect_sums_the_shards(two_shards, capsys):
    import json

    from rlhf_pipeline.cli.main import main

    buffer, _ = two_shards
    assert main(["inspect", str(buffer), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert (stats["backend"], stats["rows"], stats["groups"], stats["extra"]["shards"]) == ("sharded", 32, 8, 2)
    assert main(["inspect", str(buffer)]) == 0
    assert "shard-0000: 12, shard-0001: 20" in capsys.readouterr().out


def test_read_padded_over_shards_equals_pad_batch_of_read(two_shards):
    """The union's fused read locates rows in each shard and pads them in one pass."""
    from helpers import assert_same_padded

    from rlhf_pipeline.schema.padding import pad_batch, padded_fields

    buffer, writers = two_shards
    union = open_buffer(buffer)
    assert union.supports_fused_padding
    cases = [torch.tensor([31, 0, 12, 11, 12]), torch.arange(32).flip(0), torch.tensor([5]), torch.tensor([20, 25])]
    for positions in cases:
        for pad_token_id in (0, 9):
            expected = pad_batch(union.read(positions, fields=padded_fields(SCHEMA)), pad_token_id=pad_token_id)
            assert_same_padded(union.read_padded(positions, pad_token_id=pad_token_id), expected)
    writers[0].append(shard_rows(0, 2, start=3))  # positions shift after a refresh: still exact
    assert len(union) == 40
    positions = torch.tensor([39, 12, 13, 0, 19])
    assert_same_padded(union.read_padded(positions), pad_batch(union.read(positions)))
    with pytest.raises(IndexError, match="positions must lie in"):
        union.read_padded([40])
    union.close()


def test_read_ragged_over_shards_equals_read(two_shards):
    """The packed learner's ragged read of a union locates rows in each shard, as read_padded does."""
    from rlhf_pipeline.storage.padded_rows import located_fields

    buffer, _ = two_shards
    union = open_buffer(buffer)
    fields = located_fields(SCHEMA)
    for positions in (torch.tensor([31, 0, 12, 11, 12]), torch.arange(32).flip(0), torch.tensor([20, 25])):
        assert union.read_ragged(positions).equal(union.read(positions, fields=fields))
    union.close()


def test_a_damaged_shard_is_never_left_out_silently(two_shards, capsys):
    from rlhf_pipeline.cli.main import main

    buffer, writers = two_shards
    writers[1].close()
    (shard_path(buffer, 1) / "manifest.json").write_bytes(b"{")  # a damaged shard, not one being created
    with pytest.raises(StoreCorruptedError, match="shard-0001.*manifest.json"):
        open_buffer(buffer)  # the learner's union refuses instead of reading 12 rows of 32
    assert main(["inspect", str(buffer)]) == 2
    assert "shard-0001" in capsys.readouterr().err
    assert main(["inspect", str(buffer), "--verify"]) == 1
    out = capsys.readouterr().out
    assert "shard-0000 (memmap): checked" in out and "no damage found" in out and "shard-0001" in out
    assert main(["repair", str(buffer), "--apply"]) == 0  # every shard in turn
    assert "shard-0001 (memmap): repaired" in capsys.readouterr().out
    with open_buffer(buffer) as union:
        assert len(union) == 32


def test_a_buffer_holding_plain_and_spread_shard_names_reads_as_one_union(tmp_path):
    """Shards made at an object-store URL carry two hex digits (``files/shard_names.py``); a buffer made
    before them, or copied to a disk, mixes both names. Each is found by its index; a name whose
    digits are not its index's, or a shard still being made, is not a shard; an index under two
    names is refused rather than one of them read."""
    buffer = tmp_path / "buffer"
    spread = spread_shard_name(1)
    with create_store(buffer / "shard-0000", "memmap", schema=SCHEMA, segment_rows=8) as writer:
        writer.append(shard_rows(0, 2))
    with create_store(buffer / spread, "memmap", schema=SCHEMA, segment_rows=8) as writer:
        writer.append(shard_rows(1, 3))
    wrong = next(f"{d:02x}" for d in range(256) if f"{d:02x}" != spread_shard_name(2)[:2])
    (buffer / f"{wrong}-shard-0002").mkdir()
    (buffer / "shard-0003.creating").mkdir()
    assert list_shards(buffer) == [(0, str(buffer / "shard-0000")), (1, str(buffer / spread))]
    assert find_shard(buffer, 1) == str(buffer / spread)  # a collector goes on with the shard it has
    assert find_shard(buffer, 4) == str(buffer / "shard-0004")  # a new one on a disk: the plain name
    with open_buffer(buffer) as union:
        assert union.shard_names == {0: "shard-0000", 1: spread}
        assert len(union) == 20
        assert union.read(torch.arange(20))["trajectory_id"].tolist() == \
            [*range(8), *((1 << 40) + i for i in range(12))]
        assert sorted(union.state_dict()["shards"]) == sorted(["shard-0000", spread])
        union.snapshot_to(str(tmp_path / "copy"))
    assert sorted(p.name for p in (tmp_path / "copy").iterdir()) == sorted(["shard-0000", spread])

    with create_store(buffer / "shard-0001", "memmap", schema=SCHEMA, segment_rows=8) as writer:
        writer.append(shard_rows(1, 1))
    for opening in (lambda: list_shards(buffer), lambda: open_buffer(buffer)):
        with pytest.raises(StoreCorruptedError, match=f"shard 1 twice, as {spread} and as shard-0001"):
            opening()
