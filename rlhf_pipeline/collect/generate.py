"""Batched sampling from a transformers causal LM, with the log-probs of what was sampled.

Which log-prob is stored. Each sampled token's log-prob is taken from the SAME
distribution it was drawn from: the logits are divided by ``temperature``, then
truncated to the ``top_k`` largest, then to the smallest set whose probability
reaches ``top_p`` (the rest set to -inf), then renormalised with ``log_softmax``.
:func:`process_logits` is that one function, used both here and by
:func:`teacher_forced_log_probs`, so a recompute over ``prompt + response`` with the
same settings matches the stored values (tested to 1e-4).

Consequence for the learner: with ``top_k=0`` and ``top_p=1.0`` the stored log-prob is
exactly ``log_softmax(logits / temperature)``, which a learner forward at the same
temperature reproduces (the importance ratio starts at 1). With truncation, the
stored value is the truncated policy's log-prob (>= the untruncated one); the loss's
truncated importance sampling (``learn/loss.py``) is the tool for that gap.

Generation is a plain loop rather than ``model.generate`` so the RNG (a
``torch.Generator`` the collector checkpoints), the log-prob definition and the stop
rule are ours: prompts are left-padded, ``position_ids = cumsum(mask) - 1``, the KV
cache is reused across steps, a row stops at EOS (EOS kept as its last response
token, ``terminated``) or at ``max_new_tokens`` (``truncated``). Nothing after EOS is
part of the response.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlhf_pipeline.schema.ragged import RaggedTensor


@dataclass(frozen=True)
class SamplingConfig:
    """How completions are sampled. The stored log-probs follow these settings exactly."""

    max_new_tokens: int = 16
    """Response length limit; a row that reaches it without EOS is ``truncated``."""
    temperature: float = 1.0
    """Logits are divided by this before truncation and sampling; must be > 0."""
    top_k: int = 0
    """Keep only the k most likely tokens (ties at the k-th value kept); 0 disables."""
    top_p: float = 1.0
    """Keep the smallest most-likely set with total probability >= top_p; 1.0 disables."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature > 0:
            raise ValueError(
                f"SamplingConfig.temperature must be > 0, got {self.temperature}; for near-greedy "
                f"decoding use a small temperature such as 1e-3, or top_k=1"
            )
        if self.top_k < 0:
            raise ValueError(f"SamplingConfig.top_k must be >= 0 (0 disables), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}")


