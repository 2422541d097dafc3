"""Rows given one by one (dicts or ``Trajectory`` objects) into the columns of a ``TrajectoryBatch``.

Converts nothing that would change a value (float32 rounding aside); whatever cannot be stored
exactly is refused naming the row, the field and the fix. Design: docs/architecture.md#rows-and-the-padded-batch.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from rlhf_pipeline.schema.ragged import RaggedTensor, lengths_to_offsets
from rlhf_pipeline.schema.fields import (
    FIELDS,
    FIELDS_BY_NAME,
    FLOAT32_MAX,
    TOKEN_ID_MAX,
    FieldSpec,
    Trajectory,
    TrajectoryValidationError,
)

_INT_RANGE = {torch.int32: (-(2**31), 2**31 - 1), torch.int64: (-(2**63), 2**63 - 1)}


def columns_from_rows(rows: Iterable[Trajectory | Mapping]) -> dict[str, Any]:
    """The columns of ``rows``, each in its field's storage dtype; raises on anything inexact."""
    rows = [_as_mapping(r, i) for i, r in enumerate(rows)]
    if not rows:
        raise TrajectoryValidationError("a batch needs at least one row")
    for i, row in enumerate(rows):
        _check_keys(row, i)
    names = [f.name for f in FIELDS if rows[0].get(f.name) is not None]
    for i, row in enumerate(rows[1:], start=1):
        if [f.name for f in FIELDS if row.get(f.name) is not None] != names:
            _explain_field_set(row, i, names)
    columns: dict[str, Any] = {}
    for name in names:
        spec = FIELDS_BY_NAME[name]
        values = [row[name] for row in rows]
        if spec.kind == "token":
            columns[name] = _token_column(spec, values)
        elif spec.kind == "row":
            columns[name] = _row_column(spec, values)
        else:
            for i, value in enumerate(values):
                if not isinstance(value, str):
                    raise TrajectoryValidationError(_not_text(value), row=i, field=name)
            columns[name] = values
    return columns


# ====================================================================== rows and keys
def _as_mapping(row: Any, i: int) -> Mapping:
    if isinstance(row, Mapping):
        return row
    if isinstance(row, Trajectory):
        return {f.name: getattr(row, f.name) for f in FIELDS}
    raise TrajectoryValidationError(
        f"expected a dict or a Trajectory, got {type(row).__name__}", row=i
    )


