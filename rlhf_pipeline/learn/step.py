"""One optimizer step, top to bottom, as one rank sees it (:func:`plan_step`, :func:`train_step`); and the
optimizer it steps (AdamW, linear warm-up, then constant or cosine decay: :func:`make_optimizer`).

Micro-batches of at most ``micro_batch_tokens`` tokens (packed, or padded: ``learn/batch.py``), each
loss weighted by its share of the batch's loss-carrying tokens (``token_mean``) or rows, so the
accumulated gradient is the whole batch's; then clipping, AdamW and the schedule. A step whose loss,
gradient norm or new weights' norm is not finite is refused, at the cost of one norm of the weights
(:class:`~rlhf_pipeline.learn.errors.NonFiniteStep`). Data parallelism is a layer around it
(``DataParallel.plan_step`` hands in a :class:`StepPlan` over the global batch; with one rank each of
its hooks is the identity). Design: docs/learner.md#one-step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from tensordict import TensorDict

from rlhf_pipeline.learn.errors import NonFiniteStep
from rlhf_pipeline.learn.batch import (
    PackedBatch,
    PackedMicroBatch,
    RaggedRows,
    pack_rows,
    plan_rows,
    split_microbatches_with_rows,
)
from rlhf_pipeline.learn.loss import (
    MAX_METRICS,
    ROW_LOGPROB_DIFF,
    aggregates_by_token,
    grpo_packed_loss,
    grpo_step_loss,
)

if TYPE_CHECKING:
    from rlhf_pipeline.learn.settings import LearnerSettings


@dataclass
class MicroBatch:
    """One forward and backward of a step."""

    rows: torch.Tensor  # (b,) indices of its rows in the rank's batch (CPU)
    batch: TensorDict | PackedMicroBatch  # the rows, padded and trimmed to their longest, or packed
    weight: float  # its share of the step's loss (0 for a rank's filler row or an FSDP repeat)
    counts: bool = True  # False for a repeat run only to take part in FSDP's gathers
    gradient_sync: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


@dataclass
class StepPlan:
    """What :func:`train_step` runs: the micro-batches, and the step's totals over every rank."""

    micro_batches: list[MicroBatch]
    rows: int  # rows of the step's (global) batch
    response_tokens: int  # their response tokens: what token_mean divides by
    attention_tokens: int  # their prompt + response tokens: what tokens/s counts
    loss_scale: float = 1.0  # DDP and FSDP average gradients over ranks; the loss undoes that
    reduce: Callable[[dict[str, float]], dict[str, float]] = field(default=lambda sums: sums)


@dataclass
class StepOutcome:
    losses: dict[str, float]  # every loss statistic, weighted as the whole batch's
    grad_norm: float  # before clipping
    learning_rate: float  # the one the step used
    row_feedback: torch.Tensor | None  # (B,) each row's new priority, in batch order; None when off
    row_logprob_diff: torch.Tensor  # (B, 3) each row's recomputed-vs-stored log-prob sum, max, tokens (loss.py)


def mean_one(weights: torch.Tensor) -> torch.Tensor:
    """A draw's importance weights (prioritized sampling) scaled to mean 1 over the batch.

    torchrl's weights divide by the largest over the whole buffer, which a single near-zero
    priority (a zero-advantage row) makes tiny: ~0.04 on average in a default-pipeline run, a
    25x smaller step. With mean 1 only the relative correction acts and the learning rate keeps
    its meaning."""
    weights = weights.to(torch.float32)
    return weights / weights.mean().clamp_min(torch.finfo(torch.float32).tiny)


def batch_counts(batch: TensorDict | PackedBatch) -> tuple[int, int, int]:
    """``(rows, response tokens that carry loss, attention tokens)`` of a padded batch (the loss
    mask: every response token of a single-turn row, the sampled ones of a trajectory's), or of a
    packed one."""
    if isinstance(batch, PackedBatch):
        return batch.counts()
    return (batch.batch_size[0], int(batch["masks", "all_assistant_mask"].sum()),
            int(batch["masks", "all_attention_mask"].sum()))


