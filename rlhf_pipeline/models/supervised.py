"""One supervised step on chosen tokens: what the pipelines' warm starts repeat."""

from __future__ import annotations

import torch


def supervised_step(model, optimizer, scheduler, ids: torch.Tensor, attention_mask: torch.Tensor,
                    target: torch.Tensor, weights: torch.Tensor | None = None) -> float:
    """Next-token cross-entropy on the tokens ``target`` marks (B, L bool: the answer, the model's
    turns), one optimizer and scheduler step; returns the loss. Token ``t`` is predicted from the
    tokens before it, so the first token is never a target. ``weights`` (B, L float, optional)
    weighs each target token's loss, the loss then being the weighted mean; without it every
    target token counts once."""
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
    optimizer.step()
    scheduler.step()
    return loss.item()
