"""What turns a draw's rows into the tensors a step trains on: padded micro-batches, or packed ones.

Padded (:func:`split_microbatches_with_rows`): rows sorted by length, cut within ``micro_batch_tokens``,
each micro-batch trimmed to its widths. Packed (:class:`PackedBatch`, built on the prefetch thread):
each micro-batch one sequence of whole rows (:func:`plan_packs` first-fit decreasing, :func:`pack_rows`).
Stale rows are dropped here (:func:`fresh_mask`, :func:`drop_stale`), the rest re-cut (:func:`take_rows`).
Why one file: both layouts, the packing plan and the batch built ahead of the step are one contract
with ``learn/step.py`` (which tokens a micro-batch holds, what each row's columns are): a change to one
is a change to all; trajectories and the loss change for reasons of their own and stay apart.
Design: docs/learner.md#packed-micro-batches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tensordict import TensorDict

from rlhf_pipeline.learn.trajectories import TOKEN_ADVANTAGE_KEY, JoinedTrajectories
from rlhf_pipeline.schema import FIELDS_BY_NAME, TrajectoryBatch
from rlhf_pipeline.schema.ragged import RaggedTensor, gather_ranges, lengths_to_offsets


# ====================================================================== padded micro-batches
# The learner samples B rows per optimizer step; the forward/backward pass runs on
# micro-batches whose *padded* size, rows x (longest prompt + longest response) in the
# micro-batch, stays within ``max_tokens``. Rows are sorted by length first so similar
# lengths share a micro-batch, and each micro-batch is trimmed to its own widths, which
# keeps padding (wasted compute) small.
#
# The layout is the one ``rlhf_pipeline.schema.padding.pad_batch`` writes: prompts left-padded to
# P columns, responses right-padded to R columns, full sequences T = P + R. Keys are
# classified by name: ``(..., "full")``, ``position_ids``, ``advantage`` and the ``all_*``
# masks span T; ``(..., "prompt")`` spans P; ``(..., "response")`` spans R; the rest are
# per-row (``("token_advantage", "full")`` of a multi-turn batch spans T by its name). A row
# longer than the budget on its own becomes a micro-batch of one row.

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


# ====================================================================== packing plans
# Which sampled rows share one packed sequence of at most ``budget`` tokens; the rows of a
# micro-batch are then laid end to end in it (:func:`pack_rows`) instead of padded to a rectangle.
# The plan is first-fit decreasing (FFD) on each row's token count (prompt + response):
#
# 1. order the rows by length, longest first; equal lengths keep their row order (a stable
#    sort), so the plan is a pure function of the lengths and the budget: no RNG, and an exact
#    resume or a replay packs the same rows the same way;
# 2. put each row into the first open sequence (in the order they were opened) with room for
#    it, or open a new sequence;
# 3. a row longer than the budget on its own gets a sequence of its own (the only way a
#    sequence exceeds the budget), as the padded micro-batching does with such a row.
#
# FFD uses at most ``11/9 * OPT + 6/9`` sequences (Dósa 2007) and, on GRPO-like lengths, fills
# them to within a few percent of the ``ceil(total / budget)`` lower bound (see
# ``tests/learn/test_packing.py``). Inside a sequence, rows are listed in ascending row order.


@dataclass(frozen=True)
class PackPlan:
    """Rows of each packed sequence, and what the plan costs."""

    sequences: tuple[tuple[int, ...], ...]
    """Row indices of each packed sequence, ascending within a sequence; every row exactly once."""
    lengths: tuple[int, ...]
    """Tokens of each row (prompt + response), as planned."""
    budget: int
    """Most tokens of one sequence, except a sequence holding a single longer row."""

    @property
    def sequence_tokens(self) -> list[int]:
        """Tokens of each packed sequence."""
        return [sum(self.lengths[i] for i in rows) for rows in self.sequences]

    @property
    def oversized(self) -> list[int]:
        """Rows longer than the budget (each alone in its sequence)."""
        return [i for i, n in enumerate(self.lengths) if n > self.budget]

    @property
    def utilisation(self) -> float:
        """Tokens over the capacity of the sequences used (``len(sequences) * budget``; an
        over-long row's sequence counts its own length as capacity)."""
        capacity = sum(max(self.budget, tokens) for tokens in self.sequence_tokens)
        return sum(self.lengths) / capacity if capacity else 1.0

    @property
    def lower_bound(self) -> int:
        """No plan can use fewer sequences: the over-long rows, plus the rest's tokens over the budget."""
        fitting = sum(n for n in self.lengths if n <= self.budget)
        return len(self.oversized) + -(-fitting // self.budget)


def plan_packs(lengths: Sequence[int], budget: int) -> PackPlan:
    """First-fit-decreasing plan of rows of ``lengths`` tokens into sequences of ``budget`` tokens.

    Runs in ``O(n log n + n * s)`` for n rows and s sequences; the first-fit search keeps, per
    open sequence, its remaining room and stops at the first that fits.
    """
    if budget < 1:
        raise ValueError(f"budget must be >= 1 token (got {budget})")
    lengths = tuple(int(n) for n in lengths)
    if any(n < 0 for n in lengths):
        raise ValueError(f"row lengths must be >= 0 (got {min(lengths)})")
    # longest first; a stable sort keeps row order among equal lengths (determinism)
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rooms: list[int] = []  # remaining room of each open sequence, in opening order
    members: list[list[int]] = []
    alone: list[list[int]] = []  # over-long rows, each in its own sequence
    for i in order:
        n = lengths[i]
        if n > budget:
            alone.append([i])
            continue
        for k, room in enumerate(rooms):
            if room >= n:
                rooms[k] -= n
                members[k].append(i)
                break
        else:
            rooms.append(budget - n)
            members.append([i])
    sequences = tuple(tuple(sorted(rows)) for rows in alone + members)
    return PackPlan(sequences=sequences, lengths=lengths, budget=budget)


# ====================================================================== ragged rows, and one packed micro-batch
# The padded path (``schema/padding.py`` + :func:`split_microbatches_with_rows`) runs the model on a (B, T)
# rectangle per micro-batch and pays for every pad column. Here a micro-batch is ONE sequence
# (1, L) of its rows' real tokens, prompt then response, row after row, planned by
# :func:`plan_packs` (first-fit decreasing into ``micro_batch_tokens``):
#
#     packed:     [p0 p0 p0 r0 r0 | p1 p1 r1 r1 r1 r1 | p2 r2 ...]      input_ids     (1, L)
#     positions:  [0  1  2  3  4  | 0  1  2  3  4  5  | 0  1  ...]      position_ids  (1, L)
#     rows:        cu_seq_lens = [0, 5, 11, ...]                          int32 (n + 1,)
#
# Positions restart at 0 at each row, so rotary embeddings see what the padded forward gives a
# row (its ``cumsum(mask) - 1`` positions); the stored sampling/reference log-probs and the
# advantages are laid out response-aligned (n, R), what ``loss.grpo_packed_loss`` scatters the
# packed forward's log-probs back into. A multi-turn trajectory is one row whose response holds
# the environment's tokens between its turns (``learn/trajectories.py``): :attr:`RaggedRows.loss_mask`
# says which response tokens were sampled, and only those are scored and carry loss; with per-turn
# advantages :attr:`RaggedRows.token_advantage` gives each response token its own.
#
# Rows come in as :class:`RaggedRows` (token and log-prob values without padding), taken from
# a padded batch (:meth:`RaggedRows.from_padded`), straight from stored rows
# (:meth:`RaggedRows.from_trajectory_batch`, what ``store.read_ragged`` gives) or from joined
# trajectories (:meth:`RaggedRows.from_joined`). The learner builds its packed micro-batches on
# the prefetch thread from the last two, no padded batch in between (:class:`PackedBatch`).
# Every row needs at least one prompt token (its first response token is scored from the last
# prompt token's logits).


@dataclass(frozen=True)
class RaggedRows:
    """The fields a GRPO step reads, one entry per row, without padding."""

    prompt_tokens: RaggedTensor
    response_tokens: RaggedTensor
    response_log_probs: RaggedTensor  # the sampler's, aligned with response_tokens
    advantage: torch.Tensor  # (B,) float32
    ref_log_probs: RaggedTensor | None = None  # reference log-probs (kl_coef > 0)
    sample_weight: torch.Tensor | None = None  # (B,) prioritized sampling's importance weights
    loss_mask: RaggedTensor | None = None  # bool, aligned with response_tokens; None: every response token
    token_advantage: RaggedTensor | None = None  # float32, aligned with response_tokens; None: ``advantage``

    def __len__(self) -> int:
        return len(self.response_tokens)

    def lengths(self) -> torch.Tensor:
        """(B,) tokens of each row, prompt + response."""
        return self.prompt_tokens.lengths() + self.response_tokens.lengths()

    @classmethod
    def from_padded(cls, batch) -> RaggedRows:
        """From a ``pad_batch`` TensorDict (its prompt and response views and masks)."""
        keys = batch.keys(include_nested=True)
        if "sequence_advantage" not in keys:
            raise KeyError("the padded batch has no advantage ('sequence_advantage'); attach the group-advantage "
                           "transform to the buffer's write path so stored rows carry 'advantage'")
        response_mask = batch["masks", "response"]
        ref = ("ref_log_probs", "response")
        prompt_width = batch["tokens", "prompt"].shape[1]
        # a multi-turn batch's loss mask is 0 on the environment's tokens inside the response
        loss = batch["masks", "all_assistant_mask"][:, prompt_width:]
        loss_mask = None if torch.equal(loss, response_mask) else RaggedTensor.from_padded(loss, response_mask)
        token_advantage = (RaggedTensor.from_padded(batch[TOKEN_ADVANTAGE_KEY][:, prompt_width:], response_mask)
                           if TOKEN_ADVANTAGE_KEY in keys else None)
        return cls(
            prompt_tokens=RaggedTensor.from_padded(batch["tokens", "prompt"], batch["masks", "prompt"]),
            response_tokens=RaggedTensor.from_padded(batch["tokens", "response"], response_mask),
            response_log_probs=RaggedTensor.from_padded(batch["log_probs", "response"], response_mask),
            advantage=batch["sequence_advantage"].to(torch.float32),
            ref_log_probs=RaggedTensor.from_padded(batch[ref], response_mask) if ref in keys else None,
            sample_weight=batch["sample_weight"] if "sample_weight" in keys else None,
            loss_mask=loss_mask,
            token_advantage=token_advantage,
        )

    @classmethod
    def from_trajectory_batch(cls, batch, sample_weight: torch.Tensor | None = None) -> RaggedRows:
        """From stored rows (``store.read(positions)``), with no padded batch built at all."""
        if "advantage" not in batch:
            raise KeyError("the rows have no 'advantage'; attach the group-advantage transform to the buffer's "
                           "write path")
        return cls(
            prompt_tokens=batch["prompt_tokens"],
            response_tokens=batch["response_tokens"],
            response_log_probs=batch["response_log_probs"].to(torch.float32),
            advantage=batch["advantage"].to(torch.float32),
            ref_log_probs=batch["ref_log_probs"].to(torch.float32) if "ref_log_probs" in batch else None,
            sample_weight=sample_weight,
        )

    @classmethod
    def from_joined(cls, joined: JoinedTrajectories) -> RaggedRows:
        """From multi-turn trajectories joined into one row each (``learn/trajectories.py``): the
        loss mask on their sampled tokens, per-token advantages in ``turn`` mode."""
        rows = cls.from_trajectory_batch(joined.rows)
        return dataclasses.replace(rows, loss_mask=joined.loss_mask, token_advantage=joined.token_advantage)

    def select(self, index: torch.Tensor) -> RaggedRows:
        """Rows ``index`` (CPU int64), every column alike."""
        def rows_of(value):
            if value is None:
                return None
            return value.index(index) if isinstance(value, RaggedTensor) else value[index]

        return RaggedRows(**{f.name: rows_of(getattr(self, f.name)) for f in dataclasses.fields(self)})


@dataclass(frozen=True)
class PackedMicroBatch:
    """One packed sequence and the response-aligned tensors its loss reads (n rows, R = longest response)."""

    rows: torch.Tensor  # (n,) int64: the rows' indices in the step's batch
    input_ids: torch.Tensor  # (1, L) int64
    position_ids: torch.Tensor  # (1, L) int64, restarting at 0 at each row
    cu_seq_lens: torch.Tensor  # (n + 1,) int32 row offsets in the sequence
    max_length: int  # longest row
    logit_positions: torch.Tensor  # (N,) int64: position whose logits score each trained response token
    targets: torch.Tensor  # (N,) int64: the trained response tokens, row after row
    response_mask: torch.Tensor  # (n, R) bool: True on the response tokens that carry loss (all, single-turn)
    sampler_log_probs: torch.Tensor  # (n, R) float32, 0 off the response
    advantages: torch.Tensor  # (n,) float32, or (n, R) per token (per-turn advantages)
    ref_log_probs: torch.Tensor | None  # (n, R) float32
    sample_weight: torch.Tensor | None  # (n,)

    @property
    def num_rows(self) -> int:
        return self.rows.numel()

    @property
    def num_tokens(self) -> int:
        """L: real tokens in the sequence (the forward's size)."""
        return self.input_ids.shape[1]

    @property
    def response_tokens(self) -> int:
        return self.targets.numel()

    def to(self, device, non_blocking: bool = False) -> PackedMicroBatch:
        """Every tensor on ``device`` (``rows`` too; callers that index CPU tensors keep their own)."""
        moved = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            moved[f.name] = value.to(device, non_blocking=non_blocking) if isinstance(value, torch.Tensor) else value
        return PackedMicroBatch(**moved)

    def pin_memory(self) -> PackedMicroBatch:
        """Every tensor in page-locked memory, so a ``non_blocking`` copy to a GPU overlaps compute
        (only where CUDA is available: pinning raises on CPU-only torch builds)."""
        if not torch.cuda.is_available():
            return self
        return PackedMicroBatch(**{f.name: value.pin_memory() if isinstance(value, torch.Tensor) else value
                                   for f in dataclasses.fields(self) for value in (getattr(self, f.name),)})


def pack_rows(rows: RaggedRows, members: torch.Tensor | list[int]) -> PackedMicroBatch:
    """Rows ``members`` of ``rows`` as one packed sequence, in the order given."""
    index = torch.as_tensor(members, dtype=torch.int64).reshape(-1)
    if index.numel() == 0:
        raise ValueError("a packed micro-batch needs at least one row")
    prompt, response = rows.prompt_tokens.index(index), rows.response_tokens.index(index)
    prompt_lengths, response_lengths = prompt.lengths(), response.lengths()  # (n,)
    if int(prompt_lengths.min()) < 1:
        raise ValueError("packing needs every row to have at least one prompt token (row "
                         f"{int(index[int(prompt_lengths.argmin())])} has none): its first response token is "
                         "scored from the last prompt token")
    lengths = prompt_lengths + response_lengths  # (n,)
    offsets = lengths_to_offsets(lengths)  # (n + 1,)
    total = int(offsets[-1])
    prompt_at = gather_ranges(offsets[:-1], prompt_lengths)  # packed positions of prompt tokens
    response_at = gather_ranges(offsets[:-1] + prompt_lengths, response_lengths)  # ... of response tokens
    input_ids = torch.empty(total, dtype=torch.int64)
    input_ids[prompt_at] = prompt.values.to(torch.int64)
    input_ids[response_at] = response.values.to(torch.int64)
    position_ids = torch.arange(total) - offsets[:-1].repeat_interleave(lengths, output_size=total)

    width = int(response_lengths.max())  # R
    response_span = torch.arange(width)[None, :] < response_lengths[:, None]  # (n, R)
    targets = response.values.to(torch.int64)
    if rows.loss_mask is None:  # every response token carries loss (single-turn rows)
        response_mask, trained_at = response_span, response_at
    else:  # only sampled tokens: the environment's tokens in a trajectory's response get no logits
        trained = rows.loss_mask.index(index).values.bool()
        response_mask = torch.zeros_like(response_span).masked_scatter_(response_span, trained)
        trained_at, targets = response_at[trained], targets[trained]

    def response_layout(column: RaggedTensor) -> torch.Tensor:  # ragged -> (n, R), 0 off the response
        values = column.index(index).values.to(torch.float32)
        return torch.zeros(response_span.shape, dtype=torch.float32).masked_scatter_(response_span, values)

    return PackedMicroBatch(
        rows=index,
        input_ids=input_ids[None],
        position_ids=position_ids[None],
        cu_seq_lens=offsets.to(torch.int32),
        max_length=int(lengths.max()),
        logit_positions=trained_at - 1,
        targets=targets,
        response_mask=response_mask,
        sampler_log_probs=response_layout(rows.response_log_probs),
        advantages=(rows.advantage[index] if rows.token_advantage is None
                    else response_layout(rows.token_advantage)),
        ref_log_probs=response_layout(rows.ref_log_probs) if rows.ref_log_probs is not None else None,
        sample_weight=rows.sample_weight[index] if rows.sample_weight is not None else None,
    )


def plan_rows(rows: RaggedRows, budget: int) -> PackPlan:
    """First-fit-decreasing plan of ``rows`` into sequences of ``budget`` tokens (:func:`plan_packs`)."""
    return plan_packs(rows.lengths().tolist(), budget)


def packed_micro_batches(rows: RaggedRows, budget: int) -> list[PackedMicroBatch]:
    """``rows`` cut into packed sequences of at most ``budget`` tokens (a longer row: alone)."""
    return [pack_rows(rows, list(members)) for members in plan_rows(rows, budget).sequences]


# ====================================================================== the packed batch, made on the prefetch thread
# With packing on (the default), the learner's prefetch thread (``Prefetcher``, ``learn/learner.py``)
# turns each draw into a :class:`PackedBatch`, and no padded ``(B, T)`` batch is built anywhere on the way::
#
#     store.read_ragged(positions)     the drawn rows end to end, as stored (storage/padded_rows.py)
#       multi-turn: read_joined        each trajectory read whole, joined into one row (learn/trajectories.py)
#     -> RaggedRows                    the token columns the loss reads
#     -> plan_packs + pack_rows        the step's packed micro-batches, first-fit decreasing
#                                      into micro_batch_tokens; pinned when the device is CUDA
#     + per-row columns                what staleness, masking, charts and on_step read
#
# so the training thread moves the micro-batches to the device (``non_blocking``) and runs the
# model; planning and packing cost it nothing.
#
# The per-row columns keep the padded batch's keys and shapes (``"policy_version"``,
# ``("next", "reward")`` (B, 1), ``"group_id"``, ``"trajectory_id"``, ``"sequence_advantage"``,
# ``"response_lengths"``, ``"termination_reason"``, ...; ``schema/padding.py``), and a
# :class:`PackedBatch` answers ``batch[key]``, ``batch[key] = value``, ``key in batch``,
# ``batch.batch_size`` and ``batch.items()`` from them: the learner's row bookkeeping (stale rows,
# masked reasons, importance weights, data-parallel fillers and ``gather_rows``, batch charts,
# ``on_step`` hooks) reads a packed batch as it reads a padded one.
#
# Rows dropped after the prefetch (stale by the time their step runs, ended for a masked reason,
# a data-parallel filler's single row) go through :meth:`PackedBatch.select_rows`, which packs the
# kept rows afresh: the step trains exactly the micro-batches :func:`packed_micro_batches` would
# give for those rows, as the plan is a pure function of their lengths (exact resume and replay
# hold). Only steps that drop a row pay for that re-pack on the training thread.
#
# A ``batch_transform`` (replay's re-scoring, ``learn/rescore.py``) edits padded batches: with one,
# the prefetch thread reads the padded batch, re-scores it and packs it (:meth:`PackedBatch.from_padded`),
# still before the training thread sees it; that padded batch then serves as the columns.


# stored row fields -> the padded batch's key for them (schema/padding.py); "advantage" is the
# padded batch's "sequence_advantage", its (B, T, 1) "advantage" has no per-row twin
_ROW_KEYS = {"reward": ("next", "reward"), "done": ("next", "done"), "terminated": ("next", "terminated"),
             "truncated": ("next", "truncated"), "group_id": "group_id", "trajectory_id": "trajectory_id",
             "step": "step", "policy_version": "policy_version", "advantage": "sequence_advantage"}


def row_columns(rows: TrajectoryBatch, termination_reason: torch.Tensor | None = None) -> TensorDict:
    """The per-row columns of stored (or joined) ``rows`` under the padded batch's keys, dtypes and
    shapes: ``("next", ...)`` flags (B, 1), ids (B,), the advantage as ``"sequence_advantage"``
    float32, prompt and response lengths int64."""
    count = len(rows)
    columns: dict = {}
    for name, key in _ROW_KEYS.items():
        if name not in rows:
            continue
        dtype = torch.float32 if name == "advantage" else FIELDS_BY_NAME[name].dtype
        value = rows[name].to(dtype)
        columns[key] = value.reshape(count, 1) if isinstance(key, tuple) else value
    columns["prompt_lengths"] = rows["prompt_tokens"].lengths()
    columns["response_lengths"] = rows["response_tokens"].lengths()
    if termination_reason is not None:
        columns["termination_reason"] = termination_reason.to(torch.int32)
    return TensorDict(columns, batch_size=[count])


@dataclass
class PackedBatch:
    """A sampled batch as the packed step trains it: its rows, their columns, its micro-batches."""

    rows: RaggedRows  # the rows' tokens, log-probs and advantages, ragged (CPU)
    columns: TensorDict  # (B,) per-row columns under the padded batch's keys (CPU); or the padded batch itself
    budget: int  # micro_batch_tokens the micro-batches were planned for
    pieces: list[tuple[torch.Tensor, PackedMicroBatch]]  # (the rows' CPU indices, micro-batch), plan order
    pin: bool = False  # micro-batches are pinned (and re-packed ones will be)

    # ------------------------------------------------------------------ construction
    @classmethod
    def pack(cls, rows: RaggedRows, columns: TensorDict, budget: int, *, pin: bool = False) -> PackedBatch:
        """Plans ``rows`` first-fit decreasing into sequences of ``budget`` tokens and packs each
        (:func:`plan_packs`, :func:`pack_rows`); ``pin``: into page-locked memory (CUDA)."""
        pieces = []
        for members in plan_rows(rows, budget).sequences:
            micro = pack_rows(rows, list(members))
            pieces.append((micro.rows, micro.pin_memory() if pin else micro))
        return cls(rows, columns, budget, pieces, pin)

    @classmethod
    def from_stored(cls, stored: TrajectoryBatch, budget: int, *, termination_reason: torch.Tensor | None = None,
                    pin: bool = False) -> PackedBatch:
        """From single-turn rows as ``store.read_ragged`` gives them."""
        return cls.pack(RaggedRows.from_trajectory_batch(stored), row_columns(stored, termination_reason), budget,
                        pin=pin)

    @classmethod
    def from_joined(cls, joined: JoinedTrajectories, budget: int, *, pin: bool = False) -> PackedBatch:
        """From multi-turn trajectories joined into one row each (``read_joined``)."""
        return cls.pack(RaggedRows.from_joined(joined), row_columns(joined.rows, joined.termination_reason), budget,
                        pin=pin)

    @classmethod
    def from_padded(cls, batch: TensorDict, budget: int, *, pin: bool = False) -> PackedBatch:
        """From a padded batch (what a ``batch_transform`` edits), which stays its columns: a hook
        reading the padded batch's other entries (replay's ``on_step`` reads the re-scored KL) still can."""
        if batch.device is not None and batch.device.type != "cpu":  # packing indexes on the CPU
            batch = batch.to("cpu")
        return cls.pack(RaggedRows.from_padded(batch), batch, budget, pin=pin)

    # ------------------------------------------------------------------ what the step reads
    def counts(self) -> tuple[int, int, int]:
        """``(rows, response tokens that carry loss, attention tokens)``, as ``step.batch_counts``
        counts a padded batch of the same rows."""
        response = self.rows.response_tokens
        loss_tokens = response.values.numel() if self.rows.loss_mask is None else int(self.rows.loss_mask.values.sum())
        return len(self.rows), loss_tokens, self.rows.prompt_tokens.values.numel() + response.values.numel()

    def micro_batches(self) -> list[tuple[torch.Tensor, PackedMicroBatch]]:
        """``(CPU row indices, micro-batch)`` of each micro-batch, with the rows' importance weights
        (``"sample_weight"``, set by the learner after the draw) when there are any."""
        if "sample_weight" not in self.columns:
            return list(self.pieces)
        weights = self.columns["sample_weight"]
        return [(rows, dataclasses.replace(micro, sample_weight=weights[rows].to(micro.input_ids.device,
                                                                                  non_blocking=True)))
                for rows, micro in self.pieces]

    def select_rows(self, index: torch.Tensor) -> PackedBatch:
        """Rows ``index`` only, packed afresh (rows dropped at their step: docs/learner.md#one-step)."""
        index = index.cpu().to(torch.int64)
        return PackedBatch.pack(self.rows.select(index), self.columns[index], self.budget, pin=self.pin)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        """The micro-batches on ``device``; the rows and their columns stay on the CPU, where the
        learner's bookkeeping reads them."""
        device = torch.device(device)
        if all(micro.input_ids.device == device for _, micro in self.pieces):
            return self
        moved = [(rows, micro.to(device, non_blocking=non_blocking)) for rows, micro in self.pieces]
        return dataclasses.replace(self, pieces=moved)

    # ------------------------------------------------------------------ the per-row columns, as a padded batch's
    @property
    def batch_size(self) -> torch.Size:
        return self.columns.batch_size

    @property
    def device(self) -> torch.device | None:
        return self.columns.device

    def __len__(self) -> int:
        return self.batch_size[0]

    def __getitem__(self, key):
        return self.columns[key]

    def __setitem__(self, key, value: torch.Tensor) -> None:
        self.columns[key] = value

    def __contains__(self, key) -> bool:
        return key in self.columns.keys(include_nested=True)

    def keys(self, *args, **kwargs):
        return self.columns.keys(*args, **kwargs)

    def items(self, *args, **kwargs):
        return self.columns.items(*args, **kwargs)


# ====================================================================== stale rows
# Rows that went stale while they waited: sampled within ``learner.max_staleness`` policy
# versions of the learner, they may be older than that by the time their step runs (they wait in
# the prefetch queue while the learner publishes). Which version a draw is checked against:
# ``DrawVersions`` in ``learn/learner.py``.


def fresh_mask(batch: TensorDict, policy_version: int, max_staleness: int | None) -> np.ndarray:
    """(B,) bool: which rows of ``batch`` are within ``max_staleness`` versions of ``policy_version``."""
    if max_staleness is None:
        return np.ones(batch.batch_size[0], dtype=bool)
    return (batch["policy_version"] >= policy_version - max_staleness).numpy()


def drop_stale(batch: TensorDict, fresh: np.ndarray) -> tuple[TensorDict | None, int]:
    """``batch`` without the rows ``fresh`` rejects (None when none is left), and their count."""
    if fresh.all():
        return batch, 0
    if not fresh.any():
        return None, int(fresh.size)
    return take_rows(batch, torch.from_numpy(np.flatnonzero(fresh))), int((~fresh).sum())
