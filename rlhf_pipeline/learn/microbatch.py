"""Splitting a padded batch into micro-batches that fit a token budget (gradient accumulation).

The learner samples B rows per optimizer step; the forward/backward pass runs on
micro-batches whose *padded* size, rows x (longest prompt + longest response) in the
micro-batch, stays within ``max_tokens``. Rows are sorted by length first so similar
lengths share a micro-batch, and each micro-batch is trimmed to its own widths, which
keeps padding (wasted compute) small.

The layout is the one ``rlhf_pipeline.schema.padding.pad_batch`` writes: prompts left-padded to
P columns, responses right-padded to R columns, full sequences T = P + R. Keys are
classified by name: ``(..., "full")``, ``position_ids``, ``advantage`` and the ``all_*``
masks span T; ``(..., "prompt")`` spans P; ``(..., "response")`` spans R; the rest are
per-row (``("token_advantage", "full")`` of a multi-turn batch spans T by its name). A row
longer than the budget on its own becomes a micro-batch of one row.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rlhf_pipeline.learn.packed_batch import PackedBatch

_FULL_NAMES = {"full", "position_ids", "advantage", "all_attention_mask", "all_assistant_mask"}


def plan_microbatches(prompt_lengths: torch.Tensor, response_lengths: torch.Tensor,
                      max_tokens: int) -> list[torch.Tensor]:
    """Row indices of each micro-batch; every row appears exactly once."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1 (got {max_tokens})")
    total = (prompt_lengths + response_lengths).to(torch.int64)
    order = torch.argsort(total, descending=True, stable=True).tolist()
    p_len, r_len = prompt_lengths.tolist(), response_lengths.tolist()
    plans: list[list[int]] = []
    current: list[int] = []
    max_p = max_r = 0
    for i in order:
        new_p, new_r = max(max_p, p_len[i]), max(max_r, r_len[i])
        if current and (len(current) + 1) * (new_p + new_r) > max_tokens:
            plans.append(current)
            current, new_p, new_r = [], p_len[i], r_len[i]
        current.append(i)
        max_p, max_r = new_p, new_r
    if current:
        plans.append(current)
    return [torch.tensor(sorted(p), dtype=torch.int64) for p in plans]


def _span(key) -> str:
    name = key[-1] if isinstance(key, tuple) else key
    if name in _FULL_NAMES:
        return "full"
    if name in ("prompt", "response"):
        return name
    return "row"


def take_rows(batch: TensorDict | PackedBatch, rows: torch.Tensor) -> TensorDict | PackedBatch:
    """Rows ``rows`` of a padded batch, trimmed to their own longest prompt and response (of a
    packed batch: those rows packed afresh, ``PackedBatch.select_rows``)."""
    if isinstance(batch, PackedBatch):
        return batch.select_rows(rows)
    prompt_width = batch["tokens", "prompt"].shape[1]  # P
    sub_prompt = batch["prompt_lengths"][rows]
    sub_response = batch["response_lengths"][rows]
    p = int(sub_prompt.max()) if rows.numel() else 0
    r = int(sub_response.max()) if rows.numel() else 0
    out = {}
    for key, value in batch.items(include_nested=True, leaves_only=True):
        value = value[rows]
        span = _span(key)
        if span == "full":
            value = value[:, prompt_width - p: prompt_width + r]
        elif span == "prompt":
            value = value[:, prompt_width - p:]
        elif span == "response":
            value = value[:, :r]
        out[key] = value
    return TensorDict(out, batch_size=[rows.numel()], device=batch.device)


def split_microbatches(batch: TensorDict, max_tokens: int) -> list[TensorDict]:
    """``batch`` cut into trimmed micro-batches of at most ``max_tokens`` padded tokens each."""
    return [micro for _, micro in split_microbatches_with_rows(batch, max_tokens)]


def split_microbatches_with_rows(batch: TensorDict, max_tokens: int) -> list[tuple[torch.Tensor, TensorDict]]:
    """:func:`split_microbatches`, each micro-batch with the (CPU) indices of its rows in ``batch``."""
    plans = plan_microbatches(batch["prompt_lengths"].cpu(), batch["response_lengths"].cpu(), max_tokens)
    return [(rows, take_rows(batch, rows.to(batch["prompt_lengths"].device))) for rows in plans]