def micro_batch_weight(micro: TensorDict | PackedMicroBatch, *, rows: int, response_tokens: int,
                       token_mean: bool) -> float:
    """A micro-batch's share of a batch of ``rows`` rows and ``response_tokens`` response tokens."""
    packed = isinstance(micro, PackedMicroBatch)
    if token_mean:
        micro_tokens = micro.response_tokens if packed else int(micro["masks", "all_assistant_mask"].sum())
        return micro_tokens / max(response_tokens, 1)
    return (micro.num_rows if packed else micro.batch_size[0]) / rows


def split_batch(batch: TensorDict | PackedBatch,
                settings: LearnerSettings) -> list[tuple[torch.Tensor, TensorDict | PackedMicroBatch]]:
    """``batch`` cut into micro-batches of at most ``micro_batch_tokens`` tokens, each with the (CPU)
    indices of its rows: packed sequences with ``learner.packing``, else padded micro-batches.
    The learner's batches come packed already (:class:`PackedBatch`, made on its prefetch thread);
    a padded batch is packed here, on the CPU (a plan is a few ms of Python), the packed
    sequences then go to the batch's device."""
    if isinstance(batch, PackedBatch):
        return batch.micro_batches()
    if not settings.packing:
        return split_microbatches_with_rows(batch, settings.micro_batch_tokens)
    host = batch if batch.device is None or batch.device.type == "cpu" else batch.to("cpu")
    ragged = RaggedRows.from_padded(host)
    pieces = []
    for members in plan_rows(ragged, settings.micro_batch_tokens).sequences:
        packed = pack_rows(ragged, list(members))
        pieces.append((packed.rows, packed if host is batch else packed.to(batch.device, non_blocking=True)))
    return pieces


