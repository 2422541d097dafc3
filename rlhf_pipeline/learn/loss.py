"""The GRPO loss (:func:`grpo_loss`, pure functions of padded (B, T) tensors) and the forwards that feed it.

Variant: a per-token ratio to the old policy (by default the sampler's stored log-probs), PPO's clip
with ``clip_eps_low``/``clip_eps_high`` (DAPO's clip-higher), ``token_mean`` aggregation (DAPO's; the
GRPO paper's ``sequence_mean`` and Dr. GRPO's ``constant`` are options), no KL term unless ``kl_coef``
(k3), and optionally GSPO's sequence ratio, an entropy bonus and TIS (:class:`GRPOLossConfig`). Matches
torchrl 0.14.1's ``GRPOLoss`` to 1e-6 but for its KL term and logged statistics, which count padding too.
Why one file: :func:`grpo_loss` and its forwards (padded :func:`grpo_step_loss`, packed
:func:`grpo_packed_loss`) change together and must give the same value (``tests/learn/test_packing.py``).
Design: docs/learner.md#which-grpo-variant.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from rlhf_pipeline.learn.settings import Aggregation, GRPOLossConfig  # noqa: F401 (re-exported)
from rlhf_pipeline.learn.trajectories import TOKEN_ADVANTAGE_KEY

if TYPE_CHECKING:
    from rlhf_pipeline.learn.batch import PackedMicroBatch


LOGPROB_DIFF_THRESHOLD = 0.1
"""``sampler_logprob_diff_frac`` counts the response tokens whose learner and stored log-probs differ by
more than this (a ratio off by ~10%)."""
MAX_METRICS = frozenset({"sampler_logprob_diff_max"})
"""Statistics a step combines over micro-batches and ranks by their maximum, not a weighted sum."""
ROW_LOGPROB_DIFF = "row_logprob_diff"
"""The per-row statistic of :func:`sampler_mismatch`: with ``row_feedback``, the only non-scalar metrics."""


def aggregates_by_token(options: Mapping[str, Any] | GRPOLossConfig | None) -> bool:
    """True when the loss is a token mean, so micro-batches are weighted by token count, else by rows."""
    config = options if isinstance(options, GRPOLossConfig) else GRPOLossConfig.from_options(options)
    return config.aggregation == "token_mean"


# ======================================================================== aggregation
def aggregate(values: torch.Tensor, mask: torch.Tensor, config: GRPOLossConfig,
              token_count: torch.Tensor | float | None = None) -> torch.Tensor:
    """(B, T) per-token values -> scalar, by ``config.aggregation``; masked-out tokens never count.

    ``token_count`` overrides the token-mean denominator (a global count when the batch
    is split into micro-batches); by default it is this batch's response-token count.
    """
    m = mask.to(values.dtype)  # (B, T)
    masked_sum = (values * m).sum()
    if config.aggregation == "token_mean":
        denominator = m.sum().clamp_min(1.0) if token_count is None else token_count
        return masked_sum / denominator
    if config.aggregation == "sequence_mean":
        per_row = (values * m).sum(-1) / m.sum(-1).clamp_min(1.0)  # (B,)
        return per_row.mean()
    return masked_sum / (values.shape[0] * config.max_tokens)


def check_constant_covers_rows(mask: torch.Tensor, max_tokens: int) -> None:
    """Dr. GRPO's constant is a maximum: no row (a whole trajectory when multi-turn) may carry loss on
    more tokens than ``max_tokens``, or longer rows would be weighted up instead of the constant
    being fixed. One device sync, in ``constant`` aggregation only."""
    most = int(mask.sum(-1).max()) if mask.numel() else 0  # (B,) -> the longest row's loss tokens
    if most > max_tokens:
        raise ValueError(
            f"loss aggregation 'constant' (Dr. GRPO) divides each row's loss by the fixed max_tokens={max_tokens}, "
            f"but a row carries loss on {most} sampled tokens: max_tokens must be the most a row can sample. A "
            f"multi-turn trajectory trains as one row: set learner.loss.max_tokens to a trajectory's budget of "
            f"sampled tokens (max_turns x max_new_tokens, or less under a token budget), not one turn's")


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(values.dtype)
    return (values * m).sum() / m.sum().clamp_min(1.0)


def effective_sample_size(log_weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(sum w)^2 / (n * sum w^2)`` over masked entries, from log-weights (stable form); in (0, 1]."""
    lw = log_weights[mask.bool()].detach()
    lw = lw.to(torch.promote_types(lw.dtype, torch.float32))  # bf16 -> fp32, fp64 stays
    if lw.numel() == 0:
        return torch.tensor(1.0)
    return (2 * lw.logsumexp(0) - (2 * lw).logsumexp(0)).exp() / lw.numel()


