"""Packed learner steps: the plan, the packed attention, and exactness against the padded step.

The padded step is the learner's: ``split_microbatches_with_rows`` + ``grpo_step_loss`` on a
``pad_batch`` batch; the packed step: ``packed_micro_batches`` + ``grpo_packed_loss`` on the
same rows. Both accumulate ``loss * weight`` over their micro-batches as the learner does
(weight = the micro-batch's share of response tokens for token_mean, of rows otherwise).
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_pipeline.learn import packed_attention
from rlhf_pipeline.learn.batch import (
    RaggedRows,
    pack_rows,
    packed_micro_batches,
    plan_packs,
    split_microbatches_with_rows,
)
from rlhf_pipeline.learn.loss import (
    aggregates_by_token,
    grpo_packed_loss,
    grpo_step_loss,
    packed_response_logprobs,
    response_logprobs,
)
from rlhf_pipeline.learn.packed_attention import use_packed_attention
from rlhf_pipeline.models.tiny import tiny_causal_lm
from rlhf_pipeline.schema.padding import pad_batch
from rlhf_pipeline.schema.synthetic import batch_with_lengths

VOCAB = 97
BUDGET = 96
# very uneven rows: 1-token prompt and response, a long prompt, a long response, and one row
# (60 + 70 tokens) longer than the budget on its own
PROMPTS = [1, 3, 40, 7, 60, 2, 11, 5, 24]
RESPONSES = [1, 30, 2, 55, 70, 9, 1, 17, 4]


# ====================================================================== the plan
def test_plan_puts_every_row_once_within_budget_and_an_overlong_row_alone():
    lengths = [p + r for p, r in zip(PROMPTS, RESPONSES)]
    plan = plan_packs(lengths, BUDGET)
    assert sorted(i for rows in plan.sequences for i in rows) == list(range(len(lengths)))
    assert plan.oversized == [4]
    for rows, tokens in zip(plan.sequences, plan.sequence_tokens):
        assert tokens <= BUDGET or rows == (4,)
    assert plan_packs(lengths, BUDGET) == plan  # a pure function of its inputs


def test_plan_breaks_ties_by_row_order():
    plan = plan_packs([5, 5, 5, 5], budget=10)
    assert plan.sequences == ((0, 1), (2, 3))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=80), st.integers(1, 256))
def test_plan_properties(lengths, budget):
    plan = plan_packs(lengths, budget)
    assert sorted(i for rows in plan.sequences for i in rows) == list(range(len(lengths)))
    for rows, tokens in zip(plan.sequences, plan.sequence_tokens):
        assert tokens <= budget or (len(rows) == 1 and lengths[rows[0]] > budget)
    # first fit: no two sequences of fitting rows could have been merged into one
    fitting = sorted(t for rows, t in zip(plan.sequences, plan.sequence_tokens) if lengths[rows[0]] <= budget)
    assert len(fitting) < 2 or fitting[0] + fitting[1] > budget
    assert len(plan.sequences) >= plan.lower_bound


def test_plan_fills_skewed_grpo_lengths_near_the_lower_bound():
    # clipped log-normal lengths like the learner benchmark's: prompts 32-256, responses 16-1,024
    g = torch.Generator().manual_seed(0)
    prompts = torch.exp(torch.log(torch.tensor(130.0)) + 0.45 * torch.randn(256, generator=g)).round().clamp(32, 256)
    responses = torch.exp(torch.log(torch.tensor(450.0)) + 0.75 * torch.randn(256, generator=g)).round().clamp(16, 1024)
    plan = plan_packs((prompts + responses).long().tolist(), 8192)
    assert plan.utilisation > 0.97
    assert len(plan.sequences) <= plan.lower_bound + 1


# ====================================================================== the packed forward
def _model(seed: int = 0, **kwargs):
    return tiny_causal_lm(VOCAB, hidden_size=32, num_layers=2, num_heads=4, pad_token_id=0, eos_token_id=1,
                          seed=seed, **kwargs).train()


def _batch(prompts=PROMPTS, responses=RESPONSES, *, sampler_noise_from=None, seed=0):
    """A padded batch of the given lengths. With ``sampler_noise_from`` (a model) the sampling
    log-probs are that model's own plus noise of 0.05, so ratios stay near 1 (few clipped
    tokens, none on a clip boundary by accident) and the loss has gradient on most tokens.
    Advantages are mostly positive (mean 1, some negative): group-normalised ones sum to 0 and
    the loss would then be a difference of near-equal float32 sums, which no relative tolerance
    can compare."""
    rows = batch_with_lengths(prompts, responses, group_size=3, seed=seed, vocab_size=VOCAB,
                              optional_fields=("advantage", "ref_log_probs"))
    batch = pad_batch(rows, pad_token_id=0)
    g = torch.Generator().manual_seed(seed + 2)
    advantage = 1.0 + 0.7 * torch.randn(len(prompts), generator=g)
    batch["sequence_advantage"] = advantage
    batch["advantage"] = (advantage[:, None, None] * batch["masks", "all_assistant_mask"][..., None]).float()
    if sampler_noise_from is not None:
        with torch.no_grad():
            own, _ = response_logprobs(sampler_noise_from, batch)
        g = torch.Generator().manual_seed(seed + 1)
        mask = batch["masks", "all_assistant_mask"]
        noisy = torch.where(mask, own + 0.05 * torch.randn(own.shape, generator=g), 0.0)
        batch["log_probs", "full"] = noisy
        batch["log_probs", "response"] = noisy[:, batch["tokens", "prompt"].shape[1]:]
        ref = torch.where(mask, own + 0.1 * torch.randn(own.shape, generator=g), 0.0)
        batch["next", "ref_log_probs", "full"] = ref
        batch["ref_log_probs", "response"] = ref[:, batch["tokens", "prompt"].shape[1]:]
    return batch


def test_packed_log_probs_equal_the_padded_forward():
    model = _model()
    batch = _batch()
    with torch.no_grad():
        padded_lp, padded_ent = response_logprobs(model, batch)
    packed_model = copy.deepcopy(model)
    use_packed_attention(packed_model)
    rows = RaggedRows.from_padded(batch)
    prompt_width = batch["tokens", "prompt"].shape[1]
    for micro in packed_micro_batches(rows, BUDGET):
        with torch.no_grad():
            lp, ent = packed_response_logprobs(packed_model, micro)
        width = lp.shape[1]
        want_lp = padded_lp[micro.rows, prompt_width:prompt_width + width]
        want_ent = padded_ent[micro.rows, prompt_width:prompt_width + width]
        torch.testing.assert_close(lp, torch.where(micro.response_mask, want_lp, 0.0), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, torch.where(micro.response_mask, want_ent, 0.0), rtol=1e-5, atol=1e-5)


def test_packed_sequence_layout():
    rows = RaggedRows.from_padded(_batch(prompts=[2, 1, 3], responses=[1, 2, 2]))
    micro = pack_rows(rows, [0, 2])
    assert micro.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]
    assert micro.cu_seq_lens.tolist() == [0, 3, 8] and micro.max_length == 5
    assert micro.logit_positions.tolist() == [1, 5, 6]  # the token before each response token
    assert micro.targets.tolist() == micro.input_ids[0, [2, 6, 7]].tolist()
    assert micro.response_mask.tolist() == [[True, False], [True, True]]


@pytest.fixture(params=["rectangle", "per-row"])
def cpu_attention_path(request, monkeypatch):
    """Each of the packed attention's two CPU paths, whatever its cost rule would pick."""
    monkeypatch.setattr(packed_attention, "_rectangle_is_cheaper", lambda *_: request.param == "rectangle")
    return request.param