def process_logits(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """(..., V) raw logits -> (..., V) float32 logits of the sampling distribution.

    Temperature, then top-k, then top-p (the order transformers' samplers use);
    removed tokens get -inf. ``log_softmax`` of the result is the sampling log-prob.
    """
    logits = logits.float() / config.temperature
    if config.top_k and config.top_k < logits.shape[-1]:
        kth = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens ranked above it already reach top_p (the first always stays)
        mass_before = probs.cumsum(dim=-1) - probs
        drop_sorted = mass_before >= config.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


@dataclass
class Generation:
    """N = num_prompts * num_samples completions; row ``i`` answers prompt ``prompt_index[i]``.

    Rows are grouped by prompt: the ``num_samples`` completions of prompt 0 come first.
    """

    prompt_tokens: RaggedTensor  # N rows, int64
    response_tokens: RaggedTensor  # N rows, int64, EOS included when the row stopped on it
    response_log_probs: RaggedTensor  # N rows, float32, aligned with response_tokens
    terminated: torch.Tensor  # (N,) bool, stopped on EOS
    truncated: torch.Tensor  # (N,) bool, hit max_new_tokens
    prompt_index: torch.Tensor  # (N,) int64


def left_pad(sequences: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lists of ids -> ``(ids (N, L), mask (N, L))`` padded on the left."""
    ragged = RaggedTensor.from_sequences([list(s) for s in sequences], dtype=torch.int64)
    return ragged.to_padded(pad_value=pad_token_id, side="left")


def _cache_keyword(model) -> str:
    """The name under which ``model``'s forward takes and returns its KV cache: ``cache`` from
    transformers 5.24, ``past_key_values`` before. 5.24 still takes the old name, but warns twice
    on every collector start; an older one given ``cache`` would ignore it and decode from one
    token without context."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in parameters else "past_key_values"


def _positions(mask: torch.Tensor) -> torch.Tensor:
    # left padding: the first real token sits at position 0 (pads get 0 too; they are masked)
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def generate(
    model,
    prompts: Sequence[Sequence[int]],
    config: SamplingConfig,
    *,
    pad_token_id: int,
    eos_token_id: int | Sequence[int],
    num_samples: int = 1,
    generator: torch.Generator | None = None,
) -> Generation:
    """Samples ``num_samples`` completions of each prompt (token-id lists) in one batch.

    ``generator`` drives every draw (pass the collector's so a restart resumes the
    same random stream); it must live on the model's device.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate() needs at least one prompt and every prompt needs at least one token")
    device = next(model.parameters()).device
    eos_ids = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), device=device)
    prompt_index = torch.arange(len(prompts)).repeat_interleave(num_samples)  # (N,)
    repeated = [prompts[i] for i in prompt_index.tolist()]
    ids, mask = left_pad(repeated, pad_token_id)
    ids, mask = ids.to(device), mask.to(device).long()  # (N, P)
    n = ids.shape[0]

    cache_name = _cache_keyword(model)
    out = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), use_cache=True)
    past, next_logits = getattr(out, cache_name), out.logits[:, -1]  # (N, V)
    position = _positions(mask)[:, -1:]  # (N, 1)
    tokens, log_probs = [], []
    finished = torch.zeros(n, dtype=torch.bool, device=device)
    lengths = torch.zeros(n, dtype=torch.int64, device=device)
    for step in range(config.max_new_tokens):
        logp = torch.log_softmax(process_logits(next_logits, config), dim=-1)  # (N, V)
        token = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)  # (N,)
        token = torch.where(finished, torch.full_like(token, pad_token_id), token)
        tokens.append(token)
        log_probs.append(logp.gather(-1, token[:, None]).squeeze(-1))
        lengths += (~finished).long()
        finished |= torch.isin(token, eos_ids)
        if bool(finished.all()) or step == config.max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        position = position + 1
        out = model(input_ids=token[:, None], attention_mask=mask, position_ids=position,
                    use_cache=True, **{cache_name: past})
        past, next_logits = getattr(out, cache_name), out.logits[:, -1]

    response = torch.stack(tokens, dim=1).cpu()  # (N, R)
    response_lp = torch.stack(log_probs, dim=1).float().cpu()  # (N, R)
    lengths = lengths.cpu()
    valid = torch.arange(response.shape[1])[None, :] < lengths[:, None]  # (N, R)
    terminated = finished.cpu()
    return Generation(
        prompt_tokens=RaggedTensor.from_sequences([list(p) for p in repeated], dtype=torch.int64),
        response_tokens=RaggedTensor.from_padded(response, valid),
        response_log_probs=RaggedTensor.from_padded(response_lp, valid),
        terminated=terminated,
        truncated=~terminated,
        prompt_index=prompt_index,
    )


@torch.no_grad()
def teacher_forced_log_probs(
    model,
    prompt_tokens: RaggedTensor,
    response_tokens: RaggedTensor,
    config: SamplingConfig | None = None,
    *,
    pad_token_id: int = 0,
) -> RaggedTensor:
    """Log-prob of each response token given prompt + earlier response, one forward pass.

    ``config`` applies the same temperature / top-k / top-p processing as sampling;
    ``None`` means the raw model distribution (temperature 1, no truncation), which is
    what a reference-model log-prob usually is. Rows are left-padded with
    ``position_ids = cumsum(mask) - 1``, as in :func:`generate`.
    """
    device = next(model.parameters()).device
    full = RaggedTensor.cat([prompt_tokens, response_tokens])  # 2N rows; interleave below
    n = len(prompt_tokens)
    order = torch.stack([torch.arange(n), torch.arange(n) + n], dim=1).reshape(-1)
    paired = full.index(order)  # prompt_i, response_i, ...
    joined = RaggedTensor.from_lengths(paired.values, paired.lengths().reshape(n, 2).sum(1))
    ids, mask = joined.to_padded(pad_value=pad_token_id, side="left")  # (N, L)
    ids, mask = ids.to(device).long(), mask.to(device).long()
    logits = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits  # (N, L, V)
    if config is not None:
        logits = process_logits(logits, config)
    logp = torch.log_softmax(logits.float()[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (N, L-1)
    resp_len = response_tokens.lengths().to(device)
    width = ids.shape[1] - 1
    # response tokens are the last resp_len positions of each left-padded row
    valid = torch.arange(width, device=device)[None, :] >= (width - resp_len)[:, None]
    return RaggedTensor.from_padded(logp.cpu(), valid.cpu())
