"""Row fields that hold one value across a whole unit, kept in the commit record's ``unit_constants``.

Rank 0 of a data-parallel learner reads ``done``, ``step`` and ``policy_version`` of rows it draws, which
fetched and decoded each row's whole unit; within a unit these are usually one value (a round is sampled
by one policy version, single-turn rows are all ``done`` at ``step`` 0). The writer records them per unit
when it publishes it, and a read of only such fields is answered from the record, with no request and no
decode. An entry is keyed by its unit's whole identity ``[first_row, rows, kind]``: units are immutable,
so it stays true for as long as a unit of that identity is listed.
Design: docs/zarr-layout.md#the-commit-record, docs/scaling.md#rank-0s-whole-draw-reads-from-the-records."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from rlhf_pipeline.storage.errors import StoreCorruptedError
from rlhf_pipeline.storage.zarr.units import UnitRef

if TYPE_CHECKING:  # imported where used: ``inspect --verify`` and ``repair`` check records without torch
    from rlhf_pipeline.storage.zarr.unit_cache import DecodedUnit

RECORD_KEY = "unit_constants"
#: the fields a writer records when they are constant in a unit: those read for whole draws
CONSTANT_FIELDS = ("policy_version", "done", "step")
_BOOL_FIELDS = frozenset({"done", "terminated", "truncated"})

UnitKey = tuple[int, int, int]
Constants = dict[UnitKey, dict[str, int | bool]]


def unit_key(unit: UnitRef) -> UnitKey:
    return (unit.first_row, unit.rows, unit.kind)


def constants_of(arrays: dict[str, np.ndarray]) -> dict[str, int | bool]:
    """The fields of :data:`CONSTANT_FIELDS` that hold one value in a unit's ``arrays``."""
    out: dict[str, int | bool] = {}
    for name in CONSTANT_FIELDS:
        values = arrays.get(name)
        if values is None or values.size == 0:
            continue
        first = values[0]
        if bool((values == first).all()):
            out[name] = bool(first) if values.dtype == np.bool_ else int(first)
    return out


def record_entry(units: list[UnitRef], constants: Constants) -> dict[str, Any]:
    """The record's ``unit_constants`` for ``units``: entries of units no longer listed are dropped."""
    listed = []
    for unit in units:
        known = constants.get(unit_key(unit))
        if known:
            listed.append([unit.first_row, unit.rows, unit.kind, *(known.get(f) for f in CONSTANT_FIELDS)])
    return {"fields": list(CONSTANT_FIELDS), "units": listed}


def parse_constants(record: dict[str, Any], location: str) -> Constants:
    """The record's ``unit_constants`` by unit; empty when the record has none."""
    entry = record.get(RECORD_KEY)
    if entry is None:
        return {}
    try:
        fields = [str(name) for name in entry["fields"]]
        out: Constants = {}
        for item in entry["units"]:
            first_row, rows, kind, *values = item
            if len(values) != len(fields):
                raise ValueError(f"entry {item!r} has {len(values)} values for the fields {fields}")
            out[(int(first_row), int(rows), int(kind))] = {
                name: _checked_value(name, value) for name, value in zip(fields, values) if value is not None}
        return out
    except (KeyError, TypeError, ValueError) as exc:
        raise StoreCorruptedError(
            f"{location}/zarr.json: its '{RECORD_KEY}' is malformed ({exc}); the rows are intact: "
            f"`rlhf-pipeline repair {location} --apply` rewrites the record without them") from None


def _checked_value(name: str, value: Any) -> int | bool:
    if name in _BOOL_FIELDS:
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be true or false, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    return value


def disagreements(unit: UnitRef, constants: Constants, arrays: dict[str, np.ndarray]) -> list[str]:
    """What the record says of ``unit`` that its decoded ``arrays`` contradict, one line per field."""
    out = []
    for name, said in constants.get(unit_key(unit), {}).items():
        values = arrays.get(name)
        if values is not None and not bool((values == said).all()):
            held = sorted({v.item() for v in np.unique(values)})
            out.append(f"its '{RECORD_KEY}' say every row of unit {unit.name} has {name} = {said!r}, its rows hold "
                       f"{held[:5]}{'...' if len(held) > 5 else ''}")
    return out


def answerable(names: tuple[str, ...]) -> bool:
    """True when a record may know every field of ``names`` (all are :data:`CONSTANT_FIELDS`)."""
    return bool(names) and all(name in CONSTANT_FIELDS for name in names)


def unit_from_record(unit: UnitRef, constants: Constants, names: tuple[str, ...]) -> DecodedUnit | None:
    """A one-row stand-in for ``unit`` holding ``names`` as the record knows them (read its row 0
    for any of the unit's rows); None unless the record knows every one of them."""
    known = constants.get(unit_key(unit))
    if not known or any(name not in known for name in names):
        return None
    from rlhf_pipeline.schema import FIELDS_BY_NAME, NUMPY_DTYPES
    from rlhf_pipeline.storage.zarr.unit_cache import DecodedUnit

    return DecodedUnit(unit.first_row, 1, {
        name: np.array([known[name]], dtype=NUMPY_DTYPES[FIELDS_BY_NAME[name].dtype]) for name in names})
