"""KL estimators, token rewards and the adaptive coefficient, checked against torchrl's own objects."""

from __future__ import annotations

import types

import pytest
import torch
from helpers import make_batch
from tensordict import TensorDict, lazy_stack
from torchrl.data.llm.utils import AdaptiveKLController as TorchrlAdaptiveKL
from torchrl.envs.llm.transforms.kl import KLComputation
from torchrl.objectives.llm.grpo import GRPOLoss

from rlhf_pipeline.schema.ragged import RaggedTensor
from rlhf_pipeline.schema import TrajectoryValidationError
from rlhf_pipeline.transforms import AdaptiveKLController, KLReward, kl_k1, kl_k2, kl_k3, kl_token_rewards


def _log_probs(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return -torch.rand(shape, generator=gen) * 3 - 1e-3


def test_estimators_by_hand():
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    torch.testing.assert_close(kl_k1(lp, ref), torch.tensor([0.5, -1.0]))
    torch.testing.assert_close(kl_k2(lp, ref), torch.tensor([0.125, 0.5]))
    d = ref - lp
    torch.testing.assert_close(kl_k3(lp, ref), d.exp() - d - 1)
    assert bool((kl_k3(_log_probs(100, 0), _log_probs(100, 1)) >= 0).all())


def test_k1_token_rewards_match_torchrl_klcomputation():
    """Ragged rows as a lazy stack, the way torchrl's LLM transforms carry them."""
    coef = 0.3
    lp = RaggedTensor.from_sequences([_log_probs(n, 10 + n) for n in (3, 7, 1, 4)])
    ref = RaggedTensor(_log_probs(lp.values.numel(), 9), lp.offsets)
    scalar = torch.randn(4, generator=torch.Generator().manual_seed(2))
    rows = []
    for i in range(4):
        dense_reward = torch.zeros(lp.lengths()[i], 1)
        dense_reward[-1, 0] = scalar[i]  # the scalar reward on the last token, as we write it
        rows.append(TensorDict(next=TensorDict({("log_probs", "full"): lp.row(i),
                                                ("ref_log_probs", "full"): ref.row(i), "reward": dense_reward})))
    expected = KLComputation(add_to_reward=True, coeff=coef)(lazy_stack(rows))["next"]
    kl, rewards = kl_token_rewards(lp, ref, scalar, coef=coef, estimator="k1")
    torch.testing.assert_close(kl.values, torch.cat(expected.get("kl_penalty", as_list=True)), atol=1e-6, rtol=0)
    torch.testing.assert_close(rewards.values, torch.cat(expected.get("reward", as_list=True)).reshape(-1),
                               atol=1e-6, rtol=0)


def test_k3_matches_grpo_loss_kl_to_ref():
    b, t = 3, 5
    lp, ref = _log_probs((b, t), 3), _log_probs((b, t), 4)
    fake_loss = types.SimpleNamespace(kl_to_ref_coeff=0.2)
    _, expected = GRPOLoss._kl_to_ref(fake_loss, TensorDict(_cur_log_prob=lp, batch_size=[b]), ref_log_prob=ref)
    offsets = torch.arange(0, b * t + 1, t)
    kl, _ = kl_token_rewards(RaggedTensor(lp.reshape(-1), offsets), RaggedTensor(ref.reshape(-1), offsets),
                             torch.zeros(b), coef=0.2, estimator="k3")
    torch.testing.assert_close(kl.values.mean(), expected, atol=1e-6, rtol=0)


def test_adaptive_controller_matches_torchrl():
    ours = AdaptiveKLController(0.1, target_kl=6.0, horizon=1000)
    theirs = TorchrlAdaptiveKL(init_kl_coef=0.1, target=6.0, horizon=1000)
    gen = torch.Generator().manual_seed(5)
    for _ in range(6):
        kl = torch.rand(16, generator=gen) * 12  # per-sequence KL of one write
        # torchrl's update takes the KL *rewards* (-coef * kl) and divides the coef back out
        expected = theirs.update((-theirs.coef * kl).tolist())
        got = ours.update(float(kl.mean()), kl.numel())
        assert got == pytest.approx(float(expected), rel=1e-6)


def test_transform_writes_kl_and_token_rewards_and_keeps_reward():
    batch = make_batch(2, 3, optional=("ref_log_probs",))
    t = KLReward(0.05, estimator="k2")
    out = t.write(batch)
    lp, ref = batch["response_log_probs"], batch["ref_log_probs"]
    torch.testing.assert_close(out["kl"].values, 0.5 * (lp.values - ref.values) ** 2)
    last = lp.offsets[1:] - 1
    expected = -0.05 * out["kl"].values
    expected[last] += batch["reward"]
    torch.testing.assert_close(out["token_rewards"].values, expected)
    assert torch.equal(out["reward"], batch["reward"])


def test_adaptive_coefficient_moves_and_is_saved():
    batch = make_batch(2, 4, optional=("ref_log_probs",))
    t = KLReward(0.1, target_kl=1e-3, horizon=10)  # KL far above target: the coefficient grows
    t.write(batch)
    assert t.coef == pytest.approx(0.1 * (1 + 0.2 * 8 / 10))
    restored = KLReward(0.1, target_kl=1e-3, horizon=10)
    restored.load_state_dict(t.state_dict())
    assert restored.coef == t.coef and restored.controller.coef == t.coef


def test_errors_name_the_field():
    batch = make_batch(1, 2)
    with pytest.raises(TrajectoryValidationError, match="field 'ref_log_probs'.*ReferenceLogProbs"):
        KLReward().write(batch)
    short = RaggedTensor.from_sequences([[-1.0], [-1.0, -2.0]])
    longer = RaggedTensor.from_sequences([[-1.0, -2.0], [-1.0, -2.0]])
    with pytest.raises(TrajectoryValidationError, match="row 0, field 'ref_log_probs'"):
        kl_token_rewards(longer, short, torch.zeros(2), coef=0.1)
