"""``TrajectoryBatch``: N rows in columnar form, and ``validate_batch``, the checks every write
passes at the storage's door before anything is stored.

Why one file: ``TrajectoryBatch`` and ``validate_batch`` are the two sides of the door: the columns
a batch may hold and the checks they pass, field kind by field kind, read side by side when either
changes. Design: docs/schema.md#validation-at-the-door.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch
from tensordict import TensorDict, lazy_stack

from rlhf_pipeline.schema.fields import (
    FIELDS,
    FIELDS_BY_NAME,
    LOG_PROB_TOLERANCE,
    TOKEN_ID_MAX,
    Column,
    FieldSpec,
    StoreSchema,
    Trajectory,
    TrajectoryValidationError,
)
from rlhf_pipeline.schema.from_rows import columns_from_rows
from rlhf_pipeline.schema.ragged import RaggedTensor
from rlhf_pipeline.schema.termination import TerminationReason
from rlhf_pipeline.schema.tool_errors import ALL_TOOL_ERROR_KINDS


# ======================================================================== columnar batch


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
        numbers, ``bool`` flags, known keys only (see ``rlhf_pipeline/schema/from_rows.py``); anything else
        raises :class:`TrajectoryValidationError` naming the row and the field.
        """
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
    for name in ("reward", "advantage", "step_advantage"):
        if name in out:
            _first_bad(~torch.isfinite(out[name]), name, "must be finite", out[name])
    done, term, trunc = out["done"], out["terminated"], out["truncated"]
    _first_bad(done != (term | trunc), "done",
               "done must equal (terminated or truncated)", done)
    _first_bad(out["policy_version"] < 0, "policy_version", "must be >= 0", out["policy_version"])
    _first_bad(out["step"] < 0, "step", "must be >= 0", out["step"])
    if "termination_reason" in out:
        _check_termination_reason(out["termination_reason"], done, term, trunc)
    for name in ("tool_calls", "tool_errors"):
        if name in out:
            _first_bad(out[name] < 0, name, "must be >= 0 (a count of tool calls)", out[name])
    if "tool_calls" in out and "tool_errors" in out:
        _first_bad(out["tool_errors"] > out["tool_calls"], "tool_errors",
                   "more failed tool calls than tool calls (tool_calls) in the turn", out["tool_errors"])
    if "tool_error_kinds" in out:
        kinds = out["tool_error_kinds"]
        _first_bad((kinds < 0) | (kinds & ~ALL_TOOL_ERROR_KINDS != 0), "tool_error_kinds",
                   f"unknown bits; a schema.ToolErrorKind set is within 0..{ALL_TOOL_ERROR_KINDS}", kinds)
        if "tool_errors" in out:
            _first_bad((kinds != 0) != (out["tool_errors"] > 0), "tool_error_kinds",
                       "kinds of failure must be set exactly on turns with failed calls (tool_errors > 0)", kinds)
    return TrajectoryBatch(out)


def _check_termination_reason(reason: torch.Tensor, done: torch.Tensor, term: torch.Tensor,
                              trunc: torch.Tensor) -> None:
    """A known code; 0 (not ended) on rows that are not done; a reason that agrees with the flags."""
    codes = [int(r) for r in TerminationReason]
    known = torch.isin(reason, torch.tensor(codes, dtype=reason.dtype))
    _first_bad(~known, "termination_reason", f"unknown code; the codes are {codes}", reason)
    ended = reason != int(TerminationReason.NOT_ENDED)
    _first_bad(ended & ~done, "termination_reason", "a reason on a row that is not done; store 0 there", reason)
    terminating = torch.isin(reason, torch.tensor([int(r) for r in TerminationReason if r.terminated],
                                                  dtype=reason.dtype))
    _first_bad(ended & (terminating != term), "termination_reason",
               "the reason disagrees with terminated/truncated (TerminationReason.terminated says which)",
               reason)


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


def as_trajectory_batch(data: object) -> TrajectoryBatch:
    """``data`` as a batch: a ``TrajectoryBatch`` as it is, one ``Trajectory`` as a batch of one,
    a TensorDict with torchrl's LLM keys converted (what a torchrl ``ReplayBuffer.extend`` hands
    a store). Anything else is a ``TypeError`` naming what a store takes."""
    if isinstance(data, TrajectoryBatch):
        return data
    if isinstance(data, Trajectory):
        return TrajectoryBatch.from_rows([data])
    from tensordict import is_tensor_collection

    if is_tensor_collection(data):
        return TrajectoryBatch.from_tensordict(data)
    raise TypeError(
        f"a trajectory store takes a TrajectoryBatch or a TensorDict with torchrl LLM keys, "
        f"got {type(data).__name__}"
    )
