"""One supervised step on chosen tokens: what the pipelines' warm starts repeat.

Design: docs/pipelines.md#whether-the-warm-start-reaches-the-copying.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def warmup_then_cosine(steps: int, *, warmup: int, floor: float = 0.1) -> Callable[[int], float]:
    """LR multiplier of step ``s`` for ``LambdaLR``: linear from ``1 / warmup`` to 1 over the first
    ``warmup`` steps, then a cosine down to ``floor`` at the last of ``steps``."""
    def multiplier(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        progress = min(1.0, (s - warmup) / max(1, steps - 1 - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return multiplier


def supervised_step(model, optimizer, scheduler, ids: torch.Tensor, attention_mask: torch.Tensor,
                    target: torch.Tensor, weights: torch.Tensor | None = None, *,
                    max_grad_norm: float | None = None) -> float:
    """Next-token cross-entropy on the tokens ``target`` marks (B, L bool: the answer, the model's
    turns), one optimizer and scheduler step; returns the loss. Token ``t`` is predicted from the
    tokens before it, so the first token is never a target. ``weights`` (B, L float, optional)
    weighs each target token's loss, the loss then being the weighted mean; without it every
    target token counts once. ``max_grad_norm`` clips the gradients' global norm before the step."""
    logits = model(input_ids=ids, attention_mask=attention_mask).logits[:, :-1]  # (B, L-1, V)
    labels = ids[:, 1:].masked_fill(~target[:, 1:], -100)
    if weights is None:
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    else:
        per_token = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                      reduction="none").view(labels.shape)  # (B, L-1), 0 off target
        weight = weights[:, 1:].float() * target[:, 1:]
        loss = (per_token * weight).sum() / weight.sum().clamp(min=1e-12)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    scheduler.step()
    return loss.item()
