"""The packed learner's batch, made on the prefetch thread (``learner.packing``, the default).

With packing on, the learner's prefetch thread (``learn/learner.py``, ``Prefetcher``) turns each draw into a
:class:`PackedBatch`, and no padded ``(B, T)`` batch is built anywhere on the way::

    store.read_ragged(positions)     the drawn rows end to end, as stored (storage/padded_rows.py)
      multi-turn: read_joined        each trajectory read whole, joined into one row (learn/trajectories.py)
    -> RaggedRows                    the token columns the loss reads (learn/packed.py)
    -> plan_packs + pack_rows        the step's packed micro-batches, first-fit decreasing
                                     into micro_batch_tokens; pinned when the device is CUDA
    + per-row columns                what staleness, masking, charts and on_step read

so the training thread moves the micro-batches to the device (``non_blocking``) and runs the
model; planning and packing cost it nothing.

The per-row columns keep the padded batch's keys and shapes (``"policy_version"``,
``("next", "reward")`` (B, 1), ``"group_id"``, ``"trajectory_id"``, ``"sequence_advantage"``,
``"response_lengths"``, ``"termination_reason"``, ...; ``schema/padding.py``), and a
:class:`PackedBatch` answers ``batch[key]``, ``batch[key] = value``, ``key in batch``,
``batch.batch_size`` and ``batch.items()`` from them: the learner's row bookkeeping (stale rows,
masked reasons, importance weights, data-parallel fillers and ``gather_rows``, batch charts,
``on_step`` hooks) reads a packed batch as it reads a padded one.

Rows dropped after the prefetch (stale by the time their step runs, ended for a masked reason,
a data-parallel filler's single row) go through :meth:`PackedBatch.select_rows`, which packs the
kept rows afresh: the step trains exactly the micro-batches :func:`~rlhf_pipeline.learn.packed.packed_micro_batches`
would give for those rows, as the plan is a pure function of their lengths (exact resume and
replay hold). Only steps that drop a row pay for that re-pack on the training thread.

A ``batch_transform`` (replay's re-scoring, ``learn/rescore.py``) edits padded batches: with one,
the prefetch thread reads the padded batch, re-scores it and packs it (:meth:`PackedBatch.from_padded`),
still before the training thread sees it; that padded batch then serves as the columns.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from tensordict import TensorDict

from rlhf_pipeline.learn.packed import (
    PackedMicroBatch,
    RaggedRows,
    pack_rows,
    plan_rows,
)
from rlhf_pipeline.learn.trajectories import JoinedTrajectories
from rlhf_pipeline.schema import FIELDS_BY_NAME, TrajectoryBatch

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
        (``learn/packing.py``, ``learn/packed.py``); ``pin``: into page-locked memory (CUDA)."""
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
        """Rows ``index`` only, packed afresh (module docstring: dropped rows)."""
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
