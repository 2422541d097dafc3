"""What one stored row is, and the checks every write passes before anything is stored.

A row is one completed step of a trajectory. Single-turn GRPO stores one row per
completion (``done`` is True); a multi-turn trajectory stores several rows with the
same ``trajectory_id`` and increasing ``step``, the last one done.

Fields come in three kinds:

* token fields: ragged, one value per token, aligned with the prompt or the response;
* row fields: one scalar per row;
* text fields: one UTF-8 string per row (stored as bytes + offsets, never pickled).

``FIELDS`` is the single table every other module reads (storage layout, validation,
padding, README). Each field also names its torchrl 0.14 key, so a batch converts to
the ``("tokens", "response")`` / ``("next", "reward")`` conventions torchrl's LLM
transforms and losses read.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from tensordict import TensorClass, TensorDict, lazy_stack

from rlhf_pipeline.ragged import RaggedTensor

SCHEMA_VERSION = 1
TOKEN_ID_MAX = 2**31 - 1  # token ids are stored as int32
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
    # ---- text fields -------------------------------------------------------------
    FieldSpec("prompt_text", "text", torch.uint8, True, ("text", "prompt"), "prompt as text"),
    FieldSpec("response_text", "text", torch.uint8, True, ("text", "response"), "response as text"),
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
    ref_log_probs: torch.Tensor | None = None  # (R,)
    kl: torch.Tensor | None = None  # (R,)
    token_rewards: torch.Tensor | None = None  # (R,)


# ======================================================================== columnar batch
Column = RaggedTensor | torch.Tensor | list[str]


class TrajectoryBatch:
    """N rows in columnar form: what collectors write, transforms edit and storages return.

    Token fields are ``RaggedTensor`` (flat values + offsets), row fields are (N,)
    tensors, text fields are lists of N strings. Construction does no checking;
    :func:`validate_batch` does, at the storage's door.
    """

    __slots__ = ("_columns", "_num_rows")

    def __init__(self, columns: Mapping[str, Column]):
        unknown = [k for k in columns if k not in FIELDS_BY_NAME]
        if unknown:
            raise TrajectoryValidationError(
                f"unknown field(s) {unknown}; known fields are {[f.name for f in FIELDS]}", field=str(unknown[0])
            )
        self._columns: dict[str, Column] = dict(columns)
        self._num_rows = _count_rows(self._columns)

    # ---------------------------------------------------------------- basic access
    def __len__(self) -> int:
        return self._num_rows

    @property
    def field_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in FIELDS if f.name in self._columns)

    def __contains__(self, name: str) -> bool:
        return name in self._columns

    def __getitem__(self, name: str) -> Column:
        try:
            return self._columns[name]
        except KeyError:
            raise KeyError(f"batch has no field {name!r}; it has {list(self.field_names)}") from None

    def get(self, name: str, default=None):
        return self._columns.get(name, default)

    def __getattr__(self, name: str):
        if name in FIELDS_BY_NAME:
            return self[name]
        raise AttributeError(name)

    @property
    def columns(self) -> dict[str, Column]:
        return dict(self._columns)

    def __repr__(self) -> str:
        return f"TrajectoryBatch(rows={len(self)}, fields={list(self.field_names)})"

    # ---------------------------------------------------------------- derivation
    def with_columns(self, **columns: Column) -> TrajectoryBatch:
        """A new batch sharing this one's columns, with ``columns`` added or replaced."""
        merged = dict(self._columns)
        merged.update(columns)
        return TrajectoryBatch(merged)

    def without(self, *names: str) -> TrajectoryBatch:
        return TrajectoryBatch({k: v for k, v in self._columns.items() if k not in names})

    def clone(self, recurse: bool = False) -> TrajectoryBatch:
        """Shallow copy (``recurse=False``) as torchrl's ``Transform.inv`` expects, or deep."""
        if not recurse:
            return TrajectoryBatch(self._columns)
        out: dict[str, Column] = {}
        for name, col in self._columns.items():
            if isinstance(col, RaggedTensor):
                out[name] = RaggedTensor(col.values.clone(), col.offsets.clone())
            elif isinstance(col, torch.Tensor):
                out[name] = col.clone()
            else:
                out[name] = list(col)
        return TrajectoryBatch(out)

    def select(self, idx: torch.Tensor | Sequence[int] | slice) -> TrajectoryBatch:
        """Rows ``idx`` (any order, repeats allowed), vectorized for tensor columns."""
        if isinstance(idx, slice):
            idx = torch.arange(len(self))[idx]
        idx = torch.as_tensor(idx, dtype=torch.int64).reshape(-1)
        out: dict[str, Column] = {}
        positions = idx.tolist() if any(isinstance(c, list) for c in self._columns.values()) else None
        for name, col in self._columns.items():
            if isinstance(col, RaggedTensor):
                out[name] = col.index(idx)
            elif isinstance(col, torch.Tensor):
                out[name] = col[idx]
            else:
                out[name] = [col[i] for i in positions]
        return TrajectoryBatch(out)

    @classmethod
    def cat(cls, batches: Sequence[TrajectoryBatch]) -> TrajectoryBatch:
        if not batches:
            raise ValueError("TrajectoryBatch.cat needs at least one batch")
        names = batches[0].field_names
        for b in batches[1:]:
            if b.field_names != names:
                raise TrajectoryValidationError(
                    f"cannot concatenate batches with different fields: {names} vs {b.field_names}"
                )
        out: dict[str, Column] = {}
        for name in names:
            cols = [b[name] for b in batches]
            if isinstance(cols[0], RaggedTensor):
                out[name] = RaggedTensor.cat(cols)
            elif isinstance(cols[0], torch.Tensor):
                out[name] = torch.cat(cols)
            else:
                out[name] = [s for c in cols for s in c]
        return cls(out)

    def equal(self, other: TrajectoryBatch) -> bool:
        if self.field_names != other.field_names or len(self) != len(other):
            return False
        for name in self.field_names:
            a, b = self[name], other[name]
            if isinstance(a, RaggedTensor):
                if not (isinstance(b, RaggedTensor) and a.dtype == b.dtype and a.equal(b)):
                    return False
            elif isinstance(a, torch.Tensor):
                if not (isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)):
                    return False
            elif list(a) != list(b):
                return False
        return True

    # ---------------------------------------------------------------- rows
    @classmethod
    def from_rows(cls, rows: Iterable[Trajectory | Mapping]) -> TrajectoryBatch:
        """Builds a batch from ``Trajectory`` objects or plain dicts (not a hot path).

        Converts nothing that would change a value: ``str`` text, integer token ids, real
        numbers, ``bool`` flags, known keys only (see ``rlhf_pipeline/rows.py``); anything else
        raises :class:`TrajectoryValidationError` naming the row and the field.
        """
        from rlhf_pipeline.rows import columns_from_rows

        return cls(columns_from_rows(rows))

    def row(self, i: int) -> Trajectory:
        values = {}
        for name, col in self._columns.items():
            if isinstance(col, RaggedTensor):
                values[name] = col.row(i)
            elif isinstance(col, torch.Tensor):
                values[name] = col[i].item()
            else:
                values[name] = col[i]
        return Trajectory(**values)

    # ---------------------------------------------------------------- torchrl interop
    def to_tensordict(self):
        """A lazy stack of per-row TensorDicts under torchrl's LLM keys (ragged dims allowed)."""
        tds = []
        for i in range(len(self)):
            td = TensorDict()
            for name, col in self._columns.items():
                key = FIELDS_BY_NAME[name].torchrl_key
                if isinstance(col, RaggedTensor):
                    td.set(key, col.row(i))
                elif isinstance(col, torch.Tensor):
                    td.set(key, col[i].reshape(1))
                else:
                    td.set_non_tensor(key, col[i])
            tds.append(td)
        return lazy_stack(tds)

    @classmethod
    def from_tensordict(cls, td) -> TrajectoryBatch:
        """Reads a (lazy-stacked) TensorDict that uses torchrl's LLM keys, as ``to_tensordict`` writes.

        A 0-dim TensorDict is one row (what torchrl's ``rb.add`` passes)."""
        if td.batch_dims == 0:
            td = td.unsqueeze(0)
        rows = []
        for i in range(td.batch_size[0]):
            sub = td[i]
            row = {}
            for spec in FIELDS:
                if spec.torchrl_key not in sub.keys(include_nested=True):
                    continue
                value = sub.get(spec.torchrl_key)
                if spec.kind == "text":
                    row[spec.name] = value if isinstance(value, str) else value.data
                elif spec.kind == "row":
                    row[spec.name] = value.reshape(-1)[0]
                else:
                    row[spec.name] = value
            rows.append(row)
        return cls.from_rows(rows)