@pytest.mark.parametrize("lengths", [[5, 6, 4, 7, 5, 6], [40, 3, 25]], ids=["many-short-rows", "few-long-rows"])
def test_packed_attention_never_crosses_rows(lengths, cpu_attention_path):
    """A row's outputs do not change when the tokens of the other rows in its sequence do."""
    model = _model()
    use_packed_attention(model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, VOCAB, (1, sum(lengths)), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        before = model(input_ids=ids, position_ids=positions, cu_seq_lens_q=cu).logits
        others = ids.clone()
        others[0, lengths[0]:] = torch.randint(2, VOCAB, (sum(lengths) - lengths[0],), generator=g)
        after = model(input_ids=others, position_ids=positions, cu_seq_lens_q=cu).logits
        alone = model(input_ids=ids[:, :lengths[0]], position_ids=positions[:, :lengths[0]]).logits
        # without cu_seq_lens the rows are found from the restarting positions
        found = model(input_ids=ids, position_ids=positions).logits
    torch.testing.assert_close(after[:, :lengths[0]], before[:, :lengths[0]], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(alone, before[:, :lengths[0]], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(found, before, rtol=1e-5, atol=1e-6)


def test_many_short_rows_take_one_rectangle_and_long_rows_one_call_each():
    short = [14, 16, 15, 17, 16, 13] * 10  # the default pipeline's rows, 4 heads of 16 dims
    assert packed_attention._rectangle_is_cheaper(short, channels=64)
    skewed = [217, 504, 350, 396, 401, 508, 847, 1183]  # the learner benchmark's, 8 heads of 64 dims
    assert not packed_attention._rectangle_is_cheaper(skewed, channels=512)
    assert not packed_attention._rectangle_is_cheaper([5, 300], channels=64)


def test_a_row_without_prompt_tokens_is_refused():
    rows = RaggedRows.from_padded(_batch(prompts=[0, 2], responses=[3, 1]))
    with pytest.raises(ValueError, match="at least one prompt token"):
        pack_rows(rows, [0, 1])


# ====================================================================== exactness of a whole step
LOSS_VARIANTS = {
    "token_mean": {},
    "sequence_mean": {"aggregation": "sequence_mean"},
    "constant": {"aggregation": "constant", "max_tokens": 80},
    "gspo": {"ratio_level": "sequence", "clip_eps_low": 3e-4, "clip_eps_high": 4e-4, "aggregation": "sequence_mean"},
    "clip_higher": {"clip_eps_low": 0.02, "clip_eps_high": 0.03},
    "kl": {"kl_coef": 0.1},
    "entropy": {"entropy_coef": 0.01},
    "tis_current": {"tis_cap": 1.02, "old_policy": "current"},
}


def _step(model, batch, options, *, packed: bool, row_feedback=None, budget=BUDGET):
    """One learner-style accumulation over micro-batches: (loss, {param: grad}, per-row feedback)."""
    model.zero_grad(set_to_none=True)
    token_mean = aggregates_by_token(options)
    total_tokens = int(batch["masks", "response"].sum())
    total_rows = batch.batch_size[0]
    if packed:
        micros = [(m.rows, m, m.response_tokens, m.num_rows)
                  for m in packed_micro_batches(RaggedRows.from_padded(batch), budget)]
    else:
        micros = [(rows, m, int(m["masks", "response"].sum()), m.batch_size[0])
                  for rows, m in split_microbatches_with_rows(batch, budget)]
    loss_sum, feedback = 0.0, torch.zeros(total_rows)
    for rows, micro, tokens, n in micros:
        weight = tokens / total_tokens if token_mean else n / total_rows
        step_loss = grpo_packed_loss if packed else grpo_step_loss
        loss, stats = step_loss(model, micro, row_feedback=row_feedback, **options)
        (loss * weight).backward()
        loss_sum += float(loss.detach()) * weight
        if row_feedback:
            feedback[rows] = stats["row_feedback"]
    return loss_sum, {name: p.grad.clone() for name, p in model.named_parameters()}, feedback


def _assert_same_step(padded, packed):
    loss_padded, grads_padded, feedback_padded = padded
    loss_packed, grads_packed, feedback_packed = packed
    assert loss_packed == pytest.approx(loss_padded, rel=1e-5, abs=1e-8)
    for name, want in grads_padded.items():
        diff = float((grads_packed[name] - want).norm())
        assert diff <= 1e-5 * float(want.norm()) + 1e-10, f"{name}: |Δgrad| {diff:.3g} vs |grad| {float(want.norm()):.3g}"
    torch.testing.assert_close(feedback_packed, feedback_padded, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("variant", list(LOSS_VARIANTS))
def test_packed_step_equals_padded_step(variant, cpu_attention_path):
    model = _model()
    batch = _batch(sampler_noise_from=model)
    packed_model = copy.deepcopy(model)
    use_packed_attention(packed_model)
    options = LOSS_VARIANTS[variant]
    padded = _step(model, batch, options, packed=False)
    packed = _step(packed_model, batch, options, packed=True)
    assert any(float(g.abs().max()) > 0 for g in padded[1].values())  # the step has something to compare
    _assert_same_step(padded, packed)


@pytest.mark.parametrize("row_feedback", ["loss", "ratio_deviation"])
def test_packed_step_equals_padded_step_with_row_feedback_and_importance_weights(row_feedback):
    model = _model()
    batch = _batch(sampler_noise_from=model)
    batch["sample_weight"] = torch.linspace(0.5, 1.5, batch.batch_size[0])
    packed_model = copy.deepcopy(model)
    use_packed_attention(packed_model)
    padded = _step(model, batch, {}, packed=False, row_feedback=row_feedback)
    packed = _step(packed_model, batch, {}, packed=True, row_feedback=row_feedback)
    assert bool((padded[2] > 0).all())
    _assert_same_step(padded, packed)


def test_packed_step_equals_padded_step_for_one_row_and_for_one_sequence():
    model = _model()
    packed_model = copy.deepcopy(model)
    use_packed_attention(packed_model)
    one_row = _batch(prompts=[13], responses=[21], sampler_noise_from=model)
    _assert_same_step(_step(model, one_row, {}, packed=False), _step(packed_model, one_row, {}, packed=True))
    # the whole batch in one packed sequence (a budget above its tokens), every variant at once
    everything = {"kl_coef": 0.05, "entropy_coef": 0.01, "aggregation": "sequence_mean"}
    batch = _batch(sampler_noise_from=model)
    _assert_same_step(_step(model, batch, everything, packed=False, budget=4096),
                      _step(packed_model, batch, everything, packed=True, budget=4096))


def test_packed_step_equals_padded_step_on_a_llama_model():
    model = _model(arch="llama")
    batch = _batch(sampler_noise_from=model)
    packed_model = copy.deepcopy(model)
    use_packed_attention(packed_model)
    _assert_same_step(_step(model, batch, {"kl_coef": 0.1}, packed=False),
                      _step(packed_model, batch, {"kl_coef": 0.1}, packed=True))


def test_rows_from_stored_batch_pack_like_rows_from_the_padded_batch():
    stored = batch_with_lengths(PROMPTS, RESPONSES, seed=3, vocab_size=VOCAB,
                                optional_fields=("advantage", "ref_log_probs"))
    from_store = packed_micro_batches(RaggedRows.from_trajectory_batch(stored), BUDGET)
    from_padded = packed_micro_batches(RaggedRows.from_padded(pad_batch(stored)), BUDGET)
    assert len(from_store) == len(from_padded)
    for a, b in zip(from_store, from_padded):
        for name in ("rows", "input_ids", "position_ids", "cu_seq_lens", "logit_positions", "targets",
                     "response_mask", "sampler_log_probs", "advantages", "ref_log_probs"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the varlen FlashAttention path runs on GPUs only")
def test_varlen_flash_path_matches_the_padded_forward_on_cuda():
    model = _model().cuda()
    batch = _batch()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        padded_lp, _ = response_logprobs(model, batch.to("cuda"))
    use_packed_attention(model)
    prompt_width = batch["tokens", "prompt"].shape[1]
    for micro in packed_micro_batches(RaggedRows.from_padded(batch), BUDGET):
        micro = micro.to("cuda")
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            lp, _ = packed_response_logprobs(model, micro)
        want = padded_lp[micro.rows, prompt_width:prompt_width + lp.shape[1]]
        torch.testing.assert_close(lp, torch.where(micro.response_mask, want, 0.0), rtol=2e-2, atol=2e-2)