def _check_keys(row: Mapping, i: int) -> None:
    for key in row:
        if key in FIELDS_BY_NAME:
            continue
        if not isinstance(key, str):
            raise TrajectoryValidationError(f"keys must be field names (str), got {key!r}", row=i)
        close = difflib.get_close_matches(key, list(FIELDS_BY_NAME), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise TrajectoryValidationError(
            f"unknown field; {hint}the fields are {[f.name for f in FIELDS]}", row=i, field=key
        )


def _explain_field_set(row: Mapping, i: int, names: list[str]) -> None:
    here = {f.name for f in FIELDS if row.get(f.name) is not None}
    for name in names:
        if name not in here:
            raise TrajectoryValidationError("missing (row 0 has it, so every row must)", row=i, field=name)
    extra = next(f.name for f in FIELDS if f.name in here and f.name not in names)
    raise TrajectoryValidationError(
        "row 0 does not have this field, so no row may: every row of a batch has the same fields "
        "(give it to every row, or to none)", row=i, field=extra,
    )


# ====================================================================== token fields
def _token_column(spec: FieldSpec, values: list[Any]) -> RaggedTensor:
    integer = spec.dtype != torch.float32
    parts = [_sequence(spec, value, i, integer) for i, value in enumerate(values)]
    lengths = torch.tensor([p.numel() for p in parts], dtype=torch.int64)
    flat = torch.cat(parts) if parts else torch.zeros(0, dtype=spec.dtype)
    offsets = lengths_to_offsets(lengths)
    if integer:
        low, high = (0, TOKEN_ID_MAX) if spec.dtype == torch.int32 else _INT_RANGE[spec.dtype]
        bad = (flat < low) | (flat > high)
        if bool(bad.any()):
            pos = int(torch.nonzero(bad)[0])
            row = int(torch.searchsorted(offsets, pos, right=True)) - 1
            raise TrajectoryValidationError(
                f"token id {int(flat[pos])} is outside [0, {TOKEN_ID_MAX}] (ids are stored as int32)",
                row=row, field=spec.name,
            )
        return RaggedTensor(flat.to(spec.dtype), offsets)
    narrowed = flat.to(torch.float32)
    overflow = torch.isfinite(flat) & ~torch.isfinite(narrowed)
    if bool(overflow.any()):
        pos = int(torch.nonzero(overflow)[0])
        row = int(torch.searchsorted(offsets, pos, right=True)) - 1
        raise TrajectoryValidationError(
            f"value {float(flat[pos])!r} does not fit in float32 (largest {FLOAT32_MAX:.4g})",
            row=row, field=spec.name,
        )
    return RaggedTensor(narrowed, offsets)


def _sequence(spec: FieldSpec, value: Any, i: int, integer: bool) -> torch.Tensor:
    """One row's values as a 1-D int64 (integer fields) or float64 tensor, exactly."""
    want = "integers (token ids)" if integer else "real numbers"
    if isinstance(value, torch.Tensor):
        return _from_array(spec, value, str(value.dtype), _torch_kind(value.dtype), value.dim(), i, integer,
                           lambda: value.detach().to("cpu"))
    if isinstance(value, np.ndarray):
        return _from_array(spec, value, f"numpy {value.dtype}", value.dtype.kind, value.ndim, i, integer,
                           lambda: _numpy_to_torch(spec, value, i, integer))
    if not isinstance(value, (list, tuple)):
        raise TrajectoryValidationError(
            f"expected a sequence of {want} (list, tuple, 1-D tensor or array), got {type(value).__name__}",
            row=i, field=spec.name,
        )
    if not all(type(item) is (int if integer else float) for item in value):  # the common case, fast
        for j, item in enumerate(value):
            if not _is_number(item, integer):
                raise TrajectoryValidationError(
                    f"item {j} is {item!r} ({type(item).__name__}); expected {want}"
                    + ("; a float is never truncated to an id" if integer and isinstance(item, float) else ""),
                    row=i, field=spec.name,
                )
    try:
        return torch.tensor(value, dtype=torch.int64 if integer else torch.float64)
    except (OverflowError, RuntimeError, ValueError):  # an integer beyond int64 (or float64)
        big = next(int(v) for v in value if not -(2**63) <= int(v) < 2**63)
        what = f"token id {big} is outside [0, {TOKEN_ID_MAX}] (ids are stored as int32)" if integer else \
            f"value {_show(big)} does not fit in float32 (largest {FLOAT32_MAX:.4g})"
        raise TrajectoryValidationError(what, row=i, field=spec.name) from None


def _show(value: Any) -> str:
    """A number for a message: huge integers by their size, not by hundreds of digits."""
    if isinstance(value, int) and abs(value) >= 10**20:
        return f"{str(value)[:4]}... ({len(str(abs(value)))} digits)"
    return repr(value)


def _from_array(spec: FieldSpec, value: Any, dtype_name: str, kind: str, ndim: int, i: int, integer: bool,
                convert) -> torch.Tensor:
    if ndim != 1:
        raise TrajectoryValidationError(
            f"expected a 1-D sequence, got {ndim} dimensions; pass one row's values (flatten it yourself "
            f"if that is what you mean)", row=i, field=spec.name,
        )
    ok = kind in ("i", "u") if integer else kind in ("f", "i", "u")
    if not ok:
        want = "an integer dtype (token ids)" if integer else "a floating-point dtype"
        extra = "; floats are never truncated to ids" if integer and kind == "f" else ""
        raise TrajectoryValidationError(f"expected {want}, got {dtype_name}{extra}", row=i, field=spec.name)
    if dtype_name == "torch.uint64":  # no exact route to int64 for ids >= 2**63; none are token ids anyway
        raise TrajectoryValidationError("uint64 tensors are not accepted; pass int64 (or int32) token ids",
                                        row=i, field=spec.name)
    tensor = convert()
    return tensor.to(torch.int64 if integer else torch.float64)


def _numpy_to_torch(spec: FieldSpec, value: np.ndarray, i: int, integer: bool) -> torch.Tensor:
    if value.dtype.kind == "u" and value.dtype.itemsize == 8 and value.size and int(value.max()) > 2**63 - 1:
        raise TrajectoryValidationError(
            f"token id {int(value.max())} is outside [0, {TOKEN_ID_MAX}] (ids are stored as int32)",
            row=i, field=spec.name,
        )
    wide = value.astype(np.int64 if integer else np.float64)  # exact: range checked above / float64 holds all
    return torch.from_numpy(np.ascontiguousarray(wide))


def _torch_kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "b"
    if dtype.is_complex:
        return "c"
    if dtype.is_floating_point:
        return "f"
    return "u" if dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64) else "i"


