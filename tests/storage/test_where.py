"""The ``--where`` language: what it computes, and everything it refuses (storage/where.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_pipeline.storage.where import GROUP_NAMES, ROW_NAMES, TRAJECTORY_NAMES, WhereError, parse_where

N = 6


def columns() -> dict[str, np.ndarray]:
    """Six rows: stored fields as a store returns them (token fields as offsets), plus group stats."""
    return {
        "position": np.arange(N),
        "reward": np.array([1.0, 0.0, 0.5, -1.0, 1.0, 2.0], dtype=np.float32),
        "advantage": np.array([0.3, -1.2, 0.0, 2.0, -0.05, 1.0], dtype=np.float32),
        "policy_version": np.array([0, 1, 2, 3, 4, 5]),
        "response_tokens": np.array([0, 3, 3, 10, 12, 20, 21]),  # lengths 3, 0, 7, 2, 8, 1
        "prompt_tokens": np.array([0, 5, 10, 15, 20, 25, 30]),
        "step": np.zeros(N, dtype=np.int32),
        "done": np.ones(N, dtype=bool),
        "terminated": np.array([True, False, True, False, True, True]),
        "truncated": np.array([False, True, False, True, False, False]),
        "group_id": np.array([7, 7, 8, 8, (3 << 40) + 1, (3 << 40) + 1]),
        "trajectory_id": np.arange(100, 106),
        "group_size": np.full(N, 2),
        "group_reward_mean": np.array([0.5, 0.5, -0.25, -0.25, 1.5, 1.5]),
        "group_reward_std": np.array([0.5, 0.5, 0.75, 0.75, 0.5, 0.5]),
        "group_reward_min": np.array([0.0, 0.0, -1.0, -1.0, 1.0, 1.0]),
        "group_reward_max": np.array([1.0, 1.0, 0.5, 0.5, 2.0, 2.0]),
        "termination_reason": np.array([1, 2, 1, 3, 1, 6], dtype=np.int8),
        "trajectory_turns": np.ones(N, dtype=np.int64),
        "trajectory_return": np.array([1.0, 0.0, 0.5, -1.0, 1.0, 2.0]),
        "trajectory_end": np.array([1, 2, 1, 3, 1, 6]),
        "tool_calls": np.array([0, 1, 2, 0, 1, 3], dtype=np.int32),
        "tool_errors": np.array([0, 1, 0, 0, 0, 3], dtype=np.int32),
        "trajectory_tool_calls": np.array([0, 1, 2, 0, 1, 3]),
        "trajectory_tool_errors": np.array([0, 1, 0, 0, 0, 3]),
        "tool_error_kinds": np.array([0, 2, 0, 0, 0, 17], dtype=np.int32),
    }


def keep(text: str) -> list[int]:
    return np.flatnonzero(parse_where(text).evaluate(columns(), N)).tolist()


@pytest.mark.parametrize(("text", "rows"), [
    ("reward > 0", [0, 2, 4, 5]),
    ("response_length >= 3 and not truncated", [0, 2, 4]),
    ("0 < policy_version <= 3", [1, 2, 3]),  # chained
    ("policy_version in (1, 4, 99)", [1, 4]),
    ("policy_version not in [0, 5]", [1, 2, 3, 4]),
    ("abs(advantage) > 0.25", [0, 1, 3, 5]),
    ("max(reward, advantage) >= 1 or -advantage > 1", [0, 1, 3, 4, 5]),
    ("prompt_length * 2 + 1 == 11", [0, 1, 2, 3, 4, 5]),
    ("policy_version % 2 == 1 and response_length / 2 >= 0.5", [3, 5]),
    ("collector == 3", [4, 5]),
    ("group_reward_std > 0.6", [2, 3]),
    ("group_reward_min == 1", [4, 5]),
    ("group_size == 2 and position < 2", [0, 1]),
    ("terminated == True", [0, 2, 4, 5]),
    ("done", [0, 1, 2, 3, 4, 5]),
    ("reward / 0 > 0", [0, 2, 4, 5]),  # x / 0 is inf, nan for 0 / 0 (never true): no exception
    ("True", [0, 1, 2, 3, 4, 5]),
])
def test_expressions_keep_the_rows_they_say(text, rows):
    assert keep(text) == rows


def test_fields_and_group_use_say_what_a_filter_must_read():
    expr = parse_where("response_length < 10 and group_reward_std > 0")
    assert expr.uses_groups
    assert expr.fields == ("group_id", "response_tokens")
    plain = parse_where("collector == 1 or position > 4")
    assert not plain.uses_groups and plain.fields == ("group_id",)


@pytest.mark.parametrize(("text", "message"), [
    ("rewrd > 0", r"unknown name 'rewrd'; did you mean 'reward'\? Valid names: reward, advantage"),
    ("zzz > 0", r"unknown name 'zzz'\. Valid names: .*group_reward_std"),
    ("reward", r"is a number, not a condition; compare it, e.g. 'reward > 0'"),
    ("reward.real > 0", r"Attribute at column 1 is not allowed"),
    ("__import__('os').system('true')", r"is not allowed"),
    ("open('x') == 1", r"calling open at column 1 is not allowed"),
    ("reward ** 2 > 1", r"operator '\*\*' at column 1 is not allowed"),
    ("reward & 1", r"operator '&'"),
    ("reward > 'a'", r"the constant 'a'"),
    ("[r for r in reward]", r"ListComp"),
    ("(lambda: 1)() == 1", r"is not allowed"),
    ("reward[0] > 1", r"Subscript"),
    ("(x := 1) > 0", r"NamedExpr"),
    ("reward and done", r"'and' / 'or' needs a condition, got 'reward'"),
    ("not reward", r"'not' needs a condition"),
    ("done < terminated", r"ordering a condition"),
    ("reward in (1, 'a')", r"member of 'in \(...\)' that is not a number"),
    ("reward in policy_version", r"'in' needs a tuple of numbers"),
    ("abs(reward, 1) > 0", r"abs\(\) takes 1 argument\(s\), got 2"),
    ("max(reward) > 0", r"max\(\) takes at least 2"),
    ("abs(x=reward) > 0", r"calling abs"),
    ("reward >", r"cannot parse"),
    ("   ", r"is empty"),
    ("reward > 0 and " * 200 + "done", r"characters long; the limit is 2000"),
])
def test_bad_expressions_are_refused_with_what_and_how(text, message):
    with pytest.raises(WhereError, match=message):
        parse_where(text)


def test_a_name_whose_field_the_buffer_lacks_is_refused_before_reading():
    stored = ("prompt_tokens", "response_tokens", "group_id", "reward", "policy_version")
    assert parse_where("reward > 0", stored_fields=stored)
    with pytest.raises(WhereError, match="does not store field 'advantage'"):
        parse_where("abs(advantage) > 0.1", stored_fields=stored)


def test_list_of_names_matches_the_evaluator():
    # every documented name evaluates on a store's columns
    for name in [*ROW_NAMES, *GROUP_NAMES, *TRAJECTORY_NAMES]:
        cond = name if name in ("done", "terminated", "truncated") else f"{name} == {name}"
        assert parse_where(cond).evaluate(columns(), N).shape == (N,)


# ---------------------------------------------------------------- agreement with Python itself
NUMERIC = ["reward", "advantage", "policy_version", "step", "group_reward_mean"]
leaf = st.one_of(st.sampled_from(NUMERIC), st.integers(-3, 3).map(str), st.sampled_from(["0.5", "1.5"]))
numbers = st.recursive(
    leaf,
    lambda inner: st.one_of(
        st.tuples(inner, st.sampled_from(["+", "-", "*"]), inner).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        inner.map(lambda x: f"abs({x})"), inner.map(lambda x: f"(-{x})"),
        st.tuples(inner, inner).map(lambda t: f"max({t[0]}, {t[1]})"),
    ),
    max_leaves=6,
)
comparison = st.tuples(numbers, st.sampled_from(["<", "<=", ">", ">=", "==", "!="]), numbers) \
    .map(lambda t: f"{t[0]} {t[1]} {t[2]}")
conditions = st.recursive(
    comparison,
    lambda inner: st.one_of(
        st.tuples(inner, st.sampled_from(["and", "or"]), inner).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        inner.map(lambda x: f"not ({x})"),
    ),
    max_leaves=4,
)


@settings(max_examples=150, deadline=None)
@given(conditions)
def test_vectorized_evaluation_agrees_with_python_row_by_row(text):
    """The oracle: Python evaluates the same text on each row's plain values (only in this test)."""
    cols = columns()
    for name in NUMERIC:
        cols[name] = cols[name].astype(np.float64)
    got = parse_where(text).evaluate(cols, N)
    for row in range(N):
        values = {name: float(cols[name][row]) for name in NUMERIC}
        assert bool(got[row]) == bool(eval(text, {"__builtins__": {"abs": abs, "max": max}}, values)), (text, row)


@pytest.mark.parametrize(("text", "message"), [
    ("reward >", r"cannot parse --where 'reward >': it ends after column 8 where more was expected"),
    ("  reward >  ", r"it ends after column 10 where more was expected"),
    ("reward = 1", r"invalid syntax at column 8"),
    ("  reward = 1", r"invalid syntax at column 10"),
    ("(reward > 0", r"'\(' was never closed at column 1"),
    ("  reward.real > 0", r"Attribute at column 3 is not allowed"),
])
def test_error_columns_count_in_the_expression_as_given(text, message):
    with pytest.raises(WhereError, match=message):
        parse_where(text)
