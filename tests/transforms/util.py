"""Builders shared by the transform tests (multi-step trajectories, torchrl TensorDicts)."""

from __future__ import annotations

import torch
from helpers import make_batch
from tensordict import TensorDict

from rlhf_pipeline.schema import TrajectoryBatch


def multi_step_batch(steps_per_traj: list[int], group_of_traj: list[int], rewards: torch.Tensor, *,
                     first_trajectory_id: int = 0, seed: int = 0) -> TrajectoryBatch:
    """Rows of trajectories with ``steps_per_traj[t]`` steps each, rows of a trajectory contiguous."""
    n = sum(steps_per_traj)
    base = make_batch(1, n, seed=seed)
    traj = torch.arange(len(steps_per_traj)).repeat_interleave(torch.tensor(steps_per_traj))
    starts = torch.tensor([0, *steps_per_traj]).cumsum(0)[:-1]
    step = torch.arange(n) - starts[traj]
    done = step == torch.tensor(steps_per_traj)[traj] - 1
    return base.with_columns(
        group_id=torch.tensor(group_of_traj, dtype=torch.int64)[traj],
        trajectory_id=traj.to(torch.int64) + first_trajectory_id,
        step=step.to(torch.int32), done=done, terminated=done, truncated=torch.zeros(n, dtype=torch.bool),
        reward=rewards.to(torch.float32),
    )


def torchrl_trajectory(group_id: int, rewards: torch.Tensor) -> TensorDict:
    """One trajectory as torchrl's MCAdvantage expects it: (T,) batch, ("next", "reward"/"done")."""
    t = rewards.numel()
    return TensorDict(
        group_id=torch.full((t,), group_id),
        next=TensorDict(reward=rewards.reshape(t, 1).float(),
                        done=(torch.arange(t) == t - 1).reshape(t, 1), batch_size=[t]),
        batch_size=[t],
    )