def _is_number(item: Any, integer: bool) -> bool:
    if isinstance(item, (bool, np.bool_)):
        return False
    if integer:
        return isinstance(item, (int, np.integer))
    return isinstance(item, (int, float, np.integer, np.floating))


# ====================================================================== row fields
def _row_column(spec: FieldSpec, values: list[Any]) -> torch.Tensor:
    if spec.dtype == torch.bool:
        out = []
        for i, value in enumerate(values):
            value = _one_element(spec, value, i, "b")
            if not isinstance(value, (bool, np.bool_)):
                raise TrajectoryValidationError(
                    f"expected True or False, got {value!r} ({type(value).__name__})", row=i, field=spec.name
                )
            out.append(bool(value))
        return torch.tensor(out, dtype=torch.bool)
    if spec.dtype == torch.float32:
        out = []
        for i, value in enumerate(values):
            value = _one_element(spec, value, i, "f")
            if not _is_number(value, integer=False):
                raise TrajectoryValidationError(
                    f"expected a real number, got {value!r} ({type(value).__name__})"
                    + ("; numbers are not parsed from text" if isinstance(value, str) else ""),
                    row=i, field=spec.name,
                )
            try:
                number = float(value)
                overflow = math.isfinite(number) and abs(number) > FLOAT32_MAX
            except OverflowError:  # an int beyond even float64
                overflow = True
            if overflow:
                raise TrajectoryValidationError(
                    f"value {_show(value)} does not fit in float32 (largest {FLOAT32_MAX:.4g})",
                    row=i, field=spec.name,
                )
            out.append(number)
        return torch.tensor(out, dtype=torch.float32)
    low, high = _INT_RANGE[spec.dtype]
    out = []
    for i, value in enumerate(values):
        value = _one_element(spec, value, i, "i")
        if not _is_number(value, integer=True):
            raise TrajectoryValidationError(
                f"expected an integer, got {value!r} ({type(value).__name__})"
                + ("; a float is never truncated" if isinstance(value, float) else ""),
                row=i, field=spec.name,
            )
        if not low <= int(value) <= high:
            raise TrajectoryValidationError(
                f"{int(value)} does not fit in {str(spec.dtype).removeprefix('torch.')} [{low}, {high}]",
                row=i, field=spec.name,
            )
        out.append(int(value))
    return torch.tensor(out, dtype=spec.dtype)


def _one_element(spec: FieldSpec, value: Any, i: int, kind: str) -> Any:
    """A Python scalar from a scalar, or from a tensor/array holding exactly one value of the right kind."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        array_kind = _torch_kind(value.dtype) if isinstance(value, torch.Tensor) else value.dtype.kind
        size = value.numel() if isinstance(value, torch.Tensor) else value.size
        if size != 1:
            raise TrajectoryValidationError(
                f"expected one value, got a {type(value).__name__} of shape {tuple(value.shape)}",
                row=i, field=spec.name,
            )
        allowed = {"b": ("b",), "f": ("f", "i", "u"), "i": ("i", "u")}[kind]
        if array_kind not in allowed:
            raise TrajectoryValidationError(
                f"expected {'a bool' if kind == 'b' else 'an integer' if kind == 'i' else 'a real number'}, "
                f"got a {type(value).__name__} of dtype {value.dtype}", row=i, field=spec.name,
            )
        return value.reshape(-1)[0].item()
    return value


def _not_text(value: Any) -> str:
    if isinstance(value, (bytes, bytearray)):
        return (f"expected str, got {type(value).__name__} {bytes(value)[:20]!r}; decode it yourself "
                f"(e.g. value.decode('utf-8')): bytes are never stored as their repr")
    return f"expected str, got {type(value).__name__} {value!r:.40}; numbers and objects are not turned into text"
