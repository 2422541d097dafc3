"""Our stores in torchrl's own ``ReplayBuffer(storage=store, sampler=..., batch_size=...)``."""

from __future__ import annotations

import pytest
import torch
from torchrl.data import ReplayBuffer
from torchrl.data.replay_buffers.samplers import RandomSampler, SamplerWithoutReplacement
from torchrl.data.replay_buffers.writers import RoundRobinWriter

from helpers import assert_same_padded, make_batch
from rlhf_pipeline.schema.padding import pad_batch, padded_fields
from rlhf_pipeline.schema import StoreSchema, TrajectoryBatch
from rlhf_pipeline.storage import create_store
from rlhf_pipeline.storage.prioritized import PrioritizedSampler
from rlhf_pipeline.storage.torchrl_glue import AppendWriter, make_replay_buffer

SCHEMA = StoreSchema(("advantage", "kl"))


@pytest.fixture(params=["memmap", "zarr"])
def store(request, tmp_path):
    with create_store(tmp_path / "buf", request.param, SCHEMA, segment_rows=8) as store:
        yield store


def expected_padded(store, index):
    return pad_batch(store.read(index, fields=padded_fields(store.schema)))


@pytest.mark.parametrize("make_sampler", [RandomSampler, SamplerWithoutReplacement,
                                          lambda: PrioritizedSampler(priority="abs_advantage")],
                         ids=["random", "without_replacement", "prioritized"])
def test_a_plain_replay_buffer_samples_padded_batches(store, make_sampler):
    rb = ReplayBuffer(storage=store, sampler=make_sampler(), batch_size=6)
    first, second = make_batch(2, 4, seed=0, optional=SCHEMA.optional), make_batch(3, 4, seed=1, optional=SCHEMA.optional)
    assert rb.extend(first).tolist() == list(range(8))  # the default writer appends, positions as stored
    assert rb.extend(second.to_tensordict()).tolist() == list(range(8, 20))
    assert store.read(torch.arange(20)).equal(TrajectoryBatch.cat([first, second]))
    batch, info = rb.sample(return_info=True)
    assert batch.batch_size == torch.Size([6])
    assert_same_padded(batch, expected_padded(store, info["index"]))
    if isinstance(rb._sampler, PrioritizedSampler):
        assert info["priority_weight"].shape == (6,) and bool((info["priority_weight"] <= 1).all())
        rb.update_priority(info["index"][:1], torch.tensor([1e6]))
        assert (rb.sample(return_info=True)[1]["index"] == info["index"][0]).float().mean() > 0.8


def test_without_replacement_covers_every_row_once_per_epoch(store):
    store.append(make_batch(4, 4, optional=SCHEMA.optional))
    rb = ReplayBuffer(storage=store, sampler=SamplerWithoutReplacement(), batch_size=4)
    ids = torch.cat([rb.sample()["trajectory_id"] for _ in range(4)])
    assert sorted(ids.tolist()) == list(range(16))


def test_what_the_caller_passes_is_kept(store):
    store.append(make_batch(2, 4, optional=SCHEMA.optional))
    mine = AppendWriter()
    rb = ReplayBuffer(storage=store, batch_size=3, collate_fn=lambda rows: rows, writer=mine)
    assert isinstance(rb.sample(), TrajectoryBatch)
    assert rb._writer is mine
    with pytest.raises(TypeError, match="AppendWriter"):  # it would return positions the rows did not get
        ReplayBuffer(storage=store, writer=RoundRobinWriter())
    ours = ReplayBuffer(storage=store, batch_size=3)
    assert isinstance(ours._writer, AppendWriter)
    # the buffer our factory builds is unchanged: rows as stored, fused padding on request
    assert isinstance(make_replay_buffer(store, batch_size=3).sample(), TrajectoryBatch)
