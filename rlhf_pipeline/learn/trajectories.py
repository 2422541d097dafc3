"""Multi-turn trajectories trained as one sequence each: the learner's side of agents' rows.

The buffer stores a trajectory as rows, one per model turn; the learner trains it as ONE row whose
prompt is the opening prompt and whose response is everything after it (``rebuild_trajectory``'s
token list), the loss mask 1 on sampled tokens only, so the padded and packed paths and ``grpo_loss``
run on it unchanged. A drawn row that ends a trajectory (``done``) brings its earlier turns, at
positions ``p - step .. p`` (checked on every read); others wait for their trajectory's last row.
Rank 0 finds a draw's trajectory ends (:func:`trajectory_ends`, :func:`narrow_to_trajectory_ends`),
each rank reads its slice (:func:`read_trajectories`); one rank runs both (:func:`trajectory_draw`).
Design: docs/agents.md#training-a-trajectory-is-one-sequence.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from tensordict import TensorDict

from rlhf_pipeline.schema import TerminationReason, TrajectoryBatch
from rlhf_pipeline.schema.padding import pad_batch, padded_fields
from rlhf_pipeline.schema.ragged import RaggedTensor, gather_ranges, lengths_to_offsets

TURN_ADVANTAGES = ("trajectory", "turn", "mixed")
#: the per-token advantage a trajectory batch carries in ``turn`` and ``mixed`` modes, (B, T) at response columns
TOKEN_ADVANTAGE_KEY = ("token_advantage", "full")
# response-aligned float fields joined turn after turn (0 on the environment's tokens)
_JOINED_FLOATS = ("response_log_probs", "ref_log_probs", "kl", "token_rewards")


def is_single_turn(batch: TensorDict) -> bool:
    """True when every row of a padded batch is a whole trajectory (done, at step 0)."""
    return rows_are_single_turn(batch["next", "done"], batch["step"])


def rows_are_single_turn(done: torch.Tensor, step: torch.Tensor) -> bool:
    """True when every row (its ``done`` and ``step``) is a whole trajectory."""
    return bool(done.all()) and not bool(step.any())


def termination_codes(names) -> torch.Tensor:
    """``TerminationReason`` names (``learner.mask_termination_reasons``) -> their int codes."""
    codes = []
    for name in names:
        try:
            codes.append(int(TerminationReason[str(name).upper()]))
        except KeyError:
            valid = [r.name for r in TerminationReason if r is not TerminationReason.NOT_ENDED]
            raise ValueError(f"unknown termination reason {name!r}; valid names are {valid}") from None
    return torch.tensor(codes, dtype=torch.int32)


def masked_by_reason(batch: TensorDict, codes: torch.Tensor) -> torch.Tensor:
    """(B,) bool: rows whose trajectory ended for one of ``codes`` (False without the field)."""
    if codes.numel() == 0 or "termination_reason" not in batch:
        return torch.zeros(batch.batch_size[0], dtype=torch.bool)
    return torch.isin(batch["termination_reason"].to(torch.int32).cpu(), codes)


# ====================================================================== reading whole trajectories
@dataclass
class TrajectoryEnds:
    """Which rows of a draw end a trajectory that can be read whole."""

    chosen: torch.Tensor  # (k,) indices, into the drawn rows, of the rows that end a whole trajectory
    steps: torch.Tensor  # (k,) int64, the step of each: the trajectory has steps + 1 turns
    deferred: int  # drawn rows that did not end their trajectory
    incomplete: int  # trajectories whose first turns are no longer in the store


def trajectory_ends(store, positions: torch.Tensor, done: torch.Tensor, step: torch.Tensor) -> TrajectoryEnds:
    """The drawn rows at ``positions`` (their ``done`` and ``step``) that end a trajectory whose
    first turn ``store`` still holds (a trajectory whose first turns were evicted is dropped and counted:
    docs/agents.md#training-a-trajectory-is-one-sequence)."""
    done = done.reshape(-1).cpu().bool()
    ends = torch.nonzero(done).squeeze(1)  # (e,)
    end_positions = positions.cpu()[ends].to(torch.int64)
    steps = step.reshape(-1).cpu()[ends].to(torch.int64)
    # a trajectory whose first rows were evicted is left out: its first turn would lie before its
    # store's first position (in a union of shards, its own shard's)
    kept = torch.nonzero(_local_positions(store, end_positions) - steps >= 0).squeeze(1)
    return TrajectoryEnds(ends[kept], steps[kept], deferred=int(done.numel() - ends.numel()),
                          incomplete=int(ends.numel() - kept.numel()))


def _local_positions(store, positions: torch.Tensor) -> torch.Tensor:
    """``positions`` of a union of shards as positions within each row's own shard."""
    locate = getattr(store, "locate", None)
    return locate(positions)[1] if locate is not None else positions


def narrow_to_trajectory_ends(sampled, ends: TrajectoryEnds):
    """A draw (``SampledRows``) narrowed to the rows that end a whole trajectory: what is named,
    checkpointed, weighed and fed back is each trajectory's last row; ``trajectory_steps`` says how
    many turns came before it. Its metrics count the draw's trajectories."""
    turns = ends.steps.float() + 1 if ends.steps.numel() else torch.zeros(1)
    metrics = {**sampled.metrics, "charts/trajectories": float(ends.chosen.numel()),
               "charts/turns_per_trajectory_mean": float(turns.mean()),
               "charts/rows_deferred_to_trajectory_end": float(ends.deferred),
               "charts/trajectories_incomplete": float(ends.incomplete)}
    return dataclasses.replace(sampled, positions=sampled.positions[ends.chosen], metrics=metrics,
                               weights=None if sampled.weights is None else sampled.weights[ends.chosen],
                               trajectory_steps=ends.steps)


def read_trajectories(store, end_positions: torch.Tensor, steps: torch.Tensor, *, pad_token_id: int,
                      index_dtype: torch.dtype = torch.int32, turn_advantage: str = "trajectory",
                      turn_advantage_weight: float = 0.5) -> TensorDict:
    """The padded learner batch of the trajectories whose last rows are at ``end_positions``, at
    ``steps``: each read whole from ``store`` and joined into one row. Raises when a trajectory's
    first turns are no longer held (evicted since its last row was drawn)."""
    joined = read_joined(store, end_positions, steps, turn_advantage=turn_advantage,
                         turn_advantage_weight=turn_advantage_weight, fields=padded_fields(store.schema))
    return pad_trajectories(joined, pad_token_id=pad_token_id, index_dtype=index_dtype)


def read_joined(store, end_positions: torch.Tensor, steps: torch.Tensor, *, turn_advantage: str = "trajectory",
                turn_advantage_weight: float = 0.5, fields=None) -> JoinedTrajectories:
    """The trajectories :func:`read_trajectories` reads, joined but not padded (the packed learner's
    input). ``fields``: those to read; by default the store's ragged read (``store.read_ragged``:
    the tokens, response-aligned floats and row fields) plus ``termination_reason`` and
    ``step_advantage`` when stored."""
    turns = steps.cpu().to(torch.int64) + 1  # (k,)
    end_positions = end_positions.cpu().to(torch.int64)
    if bool((_local_positions(store, end_positions) - turns + 1 < 0).any()):
        raise RuntimeError("the first turns of a drawn trajectory were evicted before they were read; give the "
                           "buffer a larger capacity_rows than the learner's draws run behind the collectors")
    positions = gather_ranges(end_positions - turns + 1, turns)
    if fields is not None:
        rows = store.read(positions, fields=fields)
    else:
        rows = store.read_ragged(positions)
        # what joining needs beyond the ragged read's fields: the ending (masked reasons) and each
        # turn's own advantage (turn_advantage=turn / mixed), where stored
        extra = tuple(name for name in ("termination_reason", "step_advantage") if name in store.schema.field_names)
        if extra:
            more = store.read(positions, fields=extra)
            rows = rows.with_columns(**{name: more[name] for name in extra})
    check_whole(rows, turns)
    return join_turns(rows, turns, turn_advantage=turn_advantage, turn_advantage_weight=turn_advantage_weight)


def trajectory_draw(store, sampled, drawn: TensorDict, *, pad_token_id: int, turn_advantage: str,
                    turn_advantage_weight: float = 0.5, pin: bool = False) -> tuple:
    """A learner draw (``SampledRows``) of multi-turn rows, read into ``drawn`` -> the draw narrowed
    to the rows that end a whole trajectory (:func:`narrow_to_trajectory_ends`) and the padded
    batch of those trajectories (None when the draw ended none)."""
    ends = trajectory_ends(store, sampled.positions, drawn["next", "done"], drawn["step"])
    sampled = narrow_to_trajectory_ends(sampled, ends)
    if ends.chosen.numel() == 0:
        return sampled, None
    batch = read_trajectories(store, sampled.positions, ends.steps, pad_token_id=pad_token_id,
                              turn_advantage=turn_advantage, turn_advantage_weight=turn_advantage_weight)
    if pin and torch.cuda.is_available():
        batch = batch.pin_memory()
    return sampled, batch


def joined_trajectory_draw(store, sampled, done: torch.Tensor, step: torch.Tensor, *,
                           turn_advantage: str, turn_advantage_weight: float = 0.5) -> tuple:
    """:func:`trajectory_draw` for the packed learner: from the drawn rows' ``done`` and ``step``,
    the narrowed draw and its trajectories joined but not padded (:func:`read_joined`; None when
    the draw ended none)."""
    ends = trajectory_ends(store, sampled.positions, done, step)
    sampled = narrow_to_trajectory_ends(sampled, ends)
    if ends.chosen.numel() == 0:
        return sampled, None
    return sampled, read_joined(store, sampled.positions, ends.steps, turn_advantage=turn_advantage,
                                turn_advantage_weight=turn_advantage_weight)


def check_whole(rows: TrajectoryBatch, turns: torch.Tensor) -> None:
    """Rows read as ``turns`` consecutive runs must each be one trajectory's steps 0..n-1."""
    first = lengths_to_offsets(turns)[:-1].repeat_interleave(turns)
    step_expected = torch.arange(int(turns.sum())) - first
    same_trajectory = rows["trajectory_id"] == rows["trajectory_id"][first]
    in_order = rows["step"].to(torch.int64) == step_expected
    if not bool((same_trajectory & in_order).all()):
        bad = int(torch.nonzero(~(same_trajectory & in_order))[0])
        raise ValueError(
            f"a trajectory's rows are not stored together in step order (row {bad} of the read has trajectory "
            f"{int(rows['trajectory_id'][bad])}, step {int(rows['step'][bad])}): the learner reads a trajectory "
            "as the rows just before its last one; write each trajectory's rows in one append, in step order")


@dataclass
class JoinedTrajectories:
    """Trajectories as learner rows (ragged): the stored fields, a loss mask, per-token advantages."""

    rows: TrajectoryBatch  # one row per trajectory: prompt = step 0's prompt, response = the rest
    loss_mask: RaggedTensor  # bool, aligned with response_tokens: True on sampled tokens
    token_advantage: RaggedTensor | None  # float32, aligned with response_tokens (``turn``, ``mixed``)
    termination_reason: torch.Tensor | None  # (B,) int32, the last row's


def join_turns(rows: TrajectoryBatch, turns: torch.Tensor, *, turn_advantage: str = "trajectory",
               turn_advantage_weight: float = 0.5) -> JoinedTrajectories:
    """``rows``: consecutive runs of ``turns`` rows, each one trajectory in step order -> one row each."""
    if turn_advantage not in TURN_ADVANTAGES:
        raise ValueError(f"turn_advantage must be one of {TURN_ADVANTAGES}, got {turn_advantage!r}")
    check_turn_advantage_weight(turn_advantage_weight)
    if turn_advantage == "mixed" and "step_advantage" not in rows:
        raise ValueError(
            "learner.turn_advantage=mixed blends each trajectory's advantage with each turn's own, but these rows "
            "hold one advantage only (no step_advantage field): write the buffer with "
            "GroupAdvantage(step_advantage=True) into a store created with the optional field step_advantage, "
            "or train with learner.turn_advantage=trajectory or turn")
    offsets = lengths_to_offsets(turns)
    first, last = offsets[:-1], offsets[1:] - 1
    trajectory_of_row = torch.arange(len(turns)).repeat_interleave(turns)  # (N,)
    prompt, response = rows["prompt_tokens"], rows["response_tokens"]
    # Each row gives two pieces, in order: its prompt (the environment's tokens since the previous
    # turn; none at step 0, whose prompt is the learner row's prompt) and its response. Every
    # joined column is one gather over [prompt values | response values] at those pieces.
    prompt_lengths = torch.where(rows["step"] > 0, prompt.lengths(), 0)  # (N,)
    piece_starts = torch.stack([prompt.offsets[:-1], prompt.values.numel() + response.offsets[:-1]], 1).reshape(-1)
    piece_lengths = torch.stack([prompt_lengths, response.lengths()], 1).reshape(-1)  # (2N,)
    at = gather_ranges(piece_starts, piece_lengths)
    joined_lengths = torch.zeros(len(turns), dtype=torch.int64).index_add_(
        0, trajectory_of_row, prompt_lengths + response.lengths())

    def joined(prompt_values: torch.Tensor, response_values: torch.Tensor) -> RaggedTensor:
        return RaggedTensor.from_lengths(torch.cat([prompt_values, response_values])[at], joined_lengths)

    def zeros_on_prompts(dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(prompt.values.numel(), dtype=dtype)

    floats = {name: joined(zeros_on_prompts(torch.float32), rows[name].values.to(torch.float32))
              for name in _JOINED_FLOATS if name in rows}
    loss_mask = joined(zeros_on_prompts(torch.bool), torch.ones(response.values.numel(), dtype=torch.bool))
    token_advantage = None
    if turn_advantage != "trajectory":
        own = rows["step_advantage" if "step_advantage" in rows else "advantage"].to(torch.float32)  # (N,)
        if turn_advantage == "mixed":
            whole = rows["advantage"].to(torch.float32)[last][trajectory_of_row]  # (N,) the trajectory's
            own = (1.0 - turn_advantage_weight) * whole + turn_advantage_weight * own
        token_advantage = joined(zeros_on_prompts(torch.float32), own.repeat_interleave(response.lengths()))

    columns = {
        "prompt_tokens": rows["prompt_tokens"].index(first),
        "response_tokens": joined(prompt.values.to(response.values.dtype), response.values),
        **floats,
        # the trajectory's flags and ids are its last row's; its reward is the sum of its turns'
        **{name: rows[name][last] for name in ("done", "terminated", "truncated", "group_id", "trajectory_id",
                                               "step", "advantage") if name in rows},
        "reward": torch.zeros(len(turns), dtype=torch.float32).index_add_(
            0, trajectory_of_row, rows["reward"].to(torch.float32)),
        # rows of one trajectory share a version; the oldest is the one staleness must see
        "policy_version": torch.zeros(len(turns), dtype=rows["policy_version"].dtype).scatter_reduce_(
            0, trajectory_of_row, rows["policy_version"], reduce="amin", include_self=False),
    }
    return JoinedTrajectories(
        rows=TrajectoryBatch(columns),
        loss_mask=loss_mask,
        token_advantage=token_advantage,
        termination_reason=rows["termination_reason"][last].to(torch.int32) if "termination_reason" in rows else None,
    )


def check_turn_advantage_weight(weight: float) -> None:
    """``learner.turn_advantage_weight`` is the turn's share of a mixed advantage: a number in [0, 1]."""
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0.0 <= weight <= 1.0:
        raise ValueError(f"learner.turn_advantage_weight must be a number in [0, 1] (the turn's share of "
                         f"turn_advantage=mixed: 0 = the trajectory's advantage, 1 = the turn's), got {weight!r}")


def pad_trajectories(joined: JoinedTrajectories, *, pad_token_id: int = 0,
                     index_dtype: torch.dtype = torch.int64) -> TensorDict:
    """The padded learner batch of joined trajectories: ``pad_batch``'s layout, with the loss mask
    ``("masks", "all_assistant_mask")`` 0 on the environment's tokens, ``"termination_reason"``
    (B,) and, in ``turn`` mode, the per-token advantage at :data:`TOKEN_ADVANTAGE_KEY`."""
    batch = pad_batch(joined.rows, pad_token_id=pad_token_id, index_dtype=index_dtype)
    prompt_width = batch["tokens", "prompt"].shape[1]  # P
    response_width = batch["tokens", "response"].shape[1]  # R
    loss, _ = joined.loss_mask.to_padded(False, length=response_width)  # (B, R)
    # a new tensor: ("masks", "response"), the response's span, is a view of the old one
    assistant = batch["masks", "all_assistant_mask"].clone()  # (B, T)
    assistant[:, prompt_width:] &= loss
    batch["masks", "all_assistant_mask"] = assistant
    advantage = batch["sequence_advantage"][:, None].expand(assistant.shape)  # (B, T)
    if joined.token_advantage is not None:
        advantage = torch.zeros(assistant.shape, dtype=torch.float32)
        advantage[:, prompt_width:] = joined.token_advantage.to_padded(0.0, length=response_width)[0]
        batch[TOKEN_ADVANTAGE_KEY] = advantage
    # torchrl's (B, T, 1) layout, as pad_batch writes it: the advantage where the loss is, else 0
    batch["advantage"] = torch.where(assistant, advantage, 0.0).unsqueeze(-1)
    if joined.termination_reason is not None:
        batch["termination_reason"] = joined.termination_reason
    return batch