def plan_step(batch: TensorDict | PackedBatch, settings: LearnerSettings) -> StepPlan:
    """One rank's plan: ``batch`` cut into micro-batches, each weighted by its share of it."""
    rows, response_tokens, attention_tokens = batch_counts(batch)
    token_mean = aggregates_by_token(settings.loss)
    micro_batches = [
        MicroBatch(indices, micro, micro_batch_weight(micro, rows=rows, response_tokens=response_tokens,
                                                      token_mean=token_mean))
        for indices, micro in split_batch(batch, settings)
    ]
    return StepPlan(micro_batches, rows, response_tokens, attention_tokens)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, plan: StepPlan,
               settings: LearnerSettings, *, forward_model: torch.nn.Module | None = None,
               autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> StepOutcome:
    """Runs ``plan``: accumulates the gradient of the batch's GRPO loss, clips it, steps.

    ``forward_model``: what the forward and backward run through (a DDP or FSDP wrapper of
    ``model``; default ``model``). ``autocast``: the forward's precision context (bf16 on CUDA).
    """
    forward_model = forward_model if forward_model is not None else model
    loss_options = dataclasses.asdict(settings.loss)
    feedback_kind = settings.priority_feedback if settings.priority_feedback != "none" else None
    local_rows = sum(int(part.rows.numel()) for part in plan.micro_batches if part.counts)
    row_feedback = torch.zeros(local_rows) if feedback_kind else None
    row_logprob_diff = torch.zeros(local_rows, 3)

    optimizer.zero_grad(set_to_none=True)
    sums: dict[str, float] = {}
    for part in plan.micro_batches:
        with part.gradient_sync(), autocast():
            step_loss = grpo_packed_loss if isinstance(part.batch, PackedMicroBatch) else grpo_step_loss
            loss, stats = step_loss(forward_model, part.batch, temperature=settings.temperature,
                                    row_feedback=feedback_kind, **loss_options)
            (loss * (part.weight * plan.loss_scale)).backward()
        feedback = stats.pop("row_feedback", None)  # (b,) and (b, 3): the non-scalar statistics
        logprob_diff = stats.pop(ROW_LOGPROB_DIFF)
        if part.counts:
            row_logprob_diff[part.rows] = logprob_diff.detach().float().cpu()
            if row_feedback is not None:
                row_feedback[part.rows] = feedback.float().cpu()
        for key, value in stats.items():
            if key in MAX_METRICS:  # a maximum over the micro-batches that count (not a filler's, a repeat's)
                sums[key] = max(sums.get(key, 0.0), float(value) if part.weight > 0 else 0.0)
            else:
                sums[key] = sums.get(key, 0.0) + float(value) * part.weight
    losses = plan.reduce(sums)
    # every value checked below is the same on every rank (the loss is summed over them, DDP's
    # gradients and weights are alike everywhere, FSDP's norms are gathered), so all ranks refuse
    # the same step, with no collective of its own
    if not math.isfinite(losses["loss"]):
        raise NonFiniteStep(f"its loss is {losses['loss']}")

    clip = settings.max_grad_norm if settings.max_grad_norm > 0 else float("inf")
    grad_norm = float(_whole(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
    if not math.isfinite(grad_norm):
        found = _first_not_finite((name, p.grad) for name, p in model.named_parameters())
        raise NonFiniteStep(f"the gradient of {found[0]!r} is not finite (norm {found[1]})" if found else
                            f"the gradients' total norm is {grad_norm} (each parameter's is finite: they "
                            f"overflow together)")
    learning_rate = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    # float32 norms: weights whose squares overflow (beyond ~1e19) count as not finite, as no
    # forward through them is (a learning rate of 1e30 makes such weights from finite gradients)
    weight_norm = float(_whole(torch.nn.utils.get_total_norm(list(model.parameters()))))
    if not math.isfinite(weight_norm):
        found = _first_not_finite(model.named_parameters())
        where = f"{found[0]!r} has norm {found[1]}" if found else f"their total norm is {weight_norm}"
        raise NonFiniteStep(f"the weights after the optimizer step are not finite ({where}; learning rate "
                            f"{learning_rate:g})")
    return StepOutcome(losses, grad_norm, learning_rate, row_feedback, row_logprob_diff)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """An FSDP DTensor gathered whole (a collective: every rank calls it), or ``tensor`` itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _first_not_finite(named: Iterable[tuple[str, torch.Tensor | None]]) -> tuple[str, float] | None:
    """The first ``(name, norm)`` whose tensor's norm is not finite, or None. Only on a refused step:
    every rank goes through the same tensors in the same order and stops at the same one (an FSDP
    shard is gathered whole, the same everywhere)."""
    for name, tensor in named:
        if tensor is None:
            continue
        norm = float(torch.linalg.vector_norm(_whole(tensor.detach())))
        if not math.isfinite(norm):
            return name, norm
    return None


# ====================================================================== the optimizer and its schedule
def make_optimizer(model: torch.nn.Module, settings: LearnerSettings, total_steps: int, *,
                   fused: bool = True) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over ``model``'s trainable parameters and its schedule over ``total_steps`` steps.

    ``fused``: one kernel over every tensor (CUDA, and CPU since torch 2.4) instead of a Python
    loop per parameter: 0.4 ms against 2.5 ms a step for the default pipeline's model on one CPU
    thread.
    """
    # the trainable parameters only: a LoRA model's adapter, not its frozen base (learn/lora.py)
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=settings.lr, betas=settings.adam_betas,
                                  weight_decay=settings.weight_decay, fused=fused or None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(settings, total_steps))
    return optimizer, scheduler


def lr_lambda(settings: LearnerSettings, total_steps: int) -> Callable[[int], float]:
    """LR multiplier of step ``s``: linear warm-up, then constant or cosine to ``min_lr_ratio``."""

    def factor(step: int) -> float:
        if step < settings.warmup_steps:
            return (step + 1) / settings.warmup_steps
        if settings.lr_schedule == "constant":
            return 1.0
        span = max(1, total_steps - settings.warmup_steps)
        progress = min(1.0, (step - settings.warmup_steps) / span)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return settings.min_lr_ratio + (1.0 - settings.min_lr_ratio) * cosine

    return factor


def apply_settings(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
                   settings: LearnerSettings, total_steps: int) -> None:
    """Puts ``settings``' hyperparameters back after loading a checkpoint's optimizer and scheduler
    states, which carry the values of the run that saved them (param groups' ``lr``, ``betas``,
    ``weight_decay``; the scheduler's ``base_lrs``): without this, a resume or a branch with a
    changed ``learner.lr`` would go on with the old one. The schedule's position (``last_epoch``)
    and AdamW's moments are kept. With unchanged settings every value is the one loaded."""
    factor = lr_lambda(settings, total_steps)(scheduler.last_epoch)
    for group in optimizer.param_groups:
        group["initial_lr"] = settings.lr
        group["lr"] = settings.lr * factor
        group["betas"] = tuple(settings.adam_betas)
        group["weight_decay"] = settings.weight_decay
    scheduler.base_lrs = [settings.lr for _ in optimizer.param_groups]
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reports
