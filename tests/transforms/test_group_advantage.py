"""Group advantage: the pure math, parity with torchrl's MCAdvantage, the transform's grouping and errors."""

from __future__ import annotations

import pytest
import torch
from helpers import make_batch
from torchrl.objectives.llm import MCAdvantage
from util import multi_step_batch, torchrl_trajectory

from rlhf_pipeline.schema import TrajectoryBatch, TrajectoryValidationError
from rlhf_pipeline.transforms import GroupAdvantage, group_advantages


def _by_trajectory(out: TrajectoryBatch) -> dict[int, torch.Tensor]:
    res: dict[int, list[float]] = {}
    for tid, adv in zip(out["trajectory_id"].tolist(), out["advantage"].tolist()):
        res.setdefault(tid, []).append(adv)
    return {k: torch.tensor(v) for k, v in res.items()}


# ---------------------------------------------------------------- pure function
def test_formulas_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 5.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1])
    adv, zero_var = group_advantages(r, g, 2)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()
    torch.testing.assert_close(adv[:4], (r[:4] - 0.5) / std)
    assert zero_var.tolist() == [False, True]
    assert adv[4:].tolist() == [0.0, 0.0]
    adv_dr, _ = group_advantages(r, g, 2, normalize=False)  # Dr. GRPO: centered only
    torch.testing.assert_close(adv_dr[:4], r[:4] - 0.5)
    adv_loo, _ = group_advantages(r, g, 2, normalize=False, leave_one_out=True)
    torch.testing.assert_close(adv_loo[:4], torch.tensor([1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3]))
    adv_biased, _ = group_advantages(r, g, 2, unbiased_std=False)
    torch.testing.assert_close(adv_biased[:4], (r[:4] - 0.5) / 0.5)


def test_pure_function_matches_mcadvantage_per_step():
    gen = torch.Generator().manual_seed(1)
    mc = MCAdvantage(grpo_size=4, prompt_key="group_id")  # trajectory_return=None: per-step normalization
    rewards = [torch.randn(k, generator=gen) for k in (3, 1, 2, 4)]
    outs = [mc.inv(torchrl_trajectory(7, r)) for r in rewards]
    assert all(o is None for o in outs[:3])
    expected = outs[3]["advantage"].reshape(-1)
    flat = torch.cat(rewards)
    adv, _ = group_advantages(flat, torch.zeros(flat.numel(), dtype=torch.int64), 1)
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("how", ["sum", "mean", "max", "step"])
def test_transform_matches_mcadvantage_multi_step(how):
    """Interleaved groups, multi-step trajectories, split over several extends."""
    gen = torch.Generator().manual_seed(2)
    group_size, n_groups = 3, 4
    steps = torch.randint(1, 4, (group_size * n_groups,), generator=gen).tolist()
    groups = [t % n_groups for t in range(group_size * n_groups)]  # interleaved
    rewards = torch.randn(sum(steps), generator=gen)
    rewards[:3] = 0.25  # some ties
    batch = multi_step_batch(steps, groups, rewards)

    mc = MCAdvantage(grpo_size=group_size, prompt_key="group_id",
                     trajectory_return=None if how == "step" else how)
    ga = GroupAdvantage(group_size, trajectory_return=how)
    expected: dict[int, torch.Tensor] = {}
    got: dict[int, torch.Tensor] = {}
    starts = torch.tensor([0, *steps]).cumsum(0).tolist()
    order = list(range(len(steps)))
    for chunk in (order[:5], order[5:7], order[7:]):
        for t in chunk:
            out = mc.inv(torchrl_trajectory(groups[t], rewards[starts[t]:starts[t + 1]]))
            if out is not None:  # MCAdvantage returns the group's trajectories in arrival order
                adv = out["advantage"].reshape(-1)
                members = [u for u in order if groups[u] == groups[t]]
                pos = 0
                for u in members:
                    expected[u] = adv[pos:pos + steps[u]]
                    pos += steps[u]
        rows = torch.cat([torch.arange(starts[t], starts[t + 1]) for t in chunk])
        out = ga.write(batch.select(rows))
        if out is not None:
            got.update(_by_trajectory(out))
    assert sorted(got) == sorted(expected) == order
    for t in order:
        torch.testing.assert_close(got[t], expected[t], atol=1e-6, rtol=0)
    assert ga.metrics()["groups_written"] == n_groups and ga.pending.num_rows == 0


