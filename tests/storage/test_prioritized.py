"""The vectorized sum tree and the prioritized sampler on torchrl's contract (storage/prioritized.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torchrl.data import ListStorage, ReplayBuffer

from helpers import make_batch
from rlhf_pipeline.schema import StoreSchema, TrajectoryBatch
from rlhf_pipeline.storage import create_store, open_buffer, open_store
from rlhf_pipeline.storage.memmap import MemmapTrajectoryStore
from rlhf_pipeline.storage.prioritized import NothingToSampleError, PrioritizedSampler, RowPriority
from rlhf_pipeline.storage.sharded import shard_path
from rlhf_pipeline.storage.sum_tree import SumMinTree

SCHEMA = StoreSchema(("advantage",))


# ====================================================================== the tree
@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0, 100, allow_nan=False), min_size=1, max_size=3000),
       st.lists(st.tuples(st.integers(0, 2999), st.floats(0, 50, allow_nan=False)), max_size=40))
# CI found it: the running sum of the children reached the total one leaf early (the last is tiny)
@example(values=[0.0, 1.0, 63.38248819917461, 1.1355863143954963, 8.7497332489853e-204], updates=[])
# and again: the total less the first node's sum rounded to just below the last node's sum, which ends in a
# leaf of 5e-324; the descent then took that node's first leaf, not its last non-empty one
@example(values=[0.0] * 20 + [57.0, 78.0, 2.0, 0.0, 88.0] + [100.0] * 7 + [99.47786150410418, 5e-324], updates=[])
def test_tree_matches_a_plain_prefix_sum(values, updates):
    leaves = np.array(values, dtype=np.float64)
    tree = SumMinTree(4)  # grows as needed: up to three levels of 32 children
    tree.set(np.arange(len(values)), leaves)
    for index, value in updates:
        if index < len(values):
            leaves[index] = value
            tree.set(np.array([index]), np.array([value]))
    rebuilt = SumMinTree()
    rebuilt.rebuild(leaves)
    assert np.array_equal(tree.leaves(len(values)), rebuilt.leaves(len(values)))
    assert tree.total() == rebuilt.total()  # bitwise: nodes depend on the leaves only
    total = float(leaves.sum())
    assert tree.total() == pytest.approx(total, rel=1e-12, abs=1e-12)
    positive = leaves[leaves > 0]
    assert tree.minimum() == (float(positive.min()) if positive.size else math.inf)
    if total > 0:
        mass = np.random.default_rng(0).random(200) * tree.total()
        found = tree.find(mass)
        cumsum = np.cumsum(leaves)
        expected = np.minimum(np.searchsorted(cumsum, mass, side="right"), len(values) - 1)
        assert (leaves[found] > 0).all()  # an empty leaf is never returned
        off = found != expected  # equal to the plain search except within rounding of a boundary
        assert (np.abs(cumsum[np.minimum(found, expected)][off] - mass[off]) < 1e-9 * max(total, 1)).all()
        edge = tree.find(np.array([tree.total(), tree.total() * (1 + 1e-12)]))
        assert (edge == np.flatnonzero(leaves > 0)[-1]).all()  # rounding past the end: the last non-empty leaf


def test_tree_is_independent_of_update_order():
    values = np.random.default_rng(1).random(5000)
    a, b = SumMinTree(), SumMinTree()
    a.set(np.arange(5000), values)
    for chunk in np.array_split(np.random.default_rng(2).permutation(5000), 37):
        b.set(chunk, values[chunk])
    assert all(np.array_equal(x, y) for x, y in zip(a.sums, b.sums))
    assert all(np.array_equal(x, y) for x, y in zip(a.mins, b.mins))


# ====================================================================== the sampler over a store
def store_with_advantages(path, advantages: list[float], *, group_size: int = 4, **options):
    n = len(advantages)
    batch = make_batch(n // group_size, group_size, optional=("advantage",))
    batch = batch.with_columns(advantage=torch.tensor(advantages, dtype=torch.float32))
    store = create_store(path, "memmap", SCHEMA, segment_rows=options.pop("segment_rows", 16), **options)
    store.append(batch)
    return store, batch


def chi_square_critical(dof: int, p_value: float = 1e-6) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (accurate to ~1% at these dof)."""
    z = -torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(p_value)).item()
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize("alpha", [0.0, 0.7, 1.0])
def test_draws_follow_the_promised_distribution(tmp_path, alpha):
    """A chi-square goodness-of-fit test at p = 1e-6 over 200,000 draws: with a fixed seed the
    verdict is reproducible; a sampler whose probabilities are 10% off on one row in eight, or
    20% off on a single row, fails it (checked by altering the leaves by hand)."""
    advantages = [0.0, 0.05, 0.1, 0.3, 0.5, 1.0, 2.0, 4.0] * 5  # 40 rows, priorities from 0 (eps) to 4
    store, _ = store_with_advantages(tmp_path / "b", advantages)
    sampler = PrioritizedSampler(alpha=alpha, beta=0.5, eps=0.01, priority="abs_advantage")
    generator = torch.Generator().manual_seed(1234)
    draws = torch.cat([sampler.sample(store, 25_000, generator=generator)[0] for _ in range(8)])
    p = (torch.tensor(advantages, dtype=torch.float64).abs() + 0.01) ** alpha
    expected = p / p.sum() * draws.numel()
    counts = torch.bincount(draws, minlength=len(advantages)).double()
    statistic = float(((counts - expected) ** 2 / expected).sum())
    assert statistic < chi_square_critical(len(advantages) - 1), statistic
    # importance weights: (p_i / min p)^-beta exactly, in (0, 1]
    index, info = sampler.sample(store, 64, generator=generator)
    expected_weight = (p[index] / p.min()) ** -0.5
    torch.testing.assert_close(info["priority_weight"].double(), expected_weight, rtol=1e-6, atol=0)
    store.close()


