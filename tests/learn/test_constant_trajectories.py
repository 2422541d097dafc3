"""Dr. GRPO's ``constant`` aggregation on multi-turn trajectories: a constant per trajectory.

Dr. GRPO (arXiv:2503.20783) divides each sequence's summed token losses by a fixed maximum
length, never by the tokens it holds, then averages over sequences. A trajectory trains as ONE
sequence whose mask skips the environment's tokens, so its loss is the sum over its sampled
tokens divided by ``max_tokens`` (the trajectory's budget), averaged over trajectories: written
here by hand from each trajectory's rebuilt token list, and compared with the learner's padded
and packed steps, in several micro-batches and in one.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_trajectories import (
    TURNS,
    _model,
    _token_log_probs,
    assert_same,
    learner_step,
    multi_turn_rows,
    trajectories_of,
    trajectory_batch,
    with_sampler_log_probs_near,
)

from rlhf_pipeline.agents.episode import rebuild_trajectory
from rlhf_pipeline.learn.loss import grpo_loss
from rlhf_pipeline.learn.packed_attention import use_packed_attention
from rlhf_pipeline.learn.settings import GRPOLossConfig, LearnerSettings

pytestmark = pytest.mark.usefixtures("one_torch_thread")
BUDGET = 24  # above every trajectory's sampled tokens (19 at most), below its sampled + environment tokens (32)


def hand_constant_loss(model, rows, max_tokens: int) -> torch.Tensor:
    """sum over trajectories of (sum of the policy term over its sampled tokens) / max_tokens, over
    the number of trajectories; each trajectory's advantage (its last row's) on its sampled tokens."""
    sums = []
    for trajectory in trajectories_of(rows):
        rebuilt = rebuild_trajectory(trajectory)
        mask = rebuilt.loss_mask[1:]  # token t is scored from position t - 1
        logp = _token_log_probs(model, rebuilt.token_ids)[mask]
        ratio = torch.exp(logp - rebuilt.log_probs[1:][mask])
        advantage = float(trajectory["advantage"][int(torch.argmax(trajectory["step"]))])
        policy = -torch.minimum(ratio * advantage, ratio.clamp(0.8, 1.2) * advantage)
        sums.append(policy.sum() / max_tokens)  # no division by the tokens it holds
    return torch.stack(sums).mean()


def test_constant_divides_each_trajectory_by_the_fixed_budget_padded_and_packed():
    model = _model()
    rows = with_sampler_log_probs_near(model, multi_turn_rows(TURNS))
    sampled = [int(t["response_tokens"].lengths().sum()) for t in trajectories_of(rows)]
    environment = [int(t["prompt_tokens"].lengths()[1:].sum()) for t in trajectories_of(rows)]
    assert max(sampled) <= BUDGET < max(s + e for s, e in zip(sampled, environment))  # env tokens would not fit
    model.zero_grad(set_to_none=True)
    loss = hand_constant_loss(model, rows, BUDGET)
    loss.backward()
    want = (float(loss.detach()), {name: p.grad.clone() for name, p in model.named_parameters()})
    config = GRPOLossConfig(aggregation="constant", max_tokens=BUDGET)
    batch = trajectory_batch(rows)
    for packing, micro_tokens in ((False, 60), (True, 60), (True, 10_000)):
        stepped = copy.deepcopy(model)
        if packing:
            use_packed_attention(stepped)
        assert_same(learner_step(stepped, batch, LearnerSettings(packing=packing, micro_batch_tokens=micro_tokens,
                                                                 loss=config)), want)
    # the premise of "constant, not per token": the token mean weighs the trajectories otherwise
    token_mean = LearnerSettings(packing=False, micro_batch_tokens=10_000)
    assert learner_step(copy.deepcopy(model), batch, token_mean)[0] != pytest.approx(want[0], rel=1e-3)


def test_a_budget_below_a_trajectorys_sampled_tokens_is_refused_naming_the_setting():
    model = _model()
    rows = multi_turn_rows(TURNS)
    longest = max(int(t["response_tokens"].lengths().sum()) for t in trajectories_of(rows))
    one_turn = int(rows["response_tokens"].lengths().max())
    assert one_turn < longest  # the premise: a turn's maximum is not a trajectory's
    batch = trajectory_batch(rows)
    settings = LearnerSettings(packing=False, micro_batch_tokens=10_000,
                               loss=GRPOLossConfig(aggregation="constant", max_tokens=one_turn))
    with pytest.raises(ValueError, match=f"max_tokens={one_turn}, but a row carries loss on {longest} sampled "
                                         f"tokens.*learner.loss.max_tokens"):
        learner_step(model, batch, settings)
    # exactly the longest trajectory's count is a valid maximum
    learner_step(model, batch, LearnerSettings(packing=False, micro_batch_tokens=10_000,
                                               loss=GRPOLossConfig(aggregation="constant", max_tokens=longest)))


def test_single_turn_constant_is_unchanged():
    # (B, T) rows whose every response token carries loss: sum / (B * max_tokens), as before
    mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)
    log_probs = torch.zeros(2, 4, requires_grad=True)
    loss, _ = grpo_loss(log_probs, torch.zeros(2, 4), torch.tensor([1.0, -2.0]), mask,
                        GRPOLossConfig(aggregation="constant", max_tokens=3))
    assert float(loss.detach()) == pytest.approx(-(1.0 * 3 - 2.0 * 2) / (2 * 3))
