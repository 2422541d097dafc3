"""GRPO loss: parity with torchrl 0.14.1's GRPOLoss, the menu's variants, the log-prob forward."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torchrl.objectives.llm.grpo import GRPOLoss

from rlhf_pipeline.schema.padding import pad_batch
from rlhf_pipeline.collect import Collector, CollectorConfig, PromptSource, SamplingConfig, SingleTurn
from rlhf_pipeline.collect.toy_task import toy_prompts, toy_reward
from rlhf_pipeline.learn.loss import (
    LOGPROB_DIFF_THRESHOLD,
    GRPOLossConfig,
    aggregates_by_token,
    effective_sample_size,
    grpo_loss,
    grpo_step_loss,
    response_logprobs,
)
from rlhf_pipeline.models import tiny_model_and_tokenizer

B, T = 6, 9


def _tensors(seed=0, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    log_probs = (old + torch.randn(B, T, generator=g, dtype=torch.float64) * spread).requires_grad_()
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = torch.tensor([9, 1, 4, 7, 2, 5])
    mask = torch.arange(T)[None, :] >= (T - lengths)[:, None]  # left-aligned-to-the-end ragged rows
    entropy = torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    ref = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    return log_probs, old, adv, mask, entropy, ref


# ====================================================================== torchrl parity
def _torchrl_terms(loss_module: GRPOLoss, log_probs, old, adv, mask, entropy, ref):
    """torchrl's own computations on the same padded tensors (its forward minus the actor call)."""
    log_weight = torch.where(mask, log_probs - old, 0.0).unsqueeze(-1)  # (B, T, 1) as in _log_weight
    advantage = (adv[:, None] * mask).unsqueeze(-1)  # (B, T, 1) as pad_batch writes it
    objective, clip_fraction = loss_module._compute_policy_objective(log_weight, advantage)
    # prompt_mean returns shape (1,), token_mean shape (): compare as scalars
    out = {"loss_objective": loss_module._aggregate_loss_value(objective, mask).reshape(())}
    out["loss_entropy"] = loss_module._aggregate_loss_value(
        (-loss_module.entropy_coeff * entropy).unsqueeze(-1), mask).reshape(())
    td = TensorDict({"_cur_log_prob": torch.where(mask, log_probs, 0.0)}, batch_size=[B])
    out["loss_kl_to_ref"], out["kl_to_ref"] = loss_module._kl_to_ref(td, ref_log_prob=ref, mask=mask)
    lw = log_weight.squeeze(-1)[mask]
    out["ESS"] = (2 * lw.logsumexp(0) - (2 * lw).logsumexp(0)).exp() / mask.sum()
    return out


@pytest.mark.parametrize("eps", [(0.2, 0.2), (0.2, 0.28), (0.1, 0.3)])
@pytest.mark.parametrize("aggregation, torchrl_aggregation", [("token_mean", "token_mean"),
                                                             ("sequence_mean", "prompt_mean")])