def per_row_feedback(kind: str, per_token: torch.Tensor, ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) detached per-row value fed back as a priority: ``"loss"`` = masked mean of ``|per_token|``,
    ``"ratio_deviation"`` = masked mean of ``|ratio - 1|`` (why: docs/learner.md#what-the-loss-reports)."""
    if kind == "loss":
        values = per_token.detach().abs()
    elif kind == "ratio_deviation":
        values = (ratio.detach() - 1).abs()
    else:
        raise ValueError(f"row_feedback must be 'loss' or 'ratio_deviation', got {kind!r}")
    m = mask.to(values.dtype)
    return ((values * m).sum(-1) / m.sum(-1).clamp_min(1.0)).float()  # (B,)


# ======================================================================== the loss
def grpo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: GRPOLossConfig | None = None,
    *,
    ref_log_probs: torch.Tensor | None = None,
    sampler_log_probs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    token_count: torch.Tensor | float | None = None,
    row_weights: torch.Tensor | None = None,
    row_feedback: str | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO objective; returns ``(loss, metrics)``. Per token t of row i where ``mask`` is True:

        r_it = exp(logp_it - old_logp_it)
        L_it = -min(r_it * A_i, clip(r_it, 1 - eps_low, 1 + eps_high) * A_i) * w_it   (w: TIS, else 1)
        loss = agg(L) + kl_coef * agg(k3_it) - entropy_coef * agg(H_it)

    ``agg``: ``token_mean`` (the default, DAPO's), ``sequence_mean`` (the GRPO paper's) or ``constant``
    (Dr. GRPO's, sum / (B * max_tokens)); ``ratio_level="sequence"``: GSPO's one clipped ratio per row;
    k3 is ``exp(ref - logp) - (ref - logp) - 1``. Against the GRPO paper the defaults differ by
    ``token_mean`` and by ``kl_coef=0``. The derivation, options and metrics:
    docs/learner.md#which-grpo-variant.

    ``row_feedback`` (``"loss"`` | ``"ratio_deviation"``): add ``metrics["row_feedback"]`` (B,),
    see :func:`per_row_feedback`.

    ``row_weights`` (B,): importance weights of prioritized sampling; every loss term of row i
    (policy, KL, entropy) is multiplied by ``row_weights[i]`` before aggregation.

    Shapes: ``log_probs`` (B, T) with grad, current policy; ``old_log_probs`` (B, T);
    ``advantages`` (B,) one per row, or (B, T) / (B, T, 1) per token; ``mask`` (B, T)
    bool, True on the tokens that carry loss; ``ref_log_probs`` (B, T) needed when
    ``kl_coef > 0``; ``sampler_log_probs`` (B, T) needed when ``tis_cap`` is set;
    ``entropy`` (B, T) needed when ``entropy_coef > 0``.
    """
    config = config or GRPOLossConfig()
    mask = mask.bool()
    if log_probs.shape != mask.shape or old_log_probs.shape != mask.shape:
        raise ValueError(
            f"log_probs {tuple(log_probs.shape)}, old_log_probs {tuple(old_log_probs.shape)} and mask "
            f"{tuple(mask.shape)} must all be (B, T)"
        )
    if config.aggregation == "constant":
        check_constant_covers_rows(mask, config.max_tokens)
    if advantages.dim() == 3:
        advantages = advantages.squeeze(-1)
    adv = advantages[:, None] if advantages.dim() == 1 else advantages  # (B, 1) or (B, T)
    adv = adv.to(log_probs.dtype).detach()
    old = old_log_probs.detach().to(log_probs.dtype)

    # masked positions get log-ratio 0 so padding never produces inf/nan ratios
    log_ratio = torch.where(mask, log_probs - old, torch.zeros_like(log_probs))  # (B, T)
    if config.ratio_level == "sequence":
        counts = mask.sum(-1, keepdim=True).clamp_min(1)
        seq_log_ratio = log_ratio.sum(-1, keepdim=True) / counts  # (B, 1)
        # value = s_i on every token, gradient = s_i * d logp_it (GSPO's token-level form)
        ratio_log = seq_log_ratio.detach() + log_probs - log_probs.detach()
        log_ratio_for_stats = seq_log_ratio.expand_as(log_ratio)
        ratio = torch.where(mask, ratio_log.exp(), torch.ones_like(log_probs))
    else:
        ratio = log_ratio.exp()  # (B, T)
        log_ratio_for_stats = log_ratio
    clipped = ratio.clamp(1 - config.clip_eps_low, 1 + config.clip_eps_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)  # (B, T)

    metrics: dict[str, torch.Tensor] = {}
    if sampler_log_probs is not None:
        metrics.update(sampler_mismatch(log_probs.detach(), sampler_log_probs, mask))
    if config.tis_cap is not None:
        if sampler_log_probs is None:
            raise ValueError("tis_cap is set but no sampler_log_probs were given; pass the stored sampling log-probs")
        tis_log = torch.where(mask, old - sampler_log_probs.detach().to(old.dtype), torch.zeros_like(old))
        tis_weight = tis_log.exp().clamp(max=config.tis_cap)  # (B, T)
        per_token = per_token * tis_weight
        metrics["tis_clip_frac"] = _masked_mean((tis_log.exp() > config.tis_cap).float(), mask)
        metrics["ess"] = effective_sample_size(tis_weight.log(), mask)
    else:
        metrics["ess"] = effective_sample_size(log_ratio_for_stats, mask)

    if row_feedback is not None:
        metrics["row_feedback"] = per_row_feedback(row_feedback, per_token, ratio, mask)
    weight = None if row_weights is None else row_weights.detach().to(log_probs.dtype)[:, None]  # (B, 1)
    if weight is not None:
        per_token = per_token * weight
    policy_loss = aggregate(per_token, mask, config, token_count)
    loss = policy_loss
    if ref_log_probs is not None:
        diff = torch.where(mask, ref_log_probs.to(log_probs.dtype) - log_probs, torch.zeros_like(log_probs))
        k3 = diff.exp() - diff - 1  # (B, T), >= 0
        metrics["kl"] = _masked_mean(k3.detach(), mask)
        if config.kl_coef:
            weighted = k3 if weight is None else k3 * weight
            loss = loss + config.kl_coef * aggregate(weighted, mask, config, token_count)
    elif config.kl_coef:
        raise ValueError(
            "kl_coef > 0 needs ref_log_probs; attach the reference log-prob transform to the buffer's "
            "write path (field 'ref_log_probs') or set kl_coef=0"
        )
    else:
        metrics["kl"] = torch.zeros(())
    if entropy is not None:
        metrics["entropy"] = _masked_mean(entropy.detach(), mask)
        if config.entropy_coef:
            weighted = entropy if weight is None else entropy * weight
            loss = loss - config.entropy_coef * aggregate(weighted, mask, config, token_count)
    elif config.entropy_coef:
        raise ValueError("entropy_coef > 0 needs the per-token entropy; pass entropy=... (response_logprobs returns it)")

    with torch.no_grad():
        r = ratio.detach()
        low = (r < 1 - config.clip_eps_low) & (adv < 0)
        high = (r > 1 + config.clip_eps_high) & (adv > 0)
        metrics["clip_frac_low"] = _masked_mean(low.float(), mask)
        metrics["clip_frac_high"] = _masked_mean(high.float(), mask)
        valid = r[mask] if mask.any() else torch.ones(1)
        metrics["ratio_mean"] = valid.mean()
        metrics["ratio_min"] = valid.min()
        metrics["ratio_max"] = valid.max()
        metrics["approx_kl_old"] = _masked_mean(log_ratio.exp() - 1 - log_ratio, mask)
        metrics["policy_loss"] = policy_loss.detach()
        metrics["loss"] = loss.detach()
    return loss, metrics


def sampler_mismatch(log_probs: torch.Tensor, sampler_log_probs: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """``|log_probs - sampler_log_probs|`` over the masked tokens: mean, max and the share above
    :data:`LOGPROB_DIFF_THRESHOLD` (0-dim tensors; zeros without a masked token), and per row
    (``row_logprob_diff``, (B, 3)): the sum and the max of the row's differences and its token count,
    from which the learner reports them by the rows' staleness (``learner.logprob_diff_by_staleness``)."""
    diff = torch.where(mask, (log_probs.float() - sampler_log_probs.float()).abs(), torch.zeros((), dtype=torch.float32))
    per_row = torch.stack([diff.sum(-1), diff.amax(-1), mask.sum(-1).float()], dim=-1)  # (B, 3)
    if not bool(mask.any()):
        zero = torch.zeros(())
        return {"sampler_logprob_diff_mean": zero, "sampler_logprob_diff_max": zero, "sampler_logprob_diff_frac": zero,
                ROW_LOGPROB_DIFF: per_row}
    return {
        "sampler_logprob_diff_mean": _masked_mean(diff, mask),
        "sampler_logprob_diff_max": diff[mask].max(),
        "sampler_logprob_diff_frac": _masked_mean((diff > LOGPROB_DIFF_THRESHOLD).float(), mask),
        ROW_LOGPROB_DIFF: per_row,
    }


# ======================================================================== forward
def response_logprobs(model, padded_batch, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``(log_probs (B, T), entropy (B, T))`` of a causal-LM forward over the padded batch.

    Reads ``("tokens", "full")``, ``("masks", "all_attention_mask")`` and ``"position_ids"``
    (recomputed as ``cumsum(mask) - 1`` when absent), the layout of
    ``rlhf_pipeline.schema.padding.pad_batch``. Entry ``t`` scores token ``t`` given the tokens
    before it, under ``log_softmax(logits / temperature)`` (no top-k/top-p truncation;
    see ``generation/sampling.py`` on when that matches the sampler exactly); ``entropy[t]``
    is the entropy of that same distribution. Column 0 and padding are 0.
    """
    tokens = padded_batch["tokens", "full"]  # (B, T)
    attention = padded_batch["masks", "all_attention_mask"]  # (B, T)
    if "position_ids" in padded_batch.keys():
        positions = padded_batch["position_ids"]
    else:
        positions = (attention.long().cumsum(-1) - 1).clamp_min(0)
    logits = model(input_ids=tokens, attention_mask=attention.long(), position_ids=positions).logits  # (B, T, V)
    logits = logits[:, :-1].float() / temperature  # (B, T-1, V) predicts tokens 1..T-1
    logp_all = torch.log_softmax(logits, dim=-1)
    # gather wants int64 indices; learner batches carry int32 ids (collate.py, "Index dtype")
    token_logp = logp_all.gather(-1, tokens[:, 1:, None].long()).squeeze(-1)  # (B, T-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # (B, T-1)
    zeros = token_logp.new_zeros(tokens.shape[0], 1)
    valid = attention[:, 1:].bool()
    log_probs = torch.cat([zeros, torch.where(valid, token_logp, 0.0)], dim=1)  # (B, T)
    entropy = torch.cat([zeros, torch.where(valid, entropy, 0.0)], dim=1)  # (B, T)
    return log_probs, entropy


def grpo_step_loss(model, padded_batch, *, temperature: float = 1.0, token_count=None,
                   row_feedback: str | None = None, **options) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward + :func:`grpo_loss` on a ``pad_batch`` micro-batch; ``options`` are :class:`GRPOLossConfig` fields.

    Reads the loss mask ``("masks", "all_assistant_mask")``, the advantage
    ``"sequence_advantage"`` (B,) or, when present, the per-token ``("token_advantage", "full")``
    (B, T) of a multi-turn batch (``learn/trajectories.py``), the sampling log-probs ``("log_probs", "full")`` and,
    when present, ``("next", "ref_log_probs", "full")`` and the prioritized sampler's importance
    weights ``"sample_weight"`` (B,).
    """
    config = GRPOLossConfig.from_options(options)
    keys = padded_batch.keys(include_nested=True)
    if "sequence_advantage" not in keys:
        raise KeyError(
            "the padded batch has no advantage ('sequence_advantage'); attach the group-advantage "
            "transform to the buffer's write path so stored rows carry 'advantage'"
        )
    mask = padded_batch["masks", "all_assistant_mask"].bool()
    log_probs, entropy = response_logprobs(model, padded_batch, temperature)
    sampler = padded_batch["log_probs", "full"]
    old = log_probs.detach() if config.old_policy == "current" else sampler
    ref_key = ("next", "ref_log_probs", "full")
    ref = padded_batch[ref_key] if ref_key in keys else None
    row_weights = padded_batch["sample_weight"] if "sample_weight" in keys else None
    # a multi-turn batch with per-turn advantages carries one per token (learn/trajectories.py)
    advantage = (padded_batch[TOKEN_ADVANTAGE_KEY] if TOKEN_ADVANTAGE_KEY in keys
                 else padded_batch["sequence_advantage"])
    return grpo_loss(
        log_probs, old, advantage, mask, config,
        ref_log_probs=ref, sampler_log_probs=sampler, entropy=entropy, token_count=token_count,
        row_weights=row_weights, row_feedback=row_feedback,
    )


# ======================================================================== the packed forward
# With ``learner.packing`` a micro-batch is ONE sequence of its rows end to end (``learn/batch.py``,
# :class:`~rlhf_pipeline.learn.batch.PackedMicroBatch`). The forward runs it with the ``rlhf_packed``
# attention (``learn/packed_attention.py``: causal within each row, never across rows), computes
# logits only where they score a trained response token (``logits_to_keep``), scatters the per-token
# log-probs and entropies back into a response-aligned (n, R) layout, and runs the SAME
# :func:`grpo_loss` on them. The loss is elementwise per row with per-row aggregation, so every
# variant (aggregations, GSPO, KL, entropy, TIS, row feedback, importance weights) gives the padded
# path's value; ``tests/learn/test_packing.py`` checks loss and gradients to 1e-5 in float32. Every
# row needs at least one prompt token (its first response token is scored from the last prompt
# token's logits).


def packed_response_logprobs(model, packed: PackedMicroBatch, temperature: float = 1.0, *,
                             entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_probs (n, R), entropy (n, R))`` of the response tokens, from one packed forward.

    The values :func:`rlhf_pipeline.learn.loss.response_logprobs` gives at the response columns
    of the padded batch, in the response-aligned layout (0 off the response). The model must run
    the ``rlhf_packed`` attention (``use_packed_attention``) or another that reads
    ``cu_seq_lens_q`` (transformers' flash-attention). ``entropy_grad=False`` computes the
    entropy without a graph (it is then only a metric).
    """
    cu, longest = packed.cu_seq_lens, packed.max_length
    out = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False,
                cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest,
                logits_to_keep=packed.logit_positions)
    logits = out.logits[0].float()  # (N, V): only the positions that score a response token
    if temperature != 1.0:  # (a division by 1 is exact: skipping it saves a pass over N x V)
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    token_logp = logp_all.gather(-1, packed.targets[:, None]).squeeze(-1)  # (N,)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp_all.exp() * logp_all).sum(-1)  # (N,)
    mask = packed.response_mask
    log_probs = token_logp.new_zeros(mask.shape).masked_scatter(mask, token_logp)  # (n, R)
    entropy = entropy.new_zeros(mask.shape).masked_scatter(mask, entropy)  # (n, R)
    return log_probs, entropy


def grpo_packed_loss(model, packed: PackedMicroBatch, *, temperature: float = 1.0, token_count=None,
                     row_feedback: str | None = None, **options) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`rlhf_pipeline.learn.loss.grpo_step_loss` on a packed micro-batch: one packed forward, then
    the same :func:`grpo_loss` on (n, R) response-aligned tensors; same options, same outputs."""
    config = GRPOLossConfig.from_options(options)
    log_probs, entropy = packed_response_logprobs(model, packed, temperature, entropy_grad=config.entropy_coef != 0)
    sampler = packed.sampler_log_probs
    old = log_probs.detach() if config.old_policy == "current" else sampler
    return grpo_loss(
        log_probs, old, packed.advantages, packed.response_mask, config,
        ref_log_probs=packed.ref_log_probs, sampler_log_probs=sampler, entropy=entropy, token_count=token_count,
        row_weights=packed.sample_weight, row_feedback=row_feedback,
    )
