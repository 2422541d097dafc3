"""What one stored row is: the field table ``FIELDS``, ``StoreSchema`` and one row, ``Trajectory``.

Token fields (ragged), row fields (one scalar) and text fields (UTF-8); each names its torchrl 0.14
key. The table every other module reads: docs/architecture.md#rows-and-the-padded-batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
from tensordict import TensorClass

from rlhf_pipeline.schema.ragged import RaggedTensor

if TYPE_CHECKING:  # batch.py imports this module
    from rlhf_pipeline.schema.batch import TrajectoryBatch

SCHEMA_VERSION = 1
TOKEN_ID_MAX = 2**31 - 1  # token ids are stored as int32
FLOAT32_MAX = 3.4028234663852886e38  # float32's largest; rewards, advantages and log-probs are float32: a larger magnitude is infinite
# A log-prob is <= 0, up to this rounding slack. Engines compute the sampled token's log-prob
# as ``logit / T - logsumexp(logits / T)`` in float32, often with the scaling or the reduction
# done by another kernel than the logit's; for a near-certain token the two round apart by a
# few ulps (measured: up to +3.8e-6 with logits near 57). 1e-4 (a probability of 1.0001) is
# far above such rounding and far below any real error (a bf16 logsumexp is off by ~0.1), and
# the value is stored as given: clamping it would change what the sampler reported.
LOG_PROB_TOLERANCE = 1e-4

FieldKind = Literal["token", "row", "text"]


@dataclass(frozen=True)
class FieldSpec:
    name: str
    kind: FieldKind
    dtype: torch.dtype  # dtype on disk and in a TrajectoryBatch
    required: bool
    torchrl_key: str | tuple[str, ...]
    doc: str
    aligned_with: Literal["prompt", "response"] | None = None  # token fields only


FIELDS: tuple[FieldSpec, ...] = (
    # ---- token fields (ragged) ---------------------------------------------------
    FieldSpec("prompt_tokens", "token", torch.int32, True, ("tokens", "prompt"),
              "prompt token ids (chat template applied)", "prompt"),
    FieldSpec("response_tokens", "token", torch.int32, True, ("tokens", "response"),
              "sampled response token ids, EOS included when generation stopped on it", "response"),
    FieldSpec("response_log_probs", "token", torch.float32, True, ("log_probs", "response"),
              "log-prob of each response token under the sampling policy, computed from the "
              "same (temperature / top-k / top-p) distribution that was sampled", "response"),
    FieldSpec("ref_log_probs", "token", torch.float32, False, ("ref_log_probs", "response"),
              "log-prob of each response token under the frozen reference model", "response"),
    FieldSpec("kl", "token", torch.float32, False, ("kl", "response"),
              "per-token KL estimate between sampling policy and reference", "response"),
    FieldSpec("token_rewards", "token", torch.float32, False, ("next", "token_reward"),
              "per-token reward: -coef * kl on every token, plus the scalar reward on the last", "response"),
    # ---- row fields --------------------------------------------------------------
    FieldSpec("group_id", "row", torch.int64, True, "group_id",
              "group key: rows of one prompt share it (GRPO groups)"),
    FieldSpec("trajectory_id", "row", torch.int64, True, "trajectory_id",
              "unique id of the trajectory this row belongs to"),
    FieldSpec("step", "row", torch.int32, True, "step",
              "turn index of this row within its trajectory (0 for single-turn)"),
    FieldSpec("reward", "row", torch.float32, True, ("next", "reward"),
              "scalar reward of this step (finite)"),
    FieldSpec("done", "row", torch.bool, True, ("next", "done"),
              "the trajectory ends at this row; equals terminated or truncated"),
    FieldSpec("terminated", "row", torch.bool, True, ("next", "terminated"),
              "ended naturally (EOS, final answer)"),
    FieldSpec("truncated", "row", torch.bool, True, ("next", "truncated"),
              "ended by a limit (max new tokens, max turns)"),
    FieldSpec("policy_version", "row", torch.int64, True, "policy_version",
              "version of the policy weights that sampled this row"),
    FieldSpec("advantage", "row", torch.float32, False, "advantage",
              "group-relative advantage, written by the group-advantage transform"),
    FieldSpec("step_advantage", "row", torch.float32, False, "step_advantage",
              "this turn's own advantage: its reward normalized within its group's turns, written beside "
              "the trajectory's advantage by GroupAdvantage(step_advantage=True) (agents)"),
    FieldSpec("termination_reason", "row", torch.int32, False, "termination_reason",
              "why the trajectory ended, a schema.TerminationReason code; 0 on rows that are not its last"),
    FieldSpec("tool_calls", "row", torch.int32, False, "tool_calls",
              "tool calls the model wrote in this turn, as the tool-call parser found them (agents)"),
    FieldSpec("tool_errors", "row", torch.int32, False, "tool_errors",
              "of this turn's tool calls, those answered with an error: malformed, unknown tool, bad "
              "arguments, raised, timed out, over the per-turn limit (agents)"),
    FieldSpec("tool_error_kinds", "row", torch.int32, False, "tool_error_kinds",
              "how this turn's tool calls failed: a schema.ToolErrorKind bit set, 0 when none failed (agents)"),
    # ---- text fields -------------------------------------------------------------
    FieldSpec("prompt_text", "text", torch.uint8, True, ("text", "prompt"), "prompt as text"),
    FieldSpec("response_text", "text", torch.uint8, True, ("text", "response"), "response as text"),
    FieldSpec("turn_messages", "text", torch.uint8, False, ("text", "turn_messages"),
              "this turn's chat messages as JSON (schema/turn_messages.py): those added before the turn, "
              "then the model's own (agents)"),
)
FIELDS_BY_NAME: dict[str, FieldSpec] = {f.name: f for f in FIELDS}
REQUIRED_FIELDS: tuple[str, ...] = tuple(f.name for f in FIELDS if f.required)
OPTIONAL_FIELDS: tuple[str, ...] = tuple(f.name for f in FIELDS if not f.required)
# the one torch -> numpy table for stored values: little-endian, as every backend writes them
NUMPY_DTYPES: dict[torch.dtype, np.dtype] = {
    torch.int32: np.dtype("<i4"),
    torch.int64: np.dtype("<i8"),
    torch.float32: np.dtype("<f4"),
    torch.bool: np.dtype("?"),
    torch.uint8: np.dtype("u1"),
}


class TrajectoryValidationError(ValueError):
    """A write was rejected; nothing of it was stored. Names the row, the field and the fix."""

    def __init__(self, message: str, *, row: int | None = None, field: str | None = None):
        where = []
        if row is not None:
            where.append(f"row {row}")
        if field is not None:
            where.append(f"field {field!r}")
        prefix = ", ".join(where)
        super().__init__(f"{prefix}: {message}" if prefix else message)
        self.row = row
        self.field = field


# ======================================================================== StoreSchema
@dataclass(frozen=True)
class StoreSchema:
    """The set of fields a store holds: every required field plus the chosen optional ones."""

    optional: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = [n for n in self.optional if n not in OPTIONAL_FIELDS]
        if unknown:
            raise ValueError(
                f"unknown optional field(s) {unknown}; choose from {list(OPTIONAL_FIELDS)}"
            )
        # canonical order, so equal schemas compare equal
        object.__setattr__(self, "optional", tuple(n for n in OPTIONAL_FIELDS if n in self.optional))

    @property
    def field_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in FIELDS if f.required or f.name in self.optional)

    @property
    def fields(self) -> tuple[FieldSpec, ...]:
        return tuple(FIELDS_BY_NAME[n] for n in self.field_names)

    @classmethod
    def for_batch(cls, batch: TrajectoryBatch) -> StoreSchema:
        return cls(tuple(n for n in batch.field_names if n in OPTIONAL_FIELDS))

    def to_json(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, "optional": list(self.optional)}

    @classmethod
    def from_json(cls, data: Mapping) -> StoreSchema:
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ValueError(
                f"buffer was written with schema version {version}; this rlhf_pipeline reads "
                f"version {SCHEMA_VERSION}. Convert it with a matching release or start a new buffer."
            )
        return cls(tuple(data.get("optional", ())))


# ======================================================================== one row
class Trajectory(TensorClass["nocast"]):
    """One stored row, for building data by hand and reading single rows back.

    Shapes: P = prompt length, R = response length.
    """

    prompt_tokens: torch.Tensor  # (P,) int
    response_tokens: torch.Tensor  # (R,) int
    response_log_probs: torch.Tensor  # (R,) float
    group_id: int
    trajectory_id: int
    reward: float
    policy_version: int
    prompt_text: str
    response_text: str
    step: int = 0
    done: bool = True
    terminated: bool = True
    truncated: bool = False
    advantage: float | None = None
    step_advantage: float | None = None
    termination_reason: int | None = None
    tool_calls: int | None = None
    tool_errors: int | None = None
    tool_error_kinds: int | None = None
    turn_messages: str | None = None
    ref_log_probs: torch.Tensor | None = None  # (R,)
    kl: torch.Tensor | None = None  # (R,)
    token_rewards: torch.Tensor | None = None  # (R,)


Column = RaggedTensor | torch.Tensor | list[str]