def test_dynamic_sampling_drops_zero_variance_groups():
    batch = make_batch(3, 4)
    reward = batch["reward"].clone()
    reward[:4] = 1.0  # group 0: all right
    reward[4:8] = 0.0  # group 1: all wrong
    ga = GroupAdvantage(4, drop_zero_variance=True)
    out = ga.write(batch.with_columns(reward=reward))
    assert out["group_id"].unique().tolist() == [2]
    m = ga.metrics()
    assert (m["groups_dropped_zero_variance"], m["groups_written"], m["rows_dropped"]) == (2, 1, 8)
    kept = GroupAdvantage(4).write(batch.with_columns(reward=reward))
    assert len(kept) == 12 and kept["advantage"][:8].abs().max() == 0


def test_rows_wait_until_group_complete_then_whole_group_written():
    batch = make_batch(2, 4)
    ga = GroupAdvantage(4)
    assert ga.write(batch.select([0, 1, 4])) is None
    assert ga.metrics()["pending_rows"] == 3
    out = ga.write(batch.select([2, 3, 5]))
    assert sorted(out["trajectory_id"].tolist()) == [0, 1, 2, 3]
    out = ga.write(batch.select([6, 7]))
    assert sorted(out["trajectory_id"].tolist()) == [4, 5, 6, 7]
    assert ga.pending.num_rows == 0
    # text and tokens survive the wait unchanged
    by_id = {t: i for i, t in enumerate(out["trajectory_id"].tolist())}
    assert out["response_text"][by_id[4]] == batch["response_text"][4]
    assert out["response_tokens"].row(by_id[4]).tolist() == batch["response_tokens"].row(4).tolist()


# ---------------------------------------------------------------- errors
def test_error_trajectory_not_done():
    batch = make_batch(1, 4)
    done = batch["done"].clone()
    done[2] = False
    bad = batch.with_columns(done=done, terminated=done, truncated=torch.zeros(4, dtype=torch.bool))
    with pytest.raises(TrajectoryValidationError, match="row 2, field 'done'.*whole trajectories"):
        GroupAdvantage(4).write(bad)


def test_error_multi_step_without_done():
    batch = multi_step_batch([2, 2], [0, 0], torch.zeros(4))
    done = torch.tensor([False, False, False, True])
    with pytest.raises(TrajectoryValidationError, match="0 done rows"):
        GroupAdvantage(2).write(batch.with_columns(done=done, terminated=done))


def test_error_group_too_large_and_late_trajectory():
    batch = make_batch(1, 5)
    with pytest.raises(TrajectoryValidationError, match="group 0 has 5 trajectories.*group_size is 4"):
        GroupAdvantage(4).write(batch)
    ga = GroupAdvantage(4)
    ga.write(batch.select([0, 1, 2, 3]))
    with pytest.raises(TrajectoryValidationError, match="already completed"):
        ga.write(batch.select([4]))


def test_error_non_finite_reward_stores_nothing():
    batch = make_batch(1, 4)
    reward = batch["reward"].clone()
    reward[1] = float("nan")
    ga = GroupAdvantage(4)
    ga.write(batch.select([0]))
    with pytest.raises(TrajectoryValidationError, match="row 1, field 'reward'.*not finite"):
        ga.write(batch.with_columns(reward=reward).select([2, 1]))
    assert ga.pending.num_rows == 1  # the rejected write left the pending state as it was


def test_error_trajectory_sent_twice():
    batch = make_batch(1, 4)
    ga = GroupAdvantage(4)
    ga.write(batch.select([0, 1]))
    with pytest.raises(TrajectoryValidationError, match="already pending"):
        ga.write(batch.select([1, 2]))


def test_error_attached_without_invert():
    from torchrl.data import ListStorage, ReplayBuffer
    rb = ReplayBuffer(storage=ListStorage(10))
    rb.append_transform(GroupAdvantage(4))
    with pytest.raises(RuntimeError, match="invert=True"):
        rb.extend(make_batch(1, 4))