def test_group_reward_std_priority_never_favours_equal_groups(tmp_path):
    batch = make_batch(6, 4, optional=("advantage",))
    reward = torch.tensor([1.0] * 4 + [0, 1, 0, 1] + [0.0] * 4 + [0, 0, 0, 1] + [2.0] * 4 + [0, 2, 0, 2])
    with create_store(tmp_path / "b", "memmap", SCHEMA, segment_rows=8) as store:
        store.append(batch.with_columns(reward=reward))
        sampler = PrioritizedSampler(alpha=1.0, beta=1.0, eps=0.0, priority="group_reward_std")
        index, info = sampler.sample(store, 4000, generator=torch.Generator().manual_seed(0))
        groups = index // 4
        assert set(groups.tolist()) == {1, 3, 5}  # the equal groups have priority 0
        counts = torch.bincount(groups, minlength=6).double()
        stds = torch.tensor([0, 0.5, 0, math.sqrt(3) / 4, 0, 1.0])
        share = counts / counts.sum()
        # per-group binomial tolerance: 5 standard deviations of a share estimated from 4000 draws
        target = stds / stds.sum()
        assert bool((torch.abs(share - target) <= 5 * torch.sqrt(target * (1 - target) / 4000) + 1e-12).all())


def test_recency_halves_priority_every_half_life(tmp_path):
    batch = TrajectoryBatch.cat([make_batch(1, 4, seed=v, policy_version=v, first_group_id=v) for v in (0, 10, 20)])
    with create_store(tmp_path / "b", "memmap", segment_rows=8) as store:
        store.append(batch)
        sampler = PrioritizedSampler(alpha=1.0, eps=0.0, priority="recency")
        index, _ = sampler.sample(store, 7000, generator=torch.Generator().manual_seed(5))
        share = torch.bincount(index // 4, minlength=3).double() / 7000
        target = torch.tensor([1.0, 2.0, 4.0]) / 7
        assert bool((torch.abs(share - target) <= 5 * torch.sqrt(target * (1 - target) / 7000)).all())
        with pytest.raises(ValueError, match="takes no updates"):
            sampler.update_priority(index[:2], 1.0)


def test_updates_min_version_and_errors(tmp_path):
    store, batch = store_with_advantages(tmp_path / "b", [1.0] * 16)
    sampler = PrioritizedSampler(alpha=1.0, beta=1.0, priority="abs_advantage")
    generator = torch.Generator().manual_seed(0)
    sampler.sample(store, 1, generator=generator)
    sampler.update_priority(torch.tensor([5]), torch.tensor([1000.0]))
    index, info = sampler.sample(store, 2000, generator=generator)
    assert (index == 5).float().mean() > 0.95  # 1000 / (1000 + 15)
    assert float(info["priority_weight"][index == 5].max()) == pytest.approx(1 / 1000, rel=1e-6)
    store.append(make_batch(2, 4, seed=9, optional=("advantage",), policy_version=3, first_group_id=50))
    sampler.set_min_version(3)  # only the new rows (version 3) are fresh enough
    index, _ = sampler.sample(store, 500, generator=generator)
    assert bool((index >= 16).all())
    sampler.set_min_version(4)
    with pytest.raises(NothingToSampleError, match="min_version=4"):
        sampler.sample(store, 1)
    sampler.set_min_version(None)
    with pytest.raises(ValueError, match="finite and >= 0"):
        sampler.update_priority(torch.tensor([0]), torch.tensor([-1.0]))
    bad = PrioritizedSampler(priority=RowPriority("negative", ("reward",), lambda c: -np.ones(len(c["reward"]))))
    with pytest.raises(ValueError, match="'negative' must give one finite value >= 0 per row"):
        bad.sample(store, 1)
    store.close()


def test_priorities_follow_rows_through_eviction(tmp_path):
    store = MemmapTrajectoryStore.create(tmp_path / "b", SCHEMA, segment_rows=8, capacity_rows=24, evict_grace_s=0)
    for i in range(3):
        store.append(make_batch(2, 4, seed=i, optional=("advantage",), first_group_id=2 * i,
                                first_trajectory_id=8 * i))
    reader = open_store(tmp_path / "b")
    sampler = PrioritizedSampler(alpha=1.0, priority="abs_advantage")
    generator = torch.Generator().manual_seed(0)
    sampler.sample(reader, 1, generator=generator)
    sampler.update_priority(torch.tensor([20]), torch.tensor([1e6]))  # trajectory 20
    store.append(make_batch(2, 4, seed=7, optional=("advantage",), first_group_id=90, first_trajectory_id=90))
    index, _ = sampler.sample(reader, 200, generator=generator)  # the first segment is gone: positions moved
    assert reader.first_row == 8
    hot = reader.read(index, fields=("trajectory_id",))["trajectory_id"]
    assert (hot == 20).float().mean() > 0.95
    reader.close()
    store.close()


def test_priorities_follow_rows_across_shards_as_they_grow(tmp_path):
    writers = [create_store(shard_path(tmp_path / "buf", k), "memmap", SCHEMA, segment_rows=8) for k in (0, 1)]
    for k, w in enumerate(writers):
        w.append(make_batch(2, 4, seed=k, optional=("advantage",), first_group_id=(k << 40),
                            first_trajectory_id=(k << 40)))
    union = open_buffer(tmp_path / "buf")
    sampler = PrioritizedSampler(alpha=1.0, priority="abs_advantage")
    generator = torch.Generator().manual_seed(0)
    sampler.sample(union, 1, generator=generator)
    sampler.update_priority(torch.tensor([9]), torch.tensor([1e6]))  # shard 1, its second row
    writers[0].append(make_batch(2, 4, seed=5, optional=("advantage",), first_group_id=77, first_trajectory_id=77))
    index, _ = sampler.sample(union, 200, generator=generator)  # shard 1 now starts at position 16
    hot = union.read(index, fields=("trajectory_id",))["trajectory_id"]
    assert (hot == (1 << 40) + 1).float().mean() > 0.95
    union.close()
    for w in writers:
        w.close()


def test_state_dict_resumes_the_same_draws(tmp_path):
    store, _ = store_with_advantages(tmp_path / "b", [0.1, 0.5, 1.0, 3.0] * 8)
    first = PrioritizedSampler(alpha=0.8, beta=0.6, priority="abs_advantage")
    first.sample(store, 4, generator=torch.Generator().manual_seed(0))
    first.update_priority(torch.tensor([3, 7, 11]), torch.tensor([9.0, 0.0, 2.5]))
    state = first.state_dict()
    second = PrioritizedSampler()
    second.load_state_dict(state)
    a = first.sample(store, 256, generator=torch.Generator().manual_seed(1))
    b = second.sample(store, 256, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1]["priority_weight"], b[1]["priority_weight"])
    compact = first.state_dict(include_priorities=False)  # derived priorities are recomputed from the store
    assert compact["updated"][0]["rows"].tolist() == [3, 7, 11] and "parts" not in compact
    fresh = PrioritizedSampler(priority="abs_advantage")  # the priority function is the caller's, not state
    fresh.load_state_dict(compact)
    c = fresh.sample(store, 256, generator=torch.Generator().manual_seed(2))
    d = first.sample(store, 256, generator=torch.Generator().manual_seed(2))
    assert torch.equal(c[0], d[0]) and torch.equal(c[1]["priority_weight"], d[1]["priority_weight"])
    untouched = PrioritizedSampler(alpha=0.8, beta=0.6, priority="abs_advantage")
    e = untouched.sample(store, 256, generator=torch.Generator().manual_seed(2))
    assert not torch.equal(c[0], e[0])  # the updates are what changed the draws
    assert untouched.state_dict(include_priorities=False)["updated"] == {}
    store.close()


def test_works_on_torchrl_own_storage_through_extend():
    rb = ReplayBuffer(storage=ListStorage(8), sampler=PrioritizedSampler(alpha=1.0), batch_size=400)
    rb.extend([torch.tensor(i) for i in range(6)])
    data, info = rb.sample(return_info=True)
    assert set(info["index"].tolist()) <= set(range(6)) and torch.equal(data, info["index"])
    rb.update_priority(torch.tensor([2]), torch.tensor([100.0]))
    index = rb.sample(return_info=True)[1]["index"]
    assert (index == 2).float().mean() > 0.9
    rb.extend([torch.tensor(10), torch.tensor(11), torch.tensor(12)])  # wraps over position 0: default priority
    assert set(rb.sample(return_info=True)[1]["index"].tolist()) <= set(range(8))
