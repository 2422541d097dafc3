"""The door under fuzzing: whatever rows or columns arrive, a write is either stored exactly as
given or refused with an error that names a field, and a refused write leaves every byte of the
store as it was. Both backends, real stores.

"Exactly as given" allows one change, the documented one: real numbers are rounded to float32,
the storage dtype of log-probs, rewards and advantages. An integer field never takes a float or
a bool, a text field only a ``str``, a flag only a ``bool``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlhf_pipeline.schema.ragged import RaggedTensor
from rlhf_pipeline.schema import (
    FIELDS_BY_NAME,
    LOG_PROB_TOLERANCE,
    TOKEN_ID_MAX,
    StoreSchema,
    TrajectoryBatch,
    TrajectoryValidationError,
)
from rlhf_pipeline.storage import create_store

SCHEMA = StoreSchema(optional=("advantage", "kl"))
FUZZ = settings(max_examples=40, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
INT64 = (-(2**63), 2**63 - 1)
F32 = dict(width=32, allow_nan=False, allow_infinity=False)
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=8)
# a row's error may name a field whose check depends on the one changed (lengths, done)
RELATED = {"response_tokens": {"response_tokens", "response_log_probs", "kl"},
           "terminated": {"terminated", "done"}, "truncated": {"truncated", "done"}}


# ====================================================================== stores
@pytest.fixture(scope="module", params=["memmap", "zarr"])
def store(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"door-{request.param}") / "buffer"
    with create_store(path, request.param, schema=SCHEMA, segment_rows=8, durable=False) as opened:
        yield opened


def fingerprint(store) -> dict[str, str]:
    """Every file under the store, by relative path, with the hash of its bytes."""
    getattr(store, "flush", lambda: None)()  # background work of earlier appends (Zarr seals) is not under test
    root = Path(store.location.removeprefix("file://"))
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def write_or_refuse(store, make_batch, *, must_refuse: bool, may_name: set[str]):
    """Builds and appends; returns the stored batch, or None when the write was refused properly.

    A refusal must be a TrajectoryValidationError naming one of ``may_name`` and leave the
    store's files byte-identical; any other exception fails the test.
    """
    before, rows_before = fingerprint(store), len(store)
    try:
        batch = make_batch()
        positions = store.append(batch)
    except TrajectoryValidationError as error:
        assert error.field is not None, f"the error names no field: {error}"
        assert f"field {error.field!r}" in str(error)
        assert error.field in may_name, (error.field, may_name, str(error))
        assert len(store) == rows_before
        assert fingerprint(store) == before, "a refused write changed the store's files"
        return None
    assert not must_refuse, f"a bad write of {may_name} was stored"
    return store.read(positions)


# ====================================================================== rows
@st.composite
def valid_rows(draw):
    rows = []
    for _ in range(draw(st.integers(1, 3))):
        prompt, response = draw(st.integers(1, 5)), draw(st.integers(1, 5))
        terminated, truncated = draw(st.booleans()), draw(st.booleans())
        rows.append({
            "prompt_tokens": draw(st.lists(st.integers(0, TOKEN_ID_MAX), min_size=prompt, max_size=prompt)),
            "response_tokens": draw(st.lists(st.integers(0, TOKEN_ID_MAX), min_size=response, max_size=response)),
            "response_log_probs": draw(st.lists(st.floats(max_value=float(np.float32(LOG_PROB_TOLERANCE)), **F32),
                                                min_size=response, max_size=response)),
            "kl": draw(st.lists(st.floats(**F32), min_size=response, max_size=response)),
            "group_id": draw(st.integers(*INT64)),
            "trajectory_id": draw(st.integers(*INT64)),
            "step": draw(st.integers(0, 2**31 - 1)),
            "reward": draw(st.floats(**F32)),
            "advantage": draw(st.floats(**F32)),
            "done": terminated or truncated,
            "terminated": terminated,
            "truncated": truncated,
            "policy_version": draw(st.integers(0, INT64[1])),
            "prompt_text": draw(TEXT),
            "response_text": draw(TEXT),
        })
    return rows


NOT_AN_ID = st.one_of(st.floats(), st.booleans(), st.integers(TOKEN_ID_MAX + 1, 2**80),
                      st.integers(-(2**80), -1), st.text(max_size=2), st.none(), st.just([1]))
NOT_A_NUMBER = st.one_of(st.text(max_size=4), st.booleans(), st.just([1.0]), st.just(float("nan")),
                         st.just(float("inf")), st.floats(min_value=3.5e38, max_value=1e300), st.just(10**400))
BAD_TEXT = st.one_of(st.binary(max_size=4), st.integers(), st.floats(), st.booleans(),
                     TEXT.map(lambda s: s + "\udc80"))


@st.composite
def one_bad_value(draw, rows):
    """Puts one invalid value into one row; returns the fields an error may name."""
    i = draw(st.integers(0, len(rows) - 1))
    row = rows[i]
    field = draw(st.sampled_from(sorted(set(FIELDS_BY_NAME) - {"ref_log_probs", "token_rewards"}) + ["?unknown"]))
    if field == "?unknown":
        key = draw(st.text(min_size=1, max_size=6).filter(lambda k: k not in FIELDS_BY_NAME))
        row[key] = 1
        return {key}
    spec = FIELDS_BY_NAME[field]
    if spec.kind == "text":
        row[field] = draw(BAD_TEXT)
    elif field in ("prompt_tokens", "response_tokens"):
        how = draw(st.sampled_from(["item", "float tensor", "2-d", "not a list"] + (["empty"] if field == "prompt_tokens" else [])))
        values = row[field]
        if how == "item":
            values[draw(st.integers(0, len(values) - 1))] = draw(NOT_AN_ID)
        elif how == "float tensor":
            row[field] = torch.tensor(values, dtype=torch.float64)
        elif how == "2-d":
            row[field] = torch.tensor([values])
        elif how == "not a list":
            row[field] = draw(st.one_of(st.text(max_size=3), st.integers(), st.binary(max_size=2)))
        else:
            row[field] = []
    elif spec.kind == "token":  # float sequences aligned with the response
        how = draw(st.sampled_from(["item", "shorter"]))
        values = row[field]
        if how == "shorter":
            row[field] = values[:-1]
        else:
            bad = [float("nan"), float("inf"), "0.5", True, None, 10**400]
            if field == "response_log_probs":
                bad.append(draw(st.floats(min_value=2e-4, max_value=1e30)))
            values[draw(st.integers(0, len(values) - 1))] = draw(st.sampled_from(bad))
    elif spec.dtype == torch.bool:
        if draw(st.booleans()):
            row[field] = draw(st.one_of(st.integers(0, 1), st.text(max_size=2), st.none(), st.floats()))
        elif field == "done":
            row[field] = not (row["terminated"] or row["truncated"])
        else:  # a flag that contradicts done
            row["terminated"] = row["truncated"] = False
            row["done"] = True
            return {"done", "terminated", "truncated"}
    elif spec.dtype == torch.float32:
        row[field] = draw(NOT_A_NUMBER)
    else:
        high = 2**31 - 1 if spec.dtype == torch.int32 else INT64[1]
        negative_is_bad = field in ("step", "policy_version")
        # None is no value for a required field, and "absent" for an optional one (Trajectory's
        # default): an optional field that no row has is a valid write of nothing
        absent = st.none() if spec.required else st.nothing()
        row[field] = draw(st.one_of(
            st.floats(), st.booleans(), st.text(max_size=3), absent, st.integers(high + 1, 2**80),
            st.integers(-(2**80), -1 if negative_is_bad else INT64[0] - 1),
        ))
    return RELATED.get(field, {field}) | {field}


def assert_stored_exactly(rows: list[dict], stored: TrajectoryBatch) -> None:
    """Each stored value equals the given one: same kind (int, float, bool, str), same value
    (floats after rounding to float32)."""
    for i, row in enumerate(rows):
        for name, given in row.items():
            spec = FIELDS_BY_NAME[name]
            got = stored[name]
            if spec.kind == "text":
                assert type(given) is str and got[i] == given, (i, name)
                continue
            got_values = got.row(i).tolist() if spec.kind == "token" else [got[i].item()]
            given_values = list(given) if spec.kind == "token" else [given]
            assert len(got_values) == len(given_values), (i, name)
            for g, s in zip(given_values, got_values):
                if spec.dtype == torch.bool:
                    assert type(g) is bool and g == s, (i, name, g, s)
                elif spec.dtype == torch.float32:
                    assert type(g) in (int, float) and float(np.float32(g)) == s, (i, name, g, s)
                else:
                    assert type(g) is int and g == s, (i, name, g, s)


@FUZZ
@given(data=st.data())
def test_rows_are_stored_exactly_or_refused_naming_the_field(store, data):
    rows = data.draw(valid_rows())
    bad = data.draw(st.booleans())
    may_name = data.draw(one_bad_value(rows)) if bad else set()
    stored = write_or_refuse(store, lambda: TrajectoryBatch.from_rows(rows), must_refuse=bad, may_name=may_name)
    if stored is not None:
        assert_stored_exactly(rows, stored)


# anything at all in one field: stored exactly, or refused naming it (no other exception type)
ANYTHING = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), TEXT, st.text(max_size=3), st.binary(max_size=3),
    st.lists(st.one_of(st.integers(-3, 2**33), st.floats(), st.booleans(), st.text(max_size=1)), max_size=3),
    st.lists(st.integers(-(2**65), 2**65), max_size=3),
    st.sampled_from([torch.int8, torch.int32, torch.int64, torch.float16, torch.float32, torch.float64, torch.bool])
    .flatmap(lambda dtype: st.lists(st.integers(-2, 3), min_size=1, max_size=3).map(lambda v: torch.tensor(v).to(dtype))),
    st.lists(st.integers(0, 9), min_size=1, max_size=3).map(np.array),
    st.just(np.float32(0.5)), st.just(np.int64(3)), st.just(torch.tensor(1.5)),
)


@FUZZ
@given(data=st.data())
def test_anything_in_a_field_is_stored_exactly_or_refused(store, data):
    rows = data.draw(valid_rows())
    i = data.draw(st.integers(0, len(rows) - 1))
    field = data.draw(st.sampled_from(sorted(rows[0])))
    rows[i][field] = data.draw(ANYTHING)
    may_name = RELATED.get(field, set()) | {field}
    stored = write_or_refuse(store, lambda: TrajectoryBatch.from_rows(rows), must_refuse=False, may_name=may_name)
    if stored is None:
        return
    for row in rows:  # a tensor or array stands for its list (token fields) or its one value
        for name, value in row.items():
            if isinstance(value, (torch.Tensor, np.ndarray, np.generic)):
                token = FIELDS_BY_NAME[name].kind == "token"
                row[name] = value.tolist() if token else value.reshape(-1)[0].item()
    assert_stored_exactly(rows, stored)


# ====================================================================== columns
def columns_of(rows: list[dict]) -> dict:
    columns = {}
    for name in rows[0]:
        spec = FIELDS_BY_NAME[name]
        values = [r[name] for r in rows]
        if spec.kind == "token":
            columns[name] = RaggedTensor.from_sequences(values, dtype=torch.float32 if spec.dtype == torch.float32
                                                        else torch.int64)
        elif spec.kind == "row":
            columns[name] = torch.tensor(values, dtype=spec.dtype)
        else:
            columns[name] = list(values)
    return columns


@st.composite
def column_change(draw, columns):
    """Changes one column (to something valid or not); returns the fields an error may name."""
    name = draw(st.sampled_from(sorted(columns) + ["?unknown", "?missing"]))
    if name == "?unknown":
        key = draw(st.text(min_size=1, max_size=6).filter(lambda k: k not in FIELDS_BY_NAME))
        columns[key] = columns["reward"]
        return {key}
    if name == "?missing":
        name = draw(st.sampled_from(sorted(columns)))
        del columns[name]
        return {name}
    col, n = columns[name], len(columns[name])
    may_name = RELATED.get(name, set()) | {name}
    if isinstance(col, list):
        how = draw(st.sampled_from(["entry", "str", "shorter"]))
        if how == "entry":
            col[draw(st.integers(0, n - 1))] = draw(st.one_of(BAD_TEXT, TEXT))
        elif how == "str":
            columns[name] = "".join(col)
        else:
            columns[name] = col[:-1]
        return may_name
    dtype = draw(st.sampled_from([torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.float16,
                                  torch.float32, torch.float64, torch.bool]))
    integer = FIELDS_BY_NAME[name].dtype in (torch.int32, torch.int64)
    if isinstance(col, RaggedTensor):
        how = draw(st.sampled_from(["dtype", "value", "offsets"]))
        if how == "offsets":
            columns[name] = RaggedTensor(col.values, col.offsets + draw(st.sampled_from([1, -1])))
            return may_name
        values = col.values.to(dtype) if how == "dtype" else col.values.to(torch.int64 if integer else torch.float64)
        if how == "value":
            choices = [-5, 2**31, 2**40, 3] if integer else [float("nan"), float("inf"), 1e39, 0.5, -3.0]
            values[draw(st.integers(0, values.numel() - 1))] = draw(st.sampled_from(choices))
        columns[name] = RaggedTensor(values, col.offsets)
        return may_name
    how = draw(st.sampled_from(["dtype", "value", "2-d", "shorter"]))
    if how == "dtype":
        columns[name] = col.to(dtype)
    elif how == "value":
        wide = col.to(torch.int64 if integer else torch.float64)
        choices = [-1, 2**31, 2**40, 7] if integer else [float("nan"), float("inf"), 1e39, -1.0, 0.5]
        wide[draw(st.integers(0, n - 1))] = draw(st.sampled_from(choices))
        columns[name] = wide
    elif how == "2-d":
        columns[name] = col.reshape(-1, 1)
    else:
        columns[name] = col[:-1]
    return may_name | {"prompt_tokens"} if how == "shorter" else may_name


def assert_columns_stored_exactly(columns: dict, stored: TrajectoryBatch) -> None:
    for name, given in columns.items():
        spec = FIELDS_BY_NAME[name]
        got = stored[name]
        if spec.kind == "text":
            assert all(type(s) is str for s in given) and list(given) == got, name
            continue
        given_values = given.values if isinstance(given, RaggedTensor) else given
        got_values = got.values if isinstance(got, RaggedTensor) else got
        if isinstance(given, RaggedTensor):
            assert torch.equal(given.offsets, got.offsets), name
        if spec.dtype == torch.bool:
            assert given_values.dtype == torch.bool and torch.equal(given_values, got_values), name
        elif spec.dtype == torch.float32:
            assert given_values.dtype.is_floating_point, (name, given_values.dtype)
            assert torch.equal(given_values.to(torch.float32), got_values), name
        else:
            assert not given_values.dtype.is_floating_point and given_values.dtype != torch.bool, name
            assert torch.equal(given_values.to(torch.int64), got_values.to(torch.int64)), name


@FUZZ
@given(data=st.data())
def test_columns_are_stored_exactly_or_refused_naming_the_field(store, data):
    columns = columns_of(data.draw(valid_rows()))
    may_name = data.draw(column_change(columns)) if data.draw(st.booleans()) else set()
    stored = write_or_refuse(store, lambda: TrajectoryBatch(columns), must_refuse=False, may_name=may_name)
    if stored is not None:
        assert_columns_stored_exactly(columns, stored)
