"""Re-scoring a recorded buffer while it is replayed, without touching the source.

Two independent parts, applied to each padded batch on the learner's prefetch thread
(:class:`BatchRescorer`, the learner's ``batch_transform``): advantages recomputed once for the whole
replayed snapshot from the stored rewards with the write path's own math (:func:`buffer_advantages`:
a group needs all its trajectories, which a batch rarely holds), looked up by position; and reference
log-probs, KL and KL-shaped token rewards from another reference model (:class:`ReferenceRescorer`).
Multi-turn trajectories are re-scored as the learner trains them, one sequence each.
Design: docs/replay.md#re-scoring-while-replaying.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from tensordict import TensorDict

from rlhf_pipeline.learn.trajectories import TOKEN_ADVANTAGE_KEY
from rlhf_pipeline.schema.padding import RESPONSE_FLOAT_KEYS
from rlhf_pipeline.schema.ragged import RaggedTensor
from rlhf_pipeline.transforms.group_advantage import group_advantages, trajectory_returns
from rlhf_pipeline.transforms.kl_reward import ESTIMATORS, kl_token_rewards
from rlhf_pipeline.transforms.ref_logprobs import reference_log_probs

# rows of row fields read per call while computing advantages: bounded memory on big buffers
_READ_ROWS = 65_536


@dataclass(frozen=True)
class AdvantageOptions:
    """How advantages are recomputed (``GroupAdvantage``'s options of the same names)."""

    normalize: bool = True
    """Divide by the group's std (GRPO); False is Dr. GRPO."""
    leave_one_out: bool = False
    """Baseline = mean of the other trajectories of the group (RLOO)."""
    trajectory_return: Literal["sum", "mean", "max", "step"] = "sum"
    """How a multi-row trajectory's rewards become one return (single-turn: all the same)."""
    eps: float = 1e-6
    """Lower clamp of the std."""


def buffer_advantages(store, rows: int, options: AdvantageOptions, unit_bounds=None) -> torch.Tensor:
    """(rows,) float32 advantages of positions ``[0, rows)`` of ``store``, groups taken whole
    from those rows; the same numbers ``GroupAdvantage`` writes for the same groups."""
    columns = ("reward", "trajectory_id", "group_id")
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in columns}
    # read unit by unit (whole units per call), so a Zarr store decodes each unit once
    bounds = unit_bounds if unit_bounds is not None else store.unit_bounds()
    start = 0
    for stop in [b for _, b in bounds if b <= rows] + [rows]:
        if stop - start < _READ_ROWS and stop != rows:
            continue
        if stop > start:
            read = store.read(torch.arange(start, stop), fields=columns)
            for name in columns:
                parts[name].append(read[name])
        start = stop
    reward, trajectory_id, group_id = (torch.cat(parts[name]) for name in columns)

    traj_ids, traj_of_row = torch.unique(trajectory_id, return_inverse=True)
    num_traj = traj_ids.numel()
    group_of_traj = torch.empty(num_traj, dtype=group_id.dtype)
    group_of_traj[traj_of_row] = group_id
    if options.trajectory_return == "step":
        group_ids, group_of_row = torch.unique(group_id, return_inverse=True)
        _check_leave_one_out(options, group_ids, torch.bincount(group_of_row))
        adv, _ = group_advantages(reward, group_of_row, group_ids.numel(), normalize=options.normalize,
                                  leave_one_out=options.leave_one_out, eps=options.eps)
        return adv
    group_ids, group_of_traj_dense = torch.unique(group_of_traj, return_inverse=True)
    _check_leave_one_out(options, group_ids, torch.bincount(group_of_traj_dense))
    returns = trajectory_returns(reward, traj_of_row, num_traj, options.trajectory_return)
    adv_traj, _ = group_advantages(returns, group_of_traj_dense, group_ids.numel(), normalize=options.normalize,
                                   leave_one_out=options.leave_one_out, eps=options.eps)
    return adv_traj[traj_of_row]


def _check_leave_one_out(options: AdvantageOptions, group_ids: torch.Tensor, sizes: torch.Tensor) -> None:
    if not options.leave_one_out:
        return
    alone = torch.nonzero(sizes < 2).reshape(-1)
    if alone.numel():
        raise ValueError(
            f"group {int(group_ids[alone[0]])} has a single trajectory in the replayed rows ({alone.numel()} "
            f"such groups): the leave-one-out baseline needs 2 or more. Replay without --advantage-baseline "
            f"leave-one-out, or a buffer that holds whole groups"
        )