def test_matches_torchrl_grpo_loss(eps, aggregation, torchrl_aggregation):
    log_probs, old, adv, mask, entropy, ref = _tensors(spread=0.4)
    theirs = GRPOLoss(None, clip_epsilon=eps, aggregation=torchrl_aggregation, entropy_coeff=0.03,
                      kl_to_ref_coeff=0.1)
    want = _torchrl_terms(theirs, log_probs, old, adv, mask, entropy, ref)

    config = GRPOLossConfig(clip_eps_low=eps[0], clip_eps_high=eps[1], aggregation=aggregation)
    _, ours = grpo_loss(log_probs, old, adv, mask, config, entropy=entropy, ref_log_probs=ref)
    torch.testing.assert_close(ours["policy_loss"], want["loss_objective"].detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(ours["ess"], want["ESS"], atol=1e-6, rtol=0)
    # torchrl averages the KL over all B*T positions (padding counted as 0); ours over response tokens
    torch.testing.assert_close(ours["kl"] * mask.sum() / mask.numel(), want["kl_to_ref"].detach(), atol=1e-6, rtol=0)

    # the full loss with entropy bonus and KL: theirs sums loss_objective + loss_entropy (+ kl in our
    # aggregation, which torchrl does not offer), so compare the objective + entropy parts
    with_entropy = GRPOLossConfig(clip_eps_low=eps[0], clip_eps_high=eps[1], aggregation=aggregation,
                                  entropy_coef=0.03)
    loss, _ = grpo_loss(log_probs, old, adv, mask, with_entropy, entropy=entropy)
    torch.testing.assert_close(loss, want["loss_objective"] + want["loss_entropy"], atol=1e-6, rtol=0)
    # and gradients agree too
    (g_ours,) = torch.autograd.grad(loss, log_probs)
    (g_theirs,) = torch.autograd.grad(want["loss_objective"] + want["loss_entropy"], log_probs)
    torch.testing.assert_close(g_ours, g_theirs, atol=1e-6, rtol=0)


def test_some_tokens_are_clipped_in_the_parity_data():
    # guards the parity test against passing only because nothing was clipped
    log_probs, old, adv, mask, *_ = _tensors(spread=0.4)
    _, m = grpo_loss(log_probs, old, adv, mask, GRPOLossConfig())
    assert m["clip_frac_low"] > 0 and m["clip_frac_high"] > 0


# ====================================================================== the menu
def test_on_policy_loss_is_minus_mean_advantage():
    log_probs, _, adv, mask, *_ = _tensors()
    old = log_probs.detach()
    tokens = mask.sum(-1).double()
    loss, m = grpo_loss(log_probs, old, adv, mask, GRPOLossConfig(aggregation="token_mean"))
    torch.testing.assert_close(loss, -(adv * tokens).sum() / tokens.sum())
    loss, _ = grpo_loss(log_probs, old, adv, mask, GRPOLossConfig(aggregation="sequence_mean"))
    torch.testing.assert_close(loss, -adv.mean())
    loss, _ = grpo_loss(log_probs, old, adv, mask, GRPOLossConfig(aggregation="constant", max_tokens=16))
    torch.testing.assert_close(loss, -(adv * tokens).sum() / (B * 16))
    assert m["ratio_mean"] == 1 and m["ess"] == pytest.approx(1.0) and m["clip_frac_low"] == 0


def test_clip_fractions_count_only_clipped_gradients():
    old = torch.zeros(1, 4)
    log_probs = torch.log(torch.tensor([[0.5, 1.5, 0.5, 1.5]])).requires_grad_()
    mask = torch.ones(1, 4, dtype=torch.bool)
    for adv, low, high in [(torch.tensor([-1.0]), 0.25, 0.0), (torch.tensor([1.0]), 0.0, 0.25)]:
        loss, m = grpo_loss(log_probs, old, adv, mask, GRPOLossConfig(clip_eps_low=0.2, clip_eps_high=0.28))
        assert m["clip_frac_low"] == pytest.approx(low * 2) and m["clip_frac_high"] == pytest.approx(high * 2)
        (grad,) = torch.autograd.grad(loss, log_probs)
        # A<0: the ratio 0.5 token is clipped (no gradient); A>0: the ratio 1.5 token is
        clipped_col = 0 if adv < 0 else 1
        assert grad[0, clipped_col] == 0 and grad[0, 1 - clipped_col] != 0


def test_gspo_uses_one_ratio_per_sequence():
    log_probs, old, adv, mask, *_ = _tensors(spread=0.01)  # small drift: nothing clipped at eps 0.2
    config = GRPOLossConfig(ratio_level="sequence", aggregation="sequence_mean")
    loss, m = grpo_loss(log_probs, old, adv, mask, config)
    n = mask.sum(-1)
    s = (torch.where(mask, log_probs - old, 0.0).sum(-1) / n).exp()  # (B,)
    torch.testing.assert_close(loss, -(s * adv).mean())
    (grad,) = torch.autograd.grad(loss, log_probs)
    want = torch.where(mask, (-adv * s / n / B)[:, None].expand(B, T), 0.0)
    torch.testing.assert_close(grad, want.detach())
    # GSPO clips the whole sequence: a big drift on one token clips every token of that row
    _, m = grpo_loss(log_probs.detach() + 0.5 * mask, old, torch.ones(B), mask,
                     GRPOLossConfig(ratio_level="sequence", clip_eps_low=3e-4, clip_eps_high=4e-4))
    assert m["clip_frac_high"] == pytest.approx(1.0)


def test_kl_in_the_loss_is_k3():
    log_probs, old, adv, mask, _, ref = _tensors()
    base, _ = grpo_loss(log_probs, old, adv, mask, GRPOLossConfig(), ref_log_probs=ref)
    with_kl, m = grpo_loss(log_probs, old, adv, mask, GRPOLossConfig(kl_coef=0.5), ref_log_probs=ref)
    d = torch.where(mask, ref - log_probs, 0.0)
    k3 = ((d.exp() - d - 1) * mask).sum() / mask.sum()
    torch.testing.assert_close(with_kl - base, 0.5 * k3)
    torch.testing.assert_close(m["kl"], k3.detach())
    assert m["kl"] > 0


def test_truncated_importance_sampling():
    log_probs, old, adv, mask, *_ = _tensors()
    g = torch.Generator().manual_seed(9)
    sampler = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.7
    config = GRPOLossConfig(tis_cap=1.5)
    loss, m = grpo_loss(log_probs, log_probs.detach(), adv, mask, config, sampler_log_probs=sampler)
    w = (log_probs.detach() - sampler).exp().clamp(max=1.5)
    want = (-(adv[:, None] * w) * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, want)
    assert 0 < m["tis_clip_frac"] < 1 and 0 < m["ess"] < 1
    torch.testing.assert_close(m["ess"], effective_sample_size(w.log(), mask))


def test_config_errors_name_the_option():
    log_probs, old, adv, mask, *_ = _tensors()
    with pytest.raises(ValueError, match="needs ref_log_probs"):
        grpo_loss(log_probs, old, adv, mask, GRPOLossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="sampler_log_probs"):
        grpo_loss(log_probs, old, adv, mask, GRPOLossConfig(tis_cap=2.0))
    # it named neither setting as --set spells it
    with pytest.raises(ValueError, match=r"^setting 'learner.loss.aggregation' is 'constant' \(Dr. GRPO\), which divides "
                                         r"by 'learner.loss.max_tokens': set it too.*--set learner.loss.max_tokens=512$"):
        GRPOLossConfig(aggregation="constant")
    with pytest.raises(ValueError, match=r"unknown GRPO loss option\(s\) \['clip'\]"):
        GRPOLossConfig.from_options({"clip": 0.2})
    with pytest.raises(ValueError, match=r"must all be \(B, T\)"):
        grpo_loss(log_probs[:, 1:], old, adv, mask)
    assert aggregates_by_token({}) and not aggregates_by_token({"aggregation": "sequence_mean"})


def test_sampler_mismatch_is_the_learner_against_the_stored_log_probs():
    log_probs, _, adv, mask, _, _ = _tensors()
    # the stored log-probs off by known amounts on the response tokens: 0.5 on one, 0.2 on another
    offsets = torch.full((B, T), 1e-3, dtype=torch.float64)
    offsets[0, -1], offsets[3, -2] = 0.5, -0.2
    sampler = log_probs.detach() + offsets
    _, m = grpo_loss(log_probs, sampler, adv, mask, sampler_log_probs=sampler)
    n = int(mask.sum())
    assert float(m["sampler_logprob_diff_max"]) == pytest.approx(0.5)
    assert float(m["sampler_logprob_diff_mean"]) == pytest.approx((0.5 + 0.2 + 1e-3 * (n - 2)) / n)
    assert LOGPROB_DIFF_THRESHOLD < 0.2 and float(m["sampler_logprob_diff_frac"]) == pytest.approx(2 / n)
    _, without = grpo_loss(log_probs, sampler, adv, mask)  # no stored log-probs given: nothing to compare
    assert "sampler_logprob_diff_max" not in without


# ====================================================================== forward on a padded batch
@pytest.fixture(scope="module")
def collected():
    model, tok = tiny_model_and_tokenizer(hidden_size=32, num_layers=2, num_heads=4)
    config = CollectorConfig(tasks_per_round=4, group_size=4,
                             sampling=SamplingConfig(max_new_tokens=6, temperature=1.5))
    collector = Collector(model, tok, PromptSource(toy_prompts(8)), SingleTurn({"toy": toy_reward}), None, config)
    batch = collector.collect()
    adv = torch.randn(len(batch), generator=torch.Generator().manual_seed(0))
    return model, tok, batch.with_columns(advantage=adv)


def test_learner_log_probs_equal_sampler_log_probs(collected):
    model, tok, batch = collected
    padded = pad_batch(batch, pad_token_id=tok.pad_token_id)
    log_probs, entropy = response_logprobs(model, padded, temperature=1.5)
    mask = padded["masks", "all_assistant_mask"]
    assert log_probs.shape == mask.shape == entropy.shape
    torch.testing.assert_close(log_probs[mask], padded["log_probs", "full"][mask], atol=1e-5, rtol=0)
    assert bool((entropy[mask] > 0).all()) and bool((log_probs[~padded["masks", "all_attention_mask"]] == 0).all())
    # without position_ids in the batch they are rebuilt from the mask
    del padded["position_ids"]
    again, _ = response_logprobs(model, padded, temperature=1.5)
    torch.testing.assert_close(again, log_probs, atol=1e-6, rtol=0)


def test_step_loss_backpropagates(collected):
    model, tok, batch = collected
    padded = pad_batch(batch, pad_token_id=tok.pad_token_id)
    model.zero_grad()
    loss, m = grpo_step_loss(model, padded, temperature=1.5, entropy_coef=0.01)
    loss.backward()
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and m["ess"] == pytest.approx(1.0, abs=1e-4)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    for key in ("loss", "policy_loss", "kl", "entropy", "clip_frac_low", "clip_frac_high", "ess"):
        assert key in m and m[key].dim() == 0
    with pytest.raises(KeyError, match="group-advantage"):
        grpo_step_loss(model, pad_batch(batch.without("advantage"), pad_token_id=0))
    model.zero_grad()


@pytest.mark.parametrize("aggregation, torchrl_aggregation", [("token_mean", "token_mean"),
                                                             ("sequence_mean", "prompt_mean")])
def test_matches_torchrl_grpo_loss_end_to_end_on_a_padded_batch(collected, aggregation, torchrl_aggregation):
    """torchrl's GRPOLoss.forward around TransformersWrapper(tiny Qwen2) vs grpo_step_loss, same pad_batch."""
    from torchrl.modules.llm import TransformersWrapper

    _, tok, batch = collected
    padded = pad_batch(batch, pad_token_id=tok.pad_token_id)
    # a perturbed policy, so ratios move away from 1 and some tokens clip
    policy, _ = tiny_model_and_tokenizer(hidden_size=32, num_layers=2, num_heads=4)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    wrapper = TransformersWrapper(policy, tokenizer=tok, input_mode="tokens", generate=False,
                                  pad_output=True, return_log_probs=True)
    theirs = GRPOLoss(wrapper, clip_epsilon=(0.2, 0.28), aggregation=torchrl_aggregation,
                      entropy_bonus=True, entropy_coeff=0.02, masking_strategy="sft")
    out = theirs(padded.copy())
    their_loss = (out.loss_objective + out.loss_entropy).reshape(())
    their_grads = torch.autograd.grad(their_loss, list(policy.parameters()))

    # sampler log-probs are at temperature 1.5; torchrl recomputes at 1.0, so compare at 1.0
    ours, m = grpo_step_loss(policy, padded, temperature=1.0, clip_eps_low=0.2, clip_eps_high=0.28,
                             aggregation=aggregation, entropy_coef=0.02)
    our_grads = torch.autograd.grad(ours, list(policy.parameters()))
    torch.testing.assert_close(ours, their_loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(m["ess"], out.ESS.reshape(()), atol=1e-6, rtol=0)
    # torchrl logs the entropy averaged over all (B, T) positions, padding as 0; ours over response tokens
    mask = padded["masks", "all_assistant_mask"]
    torch.testing.assert_close(m["entropy"] * mask.sum() / mask.numel(), out.entropy.reshape(()), atol=1e-5, rtol=0)
    assert m["clip_frac_low"] + m["clip_frac_high"] > 0
    for a, b in zip(our_grads, their_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_int32_token_ids_give_the_same_loss_and_gradients(collected):
    """The learner reads int32 ids and positions (collate.py, "Index dtype"): nothing changes."""
    model, tok, batch = collected
    results = []
    for index_dtype in (torch.int64, torch.int32):
        model.zero_grad()
        loss, _ = grpo_step_loss(model, pad_batch(batch, pad_token_id=tok.pad_token_id, index_dtype=index_dtype))
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    model.zero_grad()
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.equal(a, b)


def test_a_step_reports_the_largest_mismatch_over_its_micro_batches(collected):
    import dataclasses

    from rlhf_pipeline.learn.settings import LearnerSettings
    from rlhf_pipeline.learn.step import plan_step, train_step

    model, tok, batch = collected
    log_probs = batch["response_log_probs"]
    values = log_probs.values.clone()
    values[log_probs.offsets[-2]] += 0.75  # the first token of the last row: its micro-batch is not the first
    skewed = batch.with_columns(response_log_probs=type(log_probs)(values, log_probs.offsets))
    settings = dataclasses.replace(LearnerSettings(), micro_batch_tokens=40, packing=False, temperature=1.5)
    plan = plan_step(pad_batch(skewed, pad_token_id=tok.pad_token_id), settings)
    assert len(plan.micro_batches) > 2
    state = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    try:
        losses = train_step(model, optimizer, scheduler, plan, settings).losses
    finally:
        model.load_state_dict(state)
    # the sampler's own model: the rest of the rows agree to float rounding
    assert losses["sampler_logprob_diff_max"] == pytest.approx(0.75, abs=1e-4)
    assert losses["sampler_logprob_diff_mean"] < 0.75 / 4
