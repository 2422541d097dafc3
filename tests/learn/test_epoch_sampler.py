"""The epoch sampler of ``replay``: every row once per epoch, unit by unit, deterministic, resumable."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import make_batch

from rlhf_pipeline.learn.samplers.epoch import EpochSampler, shuffled_order
from rlhf_pipeline.learn.samplers import make_sampler
from rlhf_pipeline.learn.settings import LearnerSettings
from rlhf_pipeline.storage import create_store, open_buffer, open_store
from rlhf_pipeline.storage.sharded import shard_path

SEGMENT_ROWS = 8


@pytest.fixture
def reader(tmp_path):
    """A memmap buffer of 45 rows in segments of 8 (6 units), opened read-only."""
    store = create_store(tmp_path / "buf", "memmap", segment_rows=SEGMENT_ROWS)
    for i in range(5):
        store.append(make_batch(3, 3, seed=i, first_group_id=10 * i, first_trajectory_id=100 * i))
    store.close()
    with open_store(tmp_path / "buf", mode="r") as opened:
        yield opened


def epoch_draws(sampler: EpochSampler, epoch: int) -> list[torch.Tensor]:
    first = epoch * sampler.batches_per_epoch
    return [sampler.draw(d).positions for d in range(first, first + sampler.batches_per_epoch)]


@pytest.mark.parametrize("order,window", [("shuffle", 0), ("shuffle", 16), ("shuffle", 1), ("sequential", 0)])
def test_every_row_once_per_epoch_and_the_last_batch_is_partial(reader, order, window):
    sampler = EpochSampler(reader, batch_size=10, order=order, seed=3, shuffle_window_rows=window)
    assert sampler.rows == 45 and sampler.batches_per_epoch == 5
    epochs = [epoch_draws(sampler, e) for e in range(3)]
    for draws in epochs:
        assert [d.numel() for d in draws] == [10, 10, 10, 10, 5]
        assert sorted(torch.cat(draws).tolist()) == list(range(45))
    if order == "sequential":
        assert torch.cat(epochs[0]).tolist() == list(range(45)) == torch.cat(epochs[1]).tolist()
    else:  # reshuffled every epoch
        assert torch.cat(epochs[0]).tolist() != torch.cat(epochs[1]).tolist()


def test_a_shuffled_epoch_walks_windows_of_whole_units(reader):
    """With a window of one unit, the order finishes each unit's rows before the next unit starts."""
    sampler = EpochSampler(reader, batch_size=10, order="shuffle", seed=0, shuffle_window_rows=1)
    order = sampler.epoch_order(0)
    units = (order // SEGMENT_ROWS).tolist()
    runs = [u for i, u in enumerate(units) if i == 0 or u != units[i - 1]]
    assert sorted(runs) == list(range(6))  # each unit is one contiguous run of the order
    assert order.tolist() != sorted(order.tolist())  # rows within a unit, and the units, are shuffled
    # windows of >= 16 rows (2-3 units here): the first 16 rows drawn come from the first window's units
    windowed = EpochSampler(reader, batch_size=10, order="shuffle", seed=0, shuffle_window_rows=16).epoch_order(0)
    assert len(set((windowed[:16] // SEGMENT_ROWS).tolist())) <= 3
    everything = EpochSampler(reader, batch_size=10, order="shuffle", seed=0, shuffle_window_rows=0).epoch_order(0)
    assert len(set((everything[:16] // SEGMENT_ROWS).tolist())) > 3  # one window: rows of every unit mixed


def test_shuffled_order_is_a_permutation_of_the_units_rows():
    generator = torch.Generator().manual_seed(0)
    bounds = [(0, 5), (5, 6), (6, 20)]
    order = shuffled_order(bounds, 6, generator)
    assert sorted(order.tolist()) == list(range(20))
    assert shuffled_order([], 6, generator).numel() == 0


def test_draws_depend_only_on_seed_and_draw_index(reader):
    def make(seed, order="shuffle"):
        return EpochSampler(reader, batch_size=10, order=order, seed=seed, shuffle_window_rows=16)

    for order in ("shuffle", "with-replacement"):
        a, b, other = make(1, order), make(1, order), make(2, order)
        # drawn out of order, or by a fresh sampler (a resumed run): the same rows
        late = [a.draw(d).positions.tolist() for d in (7, 2, 12)]
        assert late == [b.draw(d).positions.tolist() for d in (7, 2, 12)]
        assert late != [other.draw(d).positions.tolist() for d in (7, 2, 12)]


def test_with_replacement_draws_full_batches_in_range(reader):
    sampler = EpochSampler(reader, batch_size=10, order="with-replacement", seed=0)
    draws = [sampler.draw(d).positions for d in range(20)]
    assert all(d.numel() == 10 for d in draws)
    flat = torch.cat(draws)
    assert int(flat.min()) >= 0 and int(flat.max()) < 45
    assert flat.unique().numel() < flat.numel()  # repeats happen: 200 draws from 45 rows


def test_the_snapshot_survives_growth_and_resumes_exactly(tmp_path):
    writer = create_store(tmp_path / "buf", "memmap", segment_rows=SEGMENT_ROWS)
    writer.append(make_batch(4, 3, seed=0))
    reader = open_store(tmp_path / "buf", mode="r")
    sampler = EpochSampler(reader, batch_size=5, seed=0, shuffle_window_rows=1)
    assert sampler.rows == 12
    state = sampler.draw(4).sampler_state
    writer.append(make_batch(4, 3, seed=1, first_group_id=50, first_trajectory_id=500))  # grows to 24 rows
    resumed = EpochSampler(reader, batch_size=5, seed=0, shuffle_window_rows=1)
    assert resumed.rows == 24  # a fresh snapshot sees the new rows...
    resumed.load_state_dict(state)  # ...a resumed one walks the rows it started with
    assert resumed.rows == 12
    assert [resumed.draw(d).positions.tolist() for d in range(6)] == [
        sampler.draw(d).positions.tolist() for d in range(6)]
    # the number of rows to walk can be given up front (what replay does)
    assert EpochSampler(reader, batch_size=5, rows=12).rows == 12
    with pytest.raises(ValueError, match="holds 24 rows, fewer than the 30"):
        EpochSampler(reader, batch_size=5, rows=30)
    reader.close()
    writer.close()


def test_a_resume_after_eviction_is_refused(tmp_path):
    writer = create_store(tmp_path / "buf", "memmap", segment_rows=SEGMENT_ROWS, capacity_rows=16,
                          evict_grace_s=0.0)
    writer.append(make_batch(4, 3, seed=0))
    reader = open_store(tmp_path / "buf", mode="r")
    state = EpochSampler(reader, batch_size=5).state_dict()
    writer.append(make_batch(4, 3, seed=1, first_group_id=50, first_trajectory_id=500))  # evicts rows [0, 8)
    with pytest.raises(ValueError, match="no longer holds the rows this replay started with"):
        EpochSampler(reader, batch_size=5).load_state_dict(state)
    reader.close()
    writer.close()


def test_an_epoch_over_a_sharded_buffer_covers_every_shard(tmp_path):
    for k in range(2):
        shard = create_store(shard_path(tmp_path / "buf", k), "memmap", segment_rows=SEGMENT_ROWS)
        shard.append(make_batch(3, 3, seed=k, first_group_id=k << 40, first_trajectory_id=k << 40))
        shard.close()
    union = open_buffer(tmp_path / "buf")
    sampler = EpochSampler(union, batch_size=4, seed=0, shuffle_window_rows=1)
    ids = torch.cat([union.read(p, fields=("trajectory_id",))["trajectory_id"] for p in epoch_draws(sampler, 0)])
    assert ids.unique().numel() == 18 and (ids >> 40).unique().tolist() == [0, 1]
    union.close()


def test_the_learner_builds_it_from_its_settings(reader):
    settings = LearnerSettings(batch_size=10, sampler="epoch", epoch_order="sequential", max_staleness=None)
    sampler = make_sampler(settings, reader, seed=0, stop=threading.Event())
    assert isinstance(sampler, EpochSampler)
    assert sampler.draw(0).positions.tolist() == list(range(10))
    with pytest.raises(ValueError, match="'learner.epoch_order' must be one of \\['shuffle'"):
        LearnerSettings(sampler="epoch", epoch_order="random", max_staleness=None)
    # recorded rows of old policies would all be dropped as stale, the same rows served forever
    with pytest.raises(ValueError, match=r"'learner.max_staleness' must be None with sampler=epoch.*max_staleness=None"):
        LearnerSettings(sampler="epoch", max_staleness=2)
    stop = threading.Event()
    stop.set()
    with pytest.raises(InterruptedError):
        make_sampler(settings, reader, seed=0, stop=stop).draw(0)
