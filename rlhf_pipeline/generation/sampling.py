"""How completions are sampled (:class:`SamplingConfig`) and :func:`process_logits`, the one definition
of the sampling distribution every engine's stored log-probs follow: logits / temperature, then
top-k (ties kept), then top-p, renormalised (vLLM's ``processed_logprobs`` applies the same steps).
A teacher-forced recompute with the same settings matches the stored values (docs/collector.md,
"Which log-prob is stored").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