def _count_rows(columns: Mapping[str, Column]) -> int:
    counts = {}
    for name, col in columns.items():
        try:
            counts[name] = len(col)
        except TypeError:
            raise TrajectoryValidationError(
                f"expected a column (RaggedTensor, 1-D tensor or list of str), got {type(col).__name__}",
                field=name,
            ) from None
    distinct = set(counts.values())
    if len(distinct) > 1:
        usual = max(distinct, key=list(counts.values()).count)  # the count most fields agree on
        odd = next(name for name, count in counts.items() if count != usual)
        raise TrajectoryValidationError(
            f"columns disagree on the number of rows: {counts}; every field needs one entry per row",
            field=odd,
        )
    return distinct.pop() if distinct else 0


# ======================================================================== validation
_INTEGER_DTYPES = {torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8}
_FLOAT_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64}


def validate_batch(batch: TrajectoryBatch, schema: StoreSchema) -> TrajectoryBatch:
    """Checks a write against ``schema`` and returns it with every column in its storage dtype.

    Raises :class:`TrajectoryValidationError` naming the first bad row and field; the
    caller stores nothing of a batch that fails.
    """
    if not isinstance(batch, TrajectoryBatch):
        raise TrajectoryValidationError(
            f"expected a TrajectoryBatch, got {type(batch).__name__}; build one with "
            "TrajectoryBatch(columns) or TrajectoryBatch.from_rows(rows)"
        )
    n = len(batch)
    if n == 0:
        raise TrajectoryValidationError("empty write: a batch needs at least one row")
    present, expected = set(batch.field_names), set(schema.field_names)
    missing = sorted(expected - present, key=schema.field_names.index)
    if missing:
        raise TrajectoryValidationError(
            f"missing field(s) {missing}; this buffer stores {list(schema.field_names)}",
            field=missing[0],
        )
    extra = sorted(present - expected)
    if extra:
        raise TrajectoryValidationError(
            f"field(s) {extra} are not stored by this buffer (its optional fields are "
            f"{list(schema.optional)}); drop them or create the buffer with them",
            field=extra[0],
        )

    out: dict[str, Column] = {}
    for spec in schema.fields:
        out[spec.name] = _check_column(spec, batch[spec.name], n)

    prompt_len = out["prompt_tokens"].lengths()
    response_len = out["response_tokens"].lengths()
    _first_bad(prompt_len == 0, "prompt_tokens", "empty prompt; every row needs at least one prompt token")
    _first_bad(response_len == 0, "response_tokens", "empty response; every row needs at least one response token")
    for spec in schema.fields:
        if spec.kind != "token" or spec.name in ("prompt_tokens", "response_tokens"):
            continue
        expected_len = prompt_len if spec.aligned_with == "prompt" else response_len
        got = out[spec.name].lengths()
        bad = torch.nonzero(got != expected_len)
        if bad.numel():
            i = int(bad[0])
            raise TrajectoryValidationError(
                f"expected {int(expected_len[i])} values (one per {spec.aligned_with} token), got {int(got[i])}",
                row=i, field=spec.name,
            )
    # Whole-column reductions first (one pass, no temporaries); the row of the first bad
    # value is located only when a check fails, so valid writes stay cheap.
    for name in ("prompt_tokens", "response_tokens"):
        values = out[name].values
        if values.numel() and int(values.min()) < 0:  # int32 storage bounds the top already
            _first_bad_token(out[name], values < 0, name, f"token id {{}} is outside [0, {TOKEN_ID_MAX}]")
    for spec in schema.fields:
        if spec.kind != "token" or spec.dtype != torch.float32:
            continue
        ragged = out[spec.name]
        if not ragged.values.numel():
            continue
        is_log_prob = spec.name in ("response_log_probs", "ref_log_probs")
        upper = LOG_PROB_TOLERANCE if is_log_prob else math.inf
        low, high = torch.aminmax(ragged.values)
        # NaN fails every comparison below, so it is caught too (+inf by the second: upper may be inf)
        if not (float(low) > -math.inf and float(high) < math.inf and float(high) <= upper):
            bad = ~torch.isfinite(ragged.values) | (ragged.values > upper)
            what = ("log-prob {} is not a finite value <= 0 (rounding up to +1e-4 is accepted); "
                    "store log-probs of the sampled distribution" if is_log_prob else "value {} is not finite")
            _first_bad_token(ragged, bad, spec.name, what)
    for name in ("reward", "advantage"):
        if name in out:
            _first_bad(~torch.isfinite(out[name]), name, "must be finite", out[name])
    done, term, trunc = out["done"], out["terminated"], out["truncated"]
    _first_bad(done != (term | trunc), "done",
               "done must equal (terminated or truncated)", done)
    _first_bad(out["policy_version"] < 0, "policy_version", "must be >= 0", out["policy_version"])
    _first_bad(out["step"] < 0, "step", "must be >= 0", out["step"])
    return TrajectoryBatch(out)


