"""Attention for packed sequences: every row attends only to itself, causally, per device.

:func:`use_packed_attention` switches a transformers model to this module's ``"rlhf_packed"`` attention
(transformers' ``AttentionInterface``). A packed call (row boundaries in ``cu_seq_lens_q``, or restarting
``position_ids``) runs torch's varlen FlashAttention on CUDA in fp16/bf16, and on CPU
``scaled_dot_product_attention`` per row or one masked call over a small rectangle, whichever costs
less; any other call is transformers' ``sdpa``, so the model computes what it does with ``sdpa``.
Not transformers' block-diagonal ``L x L`` mask, nor ``flex_attention`` (no CPU backward).
Design: docs/learner.md#the-packed-attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "rlhf_packed"
# one sdpa call (forward + backward) costs about what this many padding entries x channels
# (heads x head dim) cost on a CPU core (measured: docs/learner.md#the-packed-attention): the rectangle is
# used when its padding costs less than the calls it saves
_CALL_COST_ENTRY_CHANNELS = 65_536


def use_packed_attention(model) -> None:
    """Switch ``model`` (a transformers ``PreTrainedModel``, or a wrapper with ``.module``) to the
    ``rlhf_packed`` attention, registering it on first use. Idempotent."""
    _register()
    inner = getattr(model, "module", model)  # DDP / FSDP wrappers
    if inner.config._attn_implementation != NAME:
        inner.set_attn_implementation(NAME)


_registered = False


def _register() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, packed_attention_forward)
    AttentionMaskInterface.register(NAME, _mask)
    _registered = True


def _mask(*args, attention_mask=None, **kwargs):
    """The ``sdpa`` mask when there is padding; None otherwise (the attention itself is causal per row)."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


# ====================================================================== the attention function
def packed_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, sliding_window: int | None = None,
                             cu_seq_lens_q: torch.Tensor | None = None, max_length_q: int | None = None,
                             position_ids: torch.Tensor | None = None, **kwargs):
    """transformers' attention-function contract: ``query`` (1, H, L, D), ``key``/``value``
    (1, Hkv, L, D) -> ``((1, L, H, D), None)``."""
    if cu_seq_lens_q is None and attention_mask is None and query.shape[2] > 1 and position_ids is not None:
        cu_seq_lens_q = _boundaries_from_positions(position_ids)
    if cu_seq_lens_q is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, position_ids=position_ids, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one packed sequence (batch 1), got batch {query.shape[0]}")
    if sliding_window is not None:
        raise ValueError("packed attention does not implement sliding-window layers; use learner.packing=false")
    if dropout:
        raise ValueError("packed attention runs without attention dropout (the learner trains with none)")
    if query.is_cuda and _flash_dtype(query) is not None:
        out = _varlen_flash(query, key, value, cu_seq_lens_q, max_length_q, scaling)
    else:
        bounds = cu_seq_lens_q.tolist()
        lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
        if _rectangle_is_cheaper(lengths, query.shape[1] * query.shape[3]):
            out = _rectangle(query, key, value, bounds, lengths, scaling)
        else:
            out = _per_row(query, key, value, lengths, scaling)
    return out.transpose(1, 2).contiguous(), None  # (1, L, H, D)


def _boundaries_from_positions(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Row offsets of a packed sequence from positions restarting at 0; None when it holds one row."""
    positions = position_ids[0]
    starts = torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1
    if starts.numel() == 0:
        return None
    bounds = torch.cat([starts.new_zeros(1), starts, starts.new_tensor([positions.numel()])])
    return bounds.to(torch.int32)


def _rectangle_is_cheaper(lengths: list[int], channels: int) -> bool:
    """One masked call over ``n x longest^2`` entries against ``n`` calls over ``sum(len^2)``;
    ``channels`` = heads x head dim, what one entry costs in proportion to."""
    longest = max(lengths)
    waste = len(lengths) * longest * longest - sum(n * n for n in lengths)
    return waste * channels < _CALL_COST_ENTRY_CHANNELS * (len(lengths) - 1)


def _per_row(query, key, value, lengths: list[int], scaling):
    """(1, H, L, D): causal sdpa on each row's part, concatenated. ``split`` rather than slicing:
    its backward is one ``cat`` of the parts' gradients, where a slice's backward writes a
    zero-filled full-length tensor per row (n of them per tensor per layer; 10% of a step)."""
    gqa = query.shape[1] != key.shape[1]
    parts = zip(*(x.split(lengths, dim=2) for x in (query, key, value)))
    outs = [F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa) for q, k, v in parts]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _rectangle(query, key, value, bounds: list[int], lengths: list[int], scaling):
    """(1, H, L, D): the rows gathered into (n, H, longest, D), one causal + key-padding masked sdpa,
    and the real positions gathered back. Padding positions read token 0 of the sequence and are
    masked as keys; their outputs are dropped, so they take no part in values or gradients."""
    device = query.device
    n, longest = len(lengths), max(lengths)
    starts = torch.tensor(bounds[:-1], device=device)
    lens = torch.tensor(lengths, device=device)
    column = torch.arange(longest, device=device)
    valid = column[None, :] < lens[:, None]  # (n, longest)
    gather = torch.where(valid, starts[:, None] + column[None, :], 0).flatten()  # (n * longest,)
    causal = column[:, None] >= column[None, :]  # (longest, longest)
    mask = (causal[None] & valid[:, None, :])[:, None]  # (n, 1, longest, longest); key 0 always allowed

    def rows(x):  # (1, h, L, D) -> (n, h, longest, D)
        return x[0].index_select(1, gather).unflatten(1, (n, longest)).transpose(0, 1)

    out = F.scaled_dot_product_attention(rows(query), rows(key), rows(value), attn_mask=mask, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])  # (n, H, longest, D)
    flat = out.transpose(0, 1).flatten(1, 2)  # (H, n * longest, D)
    keep = torch.nonzero(valid.flatten()).flatten()  # real tokens, in packed order
    return flat.index_select(1, keep)[None]


def _flash_dtype(query) -> torch.dtype | None:
    """The half dtype the flash kernel runs in: the query's own, or autocast's."""
    if query.dtype in (torch.float16, torch.bfloat16):
        return query.dtype
    if torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return None


def _varlen_flash(query, key, value, cu_seq_lens: torch.Tensor, max_length: int | None, scaling):
    """(1, H, L, D) by torch's varlen FlashAttention (CUDA): (L, H, D) layout, causal per row.
    Under autocast q/k/v may come out of RoPE in float32 (cos/sin follow the float32 hidden
    states), so they are cast to autocast's half dtype here and the result back."""
    from torch.nn.attention.varlen import varlen_attn

    dtype = _flash_dtype(query)
    cu = cu_seq_lens.to(device=query.device, dtype=torch.int32)
    if max_length is None:
        max_length = int((cu[1:] - cu[:-1]).max())
    q, k, v = (x[0].transpose(0, 1).to(dtype) for x in (query, key, value))  # (L, h, D)
    out = varlen_attn(q, k, v, cu, cu, max_length, max_length, scale=scaling, window_size=(-1, 0),
                      enable_gqa=q.shape[1] != k.shape[1])  # (L, H, D)
    return out.to(query.dtype).transpose(0, 1)[None]
