"""The learner's optimizer and learning-rate schedule: AdamW, linear warm-up, then constant or
cosine decay to ``min_lr_ratio`` (``LearnerSettings``)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from rlhf_pipeline.learn.settings import LearnerSettings


def make_optimizer(model: torch.nn.Module, settings: LearnerSettings, total_steps: int, *,
                   fused: bool = True) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over ``model``'s parameters and its schedule over ``total_steps`` steps.

    ``fused``: one kernel over every tensor (CUDA, and CPU since torch 2.4) instead of a Python
    loop per parameter: 0.4 ms against 2.5 ms a step for the default pipeline's model on one CPU
    thread.
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, betas=settings.adam_betas,
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