def _first_bad_token(ragged: RaggedTensor, mask: torch.Tensor, field: str, message: str) -> None:
    pos = int(torch.nonzero(mask)[0])
    row = int(torch.searchsorted(ragged.offsets, pos, right=True)) - 1
    raise TrajectoryValidationError(message.format(ragged.values[pos].item()), row=row, field=field)


def _first_bad(mask: torch.Tensor, field: str, message: str, values: torch.Tensor | None = None) -> None:
    bad = torch.nonzero(mask)
    if bad.numel():
        i = int(bad[0])
        got = f" (got {values[i].item()})" if values is not None else ""
        raise TrajectoryValidationError(message + got, row=i, field=field)


def _check_column(spec: FieldSpec, col: Column, n: int) -> Column:
    if spec.kind == "text":
        if not isinstance(col, (list, tuple)):
            raise TrajectoryValidationError(
                f"expected a list of {n} strings, got {type(col).__name__}", field=spec.name
            )
        for i, s in enumerate(col):
            if not isinstance(s, str):
                raise TrajectoryValidationError(
                    f"expected str, got {type(s).__name__}; decode bytes and format numbers yourself, "
                    f"nothing is turned into text here", row=i, field=spec.name,
                )
        _check_utf8(col, spec.name)
        return list(col)
    if spec.kind == "token":
        if not isinstance(col, RaggedTensor):
            raise TrajectoryValidationError(
                f"expected a RaggedTensor (flat values + offsets), got {type(col).__name__}", field=spec.name
            )
        offsets = col.offsets
        if int(offsets[0]) != 0 or int(offsets[-1]) != col.values.numel() or bool((offsets[1:] < offsets[:-1]).any()):
            raise TrajectoryValidationError(
                "offsets must start at 0, never decrease and end at len(values)", field=spec.name
            )
        return RaggedTensor(_cast(spec, col.values, offsets), offsets)
    if not isinstance(col, torch.Tensor) or col.dim() != 1:
        shape = tuple(col.shape) if isinstance(col, torch.Tensor) else type(col).__name__
        raise TrajectoryValidationError(f"expected a 1-D tensor of {n} values, got {shape}", field=spec.name)
    return _cast(spec, col)


