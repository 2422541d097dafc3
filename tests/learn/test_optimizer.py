"""The optimizer's settings after a checkpoint is loaded: the settings' values, the checkpoint's moments."""

from __future__ import annotations

import dataclasses

import torch

from rlhf_pipeline.learn.step import apply_settings, lr_lambda, make_optimizer
from rlhf_pipeline.learn.settings import LearnerSettings

SETTINGS = LearnerSettings(lr=1e-4, warmup_steps=4, lr_schedule="cosine", batch_size=4, sample_window=4)
STEPS = 10


def trained(settings: LearnerSettings, steps: int = 3):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer, scheduler = make_optimizer(model, settings, STEPS, fused=False)
    for _ in range(steps):
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return model, optimizer, scheduler


def resumed(settings: LearnerSettings):
    """A new optimizer and schedule under ``settings`` loaded from the states of 3 steps under SETTINGS."""
    model, optimizer, scheduler = trained(SETTINGS)
    new_optimizer, new_scheduler = make_optimizer(model, settings, STEPS, fused=False)
    new_optimizer.load_state_dict(optimizer.state_dict())
    new_scheduler.load_state_dict(scheduler.state_dict())
    apply_settings(new_optimizer, new_scheduler, settings, STEPS)
    return optimizer, new_optimizer, new_scheduler


def test_unchanged_settings_leave_every_loaded_value_as_it_was():
    saved, loaded, scheduler = resumed(SETTINGS)
    assert loaded.param_groups[0]["lr"] == saved.param_groups[0]["lr"]  # bit for bit
    assert scheduler.get_last_lr() == [saved.param_groups[0]["lr"]]


def test_a_changed_learning_rate_and_weight_decay_apply_at_the_schedules_position():
    changed = dataclasses.replace(SETTINGS, lr=1e-3, weight_decay=0.5)
    saved, loaded, scheduler = resumed(changed)
    factor = lr_lambda(changed, STEPS)(3)  # three steps were taken: still warming up
    assert loaded.param_groups[0]["lr"] == 1e-3 * factor and scheduler.base_lrs == [1e-3]
    assert loaded.param_groups[0]["weight_decay"] == 0.5
    state = loaded.state_dict()["state"][0]
    assert torch.equal(state["exp_avg"], saved.state_dict()["state"][0]["exp_avg"])  # the moments are kept
    scheduler.step()
    assert loaded.param_groups[0]["lr"] == 1e-3 * lr_lambda(changed, STEPS)(4)  # and the schedule goes on
