"""Every kind of malformed write is refused with an error naming the row, the field and the fix,
and a refused write leaves the store exactly as it was."""

from __future__ import annotations

import pytest
import torch
from helpers import make_batch

from rlhf_pipeline.schema import (
    StoreSchema,
    TrajectoryBatch,
    TrajectoryValidationError,
    validate_batch,
)
from rlhf_pipeline.schema.ragged import RaggedTensor
from rlhf_pipeline.schema.tool_errors import ALL_TOOL_ERROR_KINDS
from rlhf_pipeline.storage.memmap import MemmapTrajectoryStore

OPTIONAL = ("kl", "advantage")


def good() -> TrajectoryBatch:
    return make_batch(2, 3, seed=7, optional=OPTIONAL)


def _set(name, index, value):
    def mutate(batch):
        column = batch[name]
        if isinstance(column, RaggedTensor):
            values = column.values.clone()
            values[index] = value
            return batch.with_columns(**{name: RaggedTensor(values, column.offsets)})
        if isinstance(column, list):
            column = list(column)
            column[index] = value
            return batch.with_columns(**{name: column})
        column = column.clone()
        column[index] = value
        return batch.with_columns(**{name: column})
    return mutate


def _row_values_of(name, row, value):
    """Sets every value of ragged ``name`` in ``row``."""
    def mutate(batch):
        column = batch[name]
        values = column.values.clone()
        values[int(column.offsets[row]) : int(column.offsets[row + 1])] = value
        return batch.with_columns(**{name: RaggedTensor(values, column.offsets)})
    return mutate


def _shorten(name, row):
    """Drops the last value of ``row`` in ragged ``name``."""
    def mutate(batch):
        column = batch[name]
        keep = torch.ones(column.values.numel(), dtype=torch.bool)
        keep[int(column.offsets[row + 1]) - 1] = False
        lengths = column.lengths().clone()
        lengths[row] -= 1
        return batch.with_columns(**{name: RaggedTensor.from_lengths(column.values[keep], lengths)})
    return mutate


def _replace(name, make):
    return lambda batch: batch.with_columns(**{name: make(batch[name])})


# (case, mutation, what the message must say)
BAD_WRITES = [
    ("missing field", lambda b: b.without("reward"), r"field 'reward'.*missing field"),
    ("field not in store", lambda b: b.with_columns(ref_log_probs=b["response_log_probs"]),
     r"field 'ref_log_probs'.*not stored by this buffer.*create the buffer with them"),
    ("text not a list", _replace("prompt_text", lambda c: "sixchr"), r"field 'prompt_text'.*list of 6 strings"),
    ("text entry not str", _set("response_text", 2, b"bytes"), r"row 2, field 'response_text': expected str"),
    ("padded instead of ragged", _replace("prompt_tokens", lambda c: c.to_padded()[0]),
     r"field 'prompt_tokens'.*RaggedTensor"),
    ("bad offsets", _replace("response_tokens", lambda c: RaggedTensor(c.values, c.offsets + 1)),
     r"field 'response_tokens'.*offsets must start at 0"),
    ("float token ids", _replace("prompt_tokens", lambda c: c.to(torch.float32)),
     r"field 'prompt_tokens'.*expected integer values"),
    ("token id over int32", _replace("response_tokens", lambda c: RaggedTensor(
        torch.where(torch.arange(c.values.numel()) == 0, 2**40, c.values.to(torch.int64)), c.offsets)),
     r"row 0, field 'response_tokens': token id 1099511627776 is outside \[0, 2147483647\]"),
    ("negative token id", _set("response_tokens", 0, -5), r"row 0, field 'response_tokens'.*outside \[0,"),
    ("int reward", _replace("reward", lambda c: c.to(torch.int64)), r"field 'reward'.*floating-point"),
    ("int done", _replace("done", lambda c: c.to(torch.int64)), r"field 'done'.*bool tensor"),
    ("2-D row field", _replace("step", lambda c: c.reshape(-1, 1)), r"field 'step'.*1-D tensor"),
    ("rows disagree", _replace("reward", lambda c: c[:5]), r"columns disagree on the number of rows"),
    ("empty prompt", lambda b: b.with_columns(prompt_tokens=RaggedTensor.from_sequences(
        [[]] + [b["prompt_tokens"].row(i) for i in range(1, 6)], dtype=torch.int32)),
     r"row 0, field 'prompt_tokens': empty prompt"),
    ("log-probs shorter than response", _shorten("response_log_probs", 3),
     r"row 3, field 'response_log_probs': expected \d+ values \(one per response token\)"),
    ("kl shorter than response", _shorten("kl", 4), r"row 4, field 'kl': expected \d+ values"),
    ("positive log-prob", _row_values_of("response_log_probs", 5, 0.5),
     r"row 5, field 'response_log_probs': log-prob 0.5 is not a finite value <= 0"),
    ("nan log-prob", _row_values_of("response_log_probs", 1, float("nan")), r"row 1, field 'response_log_probs'"),
    ("inf kl", _row_values_of("kl", 2, float("inf")), r"row 2, field 'kl': value inf is not finite"),
    ("nan reward", _set("reward", 4, float("nan")), r"row 4, field 'reward': must be finite"),
    ("inf advantage", _set("advantage", 2, float("inf")), r"row 2, field 'advantage': must be finite"),
    ("done without a reason", lambda b: b.with_columns(
        terminated=torch.zeros(6, dtype=torch.bool), truncated=torch.zeros(6, dtype=torch.bool)),
     r"row 0, field 'done': done must equal \(terminated or truncated\)"),
    ("negative policy version", _set("policy_version", 3, -1), r"row 3, field 'policy_version': must be >= 0"),
    ("negative step", _set("step", 1, -2), r"row 1, field 'step': must be >= 0"),
]