def _check_utf8(texts: Sequence[str], field: str) -> None:
    """Every text must encode to UTF-8 (no lone surrogates, e.g. from ``errors="surrogateescape"``)."""
    try:
        "".join(texts).encode("utf-8")  # one pass over all rows; a surrogate never pairs across rows
        return
    except UnicodeEncodeError:
        pass
    for i, text in enumerate(texts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise TrajectoryValidationError(
                f"character {exc.start} is {text[exc.start]!r}, a lone surrogate, which UTF-8 cannot store; "
                f"decode the text with errors='replace' (or fix its source)", row=i, field=field,
            ) from None


def _row_of(pos: int, offsets: torch.Tensor | None) -> int:
    """The row of flat position ``pos``: itself for a row field, located by ``offsets`` for a token field."""
    return pos if offsets is None else int(torch.searchsorted(offsets, pos, right=True)) - 1


def _cast(spec: FieldSpec, tensor: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """``tensor`` in ``spec.dtype``, refused when that would change a value (beyond float rounding)."""
    if spec.dtype in (torch.int32, torch.int64):
        if tensor.dtype not in _INTEGER_DTYPES:
            raise TrajectoryValidationError(
                f"expected integer values (int8/16/32/64 or uint8), got dtype {tensor.dtype}"
                + ("; floats are never truncated" if tensor.dtype.is_floating_point else ""), field=spec.name
            )
        if spec.dtype == torch.int32 and tensor.dtype == torch.int64 and tensor.numel():
            low, high = torch.aminmax(tensor)  # one pass; the row is located only on failure
            if int(low) < -(2**31) or int(high) > TOKEN_ID_MAX:
                pos = int(torch.nonzero((tensor < -(2**31)) | (tensor > TOKEN_ID_MAX))[0])
                what = (f"token id {int(tensor[pos])} is outside [0, {TOKEN_ID_MAX}] (ids are stored as int32)"
                        if spec.kind == "token" else f"value {int(tensor[pos])} does not fit in int32")
                raise TrajectoryValidationError(what, row=_row_of(pos, offsets), field=spec.name)
    elif spec.dtype == torch.float32:
        if tensor.dtype not in _FLOAT_DTYPES:
            raise TrajectoryValidationError(f"expected floating-point values, got dtype {tensor.dtype}", field=spec.name)
        if tensor.dtype == torch.float64 and tensor.numel():
            narrowed = tensor.detach().to("cpu", torch.float32).contiguous()
            overflow = torch.isinf(narrowed) & torch.isfinite(tensor.detach().cpu())
            if bool(overflow.any()):
                pos = int(torch.nonzero(overflow)[0])
                raise TrajectoryValidationError(
                    f"value {float(tensor[pos])!r} does not fit in float32", row=_row_of(pos, offsets), field=spec.name
                )
            return narrowed
    elif spec.dtype == torch.bool:
        if tensor.dtype != torch.bool:
            raise TrajectoryValidationError(f"expected a bool tensor, got dtype {tensor.dtype}", field=spec.name)
    return tensor.detach().to("cpu", spec.dtype).contiguous()
