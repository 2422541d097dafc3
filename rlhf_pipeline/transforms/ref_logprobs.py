"""Per-token log-probs of each response under a frozen reference model, batched.

``ref_log_probs[i, t] = log_softmax(logits(p + r[:t]) / temperature)[r[t]]``: the reference scored
at the sampler's temperature (``temperature=1.0`` for the untempered one), no top-k / top-p. Rows
are packed by length into micro-batches of at most ``tokens_per_microbatch`` padded tokens; the
result equals a per-sequence forward to 1e-5. Design: docs/architecture.md#the-write-path-transforms.

A LoRA policy is its own reference: given a peft model, the reference is its base with the adapter
disabled (peft's ``disable_adapter()`` context, :func:`reference_of`), so no copy of the base's weights
is held beside the policy (docs/lora.md).
"""

from __future__ import annotations

import contextlib
import inspect
import time
from typing import Any

import torch

from rlhf_pipeline.schema.ragged import RaggedTensor, gather_ranges
from rlhf_pipeline.schema import TrajectoryBatch, TrajectoryValidationError
from rlhf_pipeline.transforms.write_path import WritePathTransform


def microbatches(prompt_len: torch.Tensor, response_len: torch.Tensor, tokens_per_microbatch: int) -> list[torch.Tensor]:
    """Row indices per micro-batch: longest rows first, each batch's padded size within budget."""
    order = torch.argsort(prompt_len + response_len, descending=True, stable=True).tolist()
    p, r = prompt_len.tolist(), response_len.tolist()
    batches, current, max_p, max_r = [], [], 0, 0
    for i in order:
        new_p, new_r = max(max_p, p[i]), max(max_r, r[i])
        if current and (len(current) + 1) * (new_p + new_r) > tokens_per_microbatch:
            batches.append(torch.tensor(current, dtype=torch.int64))
            current, new_p, new_r = [], p[i], r[i]
        current.append(i)
        max_p, max_r = new_p, new_r
    if current:
        batches.append(torch.tensor(current, dtype=torch.int64))
    return batches


@torch.no_grad()
def reference_log_probs(
    model: torch.nn.Module,
    prompt_tokens: RaggedTensor,
    response_tokens: RaggedTensor,
    *,
    temperature: float = 1.0,
    device: str | torch.device | None = None,
    tokens_per_microbatch: int = 16_384,
    pad_token_id: int = 0,
) -> RaggedTensor:
    """Ragged (aligned with ``response_tokens``) float32 reference log-probs; see the module docstring.

    ``model`` is any ``transformers`` causal LM (called with ``input_ids``,
    ``attention_mask``, ``position_ids``; reads ``.logits``). ``device`` defaults to
    the model's. ``pad_token_id`` only fills masked positions, so any valid id works.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if len(prompt_tokens) != len(response_tokens):
        raise ValueError(f"{len(prompt_tokens)} prompts but {len(response_tokens)} responses")
    if device is None:
        device = next(model.parameters()).device
    p_len, r_len = prompt_tokens.lengths(), response_tokens.lengths()
    out = torch.empty(response_tokens.values.numel(), dtype=torch.float32)
    for idx in microbatches(p_len, r_len, tokens_per_microbatch):
        prompt, p_mask = prompt_tokens.index(idx).to_padded(pad_token_id, side="left")  # (B, Lp)
        response, r_mask = response_tokens.index(idx).to_padded(pad_token_id, side="right")  # (B, Lr)
        input_ids = torch.cat([prompt, response], dim=1).to(device=device, dtype=torch.long)  # (B, Lp+Lr)
        mask = torch.cat([p_mask, r_mask], dim=1).to(device)
        position_ids = (mask.long().cumsum(1) - 1).clamp_min(0)
        lp, lr = prompt.shape[1], response.shape[1]
        kwargs = {"logits_to_keep": lr + 1} if _accepts_logits_to_keep(model) else {}
        logits = model(input_ids=input_ids, attention_mask=mask.long(), position_ids=position_ids, **kwargs).logits
        # the logit at column c predicts token c+1: response token t is scored at column lp - 1 + t,
        # which is column t of the last lr + 1 logits
        logits = logits[:, -(lr + 1) : -1].float() / temperature  # (B, Lr, V)
        targets = input_ids[:, lp:].unsqueeze(-1)
        scored = logits.gather(-1, targets).squeeze(-1) - logits.logsumexp(-1)  # (B, Lr)
        dest = gather_ranges(response_tokens.offsets[idx], r_len[idx])
        out[dest] = scored[r_mask.to(device)].cpu()
    return RaggedTensor(out, response_tokens.offsets)


def reference_of(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """The context in which ``model`` scores as the reference: a peft model's ``disable_adapter()`` (the
    base, without the adapter's update), nothing for any other model."""
    if type(model).__module__.startswith("peft."):
        return model.disable_adapter()
    return contextlib.nullcontext()


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    """transformers causal LMs can skip the vocabulary projection over prompt positions."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


class ReferenceLogProbs(WritePathTransform):
    """Fills ``ref_log_probs`` for every row passing through (``reference_log_probs`` above).

    The model is held outside the module tree on purpose: a frozen reference is
    rebuilt from its own checkpoint, and registering it would put its weights into
    every ``rb.state_dict()``. ``metrics()`` reports tokens scored and tokens/s.

    Args:
        model: a frozen ``transformers`` causal LM (put in eval mode here), or a LoRA policy (a peft
            model), scored with its adapter disabled: the base, with no copy of it.
        temperature: the sampler's temperature (see the module docstring).
        device: where to run the model; default: where its parameters are.
        tokens_per_microbatch: padded-token budget per forward.
        pad_token_id: id used for padding (masked out).
    """

    fills_fields = ("ref_log_probs",)

    def __init__(self, model: torch.nn.Module, *, temperature: float = 1.0, device: str | torch.device | None = None,
                 tokens_per_microbatch: int = 16_384, pad_token_id: int = 0) -> None:
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        object.__setattr__(self, "_ref_model", model.eval())
        self.temperature = temperature
        self.device = device
        self.tokens_per_microbatch = tokens_per_microbatch
        self.pad_token_id = pad_token_id
        self._tokens = 0
        self._seconds = 0.0

    def write(self, batch: TrajectoryBatch | None) -> TrajectoryBatch | None:
        if batch is None:
            return None
        for name in ("prompt_tokens", "response_tokens"):
            if name not in batch:
                raise TrajectoryValidationError("needed to score the reference model", field=name)
        start = time.perf_counter()
        with reference_of(self._ref_model):  # a LoRA policy: its base, the adapter disabled
            ref = reference_log_probs(self._ref_model, batch["prompt_tokens"], batch["response_tokens"],
                                      temperature=self.temperature, device=self.device,
                                      tokens_per_microbatch=self.tokens_per_microbatch,
                                      pad_token_id=self.pad_token_id)
        self._seconds += time.perf_counter() - start
        self._tokens += int(batch["prompt_tokens"].values.numel() + ref.values.numel())
        return batch.with_columns(ref_log_probs=ref)

    def metrics(self) -> dict[str, Any]:
        return {"ref_tokens": self._tokens, "ref_seconds": self._seconds,
                "ref_tokens_per_s": self._tokens / self._seconds if self._seconds else float("nan")}