@pytest.fixture(scope="module")
def store_and_reader(tmp_path_factory):
    path = tmp_path_factory.mktemp("schema") / "buffer"
    store = MemmapTrajectoryStore.create(path, StoreSchema(OPTIONAL), segment_rows=4, durable=False)
    store.append(good())
    reader = MemmapTrajectoryStore.open(path)
    yield store, reader
    reader.close()
    store.close()


@pytest.mark.parametrize("case, mutate, message", BAD_WRITES, ids=[c[0] for c in BAD_WRITES])
def test_malformed_write_is_named_and_leaves_the_store_unchanged(case, mutate, message, store_and_reader):
    store, reader = store_and_reader
    before = (store.first_row, store.next_row)
    with pytest.raises(TrajectoryValidationError, match=message):
        store.append(mutate(good()))
    assert (store.first_row, store.next_row) == before == (0, 6)
    assert len(reader) == 6
    assert reader.read(torch.arange(6)).equal(good())
    assert store.read(torch.arange(6)).equal(good())


def test_a_good_write_after_rejections_lands_right_after_the_old_rows(store_and_reader, tmp_path):
    store, _ = store_and_reader
    with MemmapTrajectoryStore.create(tmp_path / "b", StoreSchema(OPTIONAL), segment_rows=4) as fresh:
        fresh.append(good())
        with pytest.raises(TrajectoryValidationError):
            fresh.append(_set("reward", 0, float("nan"))(good()))
        assert fresh.append(good()).tolist() == list(range(6, 12))


def test_empty_and_wrong_type_writes_are_refused():
    with pytest.raises(TrajectoryValidationError, match="expected a TrajectoryBatch"):
        validate_batch({"reward": torch.zeros(1)}, StoreSchema())
    with pytest.raises(TrajectoryValidationError, match="unknown field"):
        TrajectoryBatch({"rewards": torch.zeros(1)})
    empty = good().select(torch.zeros(0, dtype=torch.int64)).without(*OPTIONAL)
    with pytest.raises(TrajectoryValidationError, match="empty write"):
        validate_batch(empty, StoreSchema())


def test_validation_casts_to_storage_dtypes():
    batch = good()
    wider = batch.with_columns(
        reward=batch["reward"].to(torch.float64), step=batch["step"].to(torch.int64),
        prompt_tokens=batch["prompt_tokens"].to(torch.int64),
    )
    checked = validate_batch(wider, StoreSchema(OPTIONAL))
    assert checked["reward"].dtype == torch.float32 and checked["step"].dtype == torch.int32
    assert checked["prompt_tokens"].dtype == torch.int32
    assert checked.equal(validate_batch(batch, StoreSchema(OPTIONAL)))


AGENT_FIELDS = ("tool_calls", "tool_errors", "tool_error_kinds", "step_advantage")
AGENT_BAD_WRITES = [
    ("negative tool calls", _set("tool_calls", 1, -1), r"row 1, field 'tool_calls': must be >= 0"),
    ("more failed calls than calls", lambda b: b.with_columns(tool_errors=b["tool_calls"] + 1),
     r"row 0, field 'tool_errors': more failed tool calls than tool calls"),
    ("unknown kind bits", lambda b: b.with_columns(tool_error_kinds=b["tool_error_kinds"] | (ALL_TOOL_ERROR_KINDS + 1)),
     r"row 0, field 'tool_error_kinds': unknown bits"),
    ("a kind on a turn without failures", lambda b: b.with_columns(
        tool_error_kinds=torch.where(b["tool_errors"] > 0, 16, 2).to(torch.int32)),
     r"field 'tool_error_kinds': kinds of failure must be set exactly on turns with failed calls"),
    ("inf step advantage", _set("step_advantage", 2, float("inf")), r"row 2, field 'step_advantage': must be finite"),
]


@pytest.mark.parametrize("case, mutate, message", AGENT_BAD_WRITES, ids=[c[0] for c in AGENT_BAD_WRITES])
def test_agents_fields_are_checked_at_the_door(case, mutate, message):
    batch = make_batch(1, 8, seed=3, optional=AGENT_FIELDS)
    schema = StoreSchema(AGENT_FIELDS)
    assert int(batch["tool_errors"].sum()) > 0 and int((batch["tool_errors"] == 0).sum()) > 0  # both kinds of turn
    validate_batch(batch, schema)
    with pytest.raises(TrajectoryValidationError, match=message):
        validate_batch(mutate(batch), schema)