# ======================================================================== reference
class ReferenceRescorer:
    """Recomputes ``ref_log_probs``, ``kl`` and ``token_rewards`` of a padded batch under ``model``."""

    def __init__(self, model: torch.nn.Module, *, temperature: float = 1.0, kl_estimator: str = "k1",
                 kl_coef: float = 0.05, tokens_per_microbatch: int = 16_384, pad_token_id: int = 0) -> None:
        if kl_estimator not in ESTIMATORS:
            raise ValueError(f"kl estimator must be one of {list(ESTIMATORS)}, got {kl_estimator!r}")
        self.model = model.eval()
        for parameter in self.model.parameters():
            parameter.requires_grad_(False)
        self.temperature = temperature
        self.kl_estimator = kl_estimator
        self.kl_coef = kl_coef
        self.tokens_per_microbatch = tokens_per_microbatch
        self.pad_token_id = pad_token_id

    def __call__(self, batch: TensorDict) -> TensorDict:
        prompt_mask = batch["masks", "prompt"]  # (B, P)
        response_mask = batch["masks", "response"]  # (B, R)
        prompt = RaggedTensor.from_padded(batch["tokens", "prompt"], prompt_mask)
        response = RaggedTensor.from_padded(batch["tokens", "response"], response_mask)
        ref = reference_log_probs(self.model, prompt, response, temperature=self.temperature,
                                  tokens_per_microbatch=self.tokens_per_microbatch, pad_token_id=self.pad_token_id)
        sampler = RaggedTensor.from_padded(batch["log_probs", "response"], response_mask)
        # a multi-turn trajectory's response holds the environment's tokens between its turns
        # (learn/trajectories.py): context, not sampled, so no reference log-prob and no KL there
        trained = batch["masks", "all_assistant_mask"][:, prompt_mask.shape[1]:][response_mask]
        has_context = not bool(trained.all())
        if has_context:  # the reference equal to the sampler there: a KL of 0
            ref = RaggedTensor(torch.where(trained, ref.values, sampler.values.to(ref.values.dtype)), ref.offsets)
        reward = batch["next", "reward"].reshape(-1)
        kl, token_rewards = kl_token_rewards(sampler, ref, reward, coef=self.kl_coef, estimator=self.kl_estimator)
        if has_context:
            ref = RaggedTensor(torch.where(trained, ref.values, 0.0), ref.offsets)
        for name, values in (("ref_log_probs", ref), ("kl", kl), ("token_rewards", token_rewards)):
            _place_response_floats(batch, name, values.values, response_mask)
        return batch


def _place_response_floats(batch: TensorDict, name: str, values: torch.Tensor, response_mask: torch.Tensor) -> None:
    """Writes ragged response-aligned ``values`` into the field's (B, T) and (B, R) keys, 0 elsewhere."""
    full_key, response_key = RESPONSE_FLOAT_KEYS[name]
    width = batch["tokens", "full"].shape[1]
    prompt_width = width - response_mask.shape[1]
    full = torch.zeros((response_mask.shape[0], width), dtype=torch.float32)
    response = full[:, prompt_width:]  # a view, as pad_batch lays them out
    response[response_mask] = values.to(torch.float32)
    batch.set(full_key, full)
    batch.set(response_key, response)


# ======================================================================== the transform
class BatchRescorer:
    """The learner's ``batch_transform``: advantages looked up by position, then the reference.

    Both write only into the padded batch in memory, under the keys of
    :mod:`rlhf_pipeline.schema.padding`, so a re-scored batch is exactly what ``pad_batch`` would give
    for rows written with those values (tested). A multi-turn trajectory, named by its last row, gets
    its advantage (the trajectory's, on every sampled token) and reference log-probs on its sampled
    tokens only, scored in the full context of the conversation; the environment's tokens get none (0)
    and no KL. Its ``token_rewards`` put the trajectory's return on its last token (the loss reads
    neither ``kl`` nor ``token_rewards``: both are recomputed for the batch's metrics and consistency)."""

    def __init__(self, advantages: torch.Tensor | None = None, reference: ReferenceRescorer | None = None) -> None:
        self.advantages = advantages  # (rows,) by position, from buffer_advantages
        self.reference = reference

    def __call__(self, positions: torch.Tensor, batch: TensorDict) -> TensorDict:
        if self.advantages is not None:
            if TOKEN_ADVANTAGE_KEY in batch.keys(include_nested=True):
                raise ValueError("re-scored advantages give each trajectory one advantage (by its last row), but "
                                 "learner.turn_advantage=turn trains each turn on its own: replay with "
                                 "learner.turn_advantage=trajectory, or without re-scoring the advantages")
            sequence_advantage = self.advantages[positions].to(torch.float32)  # (B,)
            assistant = batch["masks", "all_assistant_mask"]  # (B, T)
            batch.set("sequence_advantage", sequence_advantage)
            batch.set("advantage", torch.where(assistant, sequence_advantage[:, None], 0.0).unsqueeze(-1))
        if self.reference is not None:
            batch = self.reference(batch)
        return batch
