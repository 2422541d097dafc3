"""Fields with one value per unit, kept in the commit record: read without the unit, and never wrong.

A read that asks only for ``policy_version``, ``done`` or ``step`` (rank 0's whole-draw reads) is
answered from the record where the unit's value is constant. The proof that no unit is read: the
unit's files are deleted, the constant fields still read, any other field raises.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import make_batch, multi_turn_rows
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_pipeline.cli.main import main
from rlhf_pipeline.schema import StoreSchema, TrajectoryBatch
from rlhf_pipeline.storage import StoreCorruptedError
from rlhf_pipeline.storage.buffers import repair_buffer, verify_buffer
from rlhf_pipeline.storage.zarr.store import ZarrTrajectoryStore
from rlhf_pipeline.storage.zarr.unit_constants import CONSTANT_FIELDS, RECORD_KEY

SCHEMA = StoreSchema(optional=("termination_reason",))


def single_turn(rows: int, version: int, seed: int = 0) -> TrajectoryBatch:
    return make_batch(1, rows, seed=seed, optional=("termination_reason",), policy_version=version,
                      first_trajectory_id=1000 * seed)


def record_of(path) -> dict:
    return json.loads((path / "zarr.json").read_text())["attributes"]["rlhf_pipeline"]


def rewrite_record(path, change) -> None:
    document = json.loads((path / "zarr.json").read_text())
    change(document["attributes"]["rlhf_pipeline"])
    (path / "zarr.json").write_text(json.dumps(document))


def entries(path) -> dict[tuple[int, int, int], dict]:
    constants = record_of(path)[RECORD_KEY]
    return {tuple(item[:3]): dict(zip(constants["fields"], item[3:])) for item in constants["units"]}


def delete_unit_files(path) -> None:
    for unit in (path / "units").iterdir():
        if unit.is_dir():
            shutil.rmtree(unit)
        elif unit.name != "zarr.json":
            unit.unlink()


def test_constant_fields_are_read_from_the_record_without_the_units(tmp_path):
    path = tmp_path / "b"
    store = ZarrTrajectoryStore.create(str(path), SCHEMA, segment_rows=64)
    for version in range(3):
        store.append(single_turn(8, version, seed=version))
    assert entries(path) == {(8 * v, 8, 4): {"policy_version": v, "done": True, "step": 0} for v in range(3)}
    reader = ZarrTrajectoryStore.open(str(path))
    positions = torch.tensor([17, 0, 9, 23, 3])
    expected = reader.read(positions, fields=CONSTANT_FIELDS)
    reader.close()
    delete_unit_files(path)  # the writer stays open: closing it would merge its fragments into one
    with ZarrTrajectoryStore.open(str(path)) as reader:
        got = reader.read(positions, fields=CONSTANT_FIELDS)
        assert got["policy_version"].tolist() == [2, 0, 1, 2, 0]
        for name in CONSTANT_FIELDS:
            assert torch.equal(got[name], expected[name]) and got[name].dtype == expected[name].dtype
        assert reader.read(positions, fields=("done",))["done"].all()
        with pytest.raises(StoreCorruptedError, match="missing"):
            reader.read(positions, fields=("reward",))  # not in the record: the unit is read, and is gone
        with pytest.raises(StoreCorruptedError, match="missing"):
            reader.read(positions, fields=("policy_version", "group_id"))
    store.close()


def test_fields_that_vary_within_a_unit_are_read_from_it(tmp_path):
    path = tmp_path / "b"
    rows = multi_turn_rows()  # 16 rows: six trajectories of 1 to 5 turns, policy version 0
    with ZarrTrajectoryStore.create(str(path), SCHEMA, segment_rows=64) as store:
        store.append(rows)
    assert entries(path) == {(0, 16, 4): {"policy_version": 0, "done": None, "step": None}}
    with ZarrTrajectoryStore.open(str(path)) as reader:
        got = reader.read(torch.arange(16), fields=("done", "step"))
        assert torch.equal(got["done"], rows["done"]) and torch.equal(got["step"], rows["step"])
    delete_unit_files(path)
    with ZarrTrajectoryStore.open(str(path)) as reader:
        assert reader.read(torch.arange(16), fields=("policy_version",))["policy_version"].eq(0).all()
        with pytest.raises(StoreCorruptedError, match="missing"):
            reader.read(torch.arange(16), fields=("done", "step"))


def test_a_sealed_segment_and_a_merged_tail_record_what_is_constant_across_their_rows(tmp_path):
    path = tmp_path / "b"
    store = ZarrTrajectoryStore.create(str(path), SCHEMA, segment_rows=16)
    for version in range(3):  # fragments of 8 rows: versions 0, 1 seal into rows 0-15; version 2 is the tail
        store.append(single_turn(8, version, seed=version))
    store.append(single_turn(4, 2, seed=3))
    store.flush()
    assert entries(path) == {(0, 16, 3): {"policy_version": None, "done": True, "step": 0},
                             (16, 8, 4): {"policy_version": 2, "done": True, "step": 0},
                             (24, 4, 4): {"policy_version": 2, "done": True, "step": 0}}
    store.close()  # merges the tail's two fragments into one
    assert entries(path) == {(0, 16, 3): {"policy_version": None, "done": True, "step": 0},
                             (16, 12, 4): {"policy_version": 2, "done": True, "step": 0}}
    with ZarrTrajectoryStore.open(str(path)) as reader:
        assert reader.read(torch.arange(28), fields=("policy_version",))["policy_version"].tolist() == \
            [0] * 8 + [1] * 8 + [2] * 12


def test_a_record_without_constants_reads_the_units_and_its_next_writer_adds_them_for_new_units(tmp_path):
    path = tmp_path / "b"
    with ZarrTrajectoryStore.create(str(path), SCHEMA, segment_rows=64) as store:
        store.append(single_turn(8, 0))
    rewrite_record(path, lambda record: record.pop(RECORD_KEY))  # a store written before the key
    with ZarrTrajectoryStore.open(str(path)) as reader:
        assert reader.read(torch.arange(8), fields=("policy_version",))["policy_version"].eq(0).all()
    with ZarrTrajectoryStore.open(str(path), "a") as store:
        store.append(single_turn(8, 1, seed=1))
        assert entries(path) == {(8, 8, 4): {"policy_version": 1, "done": True, "step": 0}}
    # the merged tail on close is a new unit: its constants computed from its rows
    assert entries(path) == {(0, 16, 4): {"policy_version": None, "done": True, "step": 0}}


def test_an_entry_answers_only_for_the_unit_it_names(tmp_path):
    """A writer of an older version copies the key forward while it seals fragments into a segment at
    the same first row: the fragment's entry must not answer for the segment."""
    path = tmp_path / "b"
    with ZarrTrajectoryStore.create(str(path), SCHEMA, segment_rows=16) as store:
        store.append(single_turn(8, 0))
        store.append(single_turn(8, 1, seed=1))
        store.flush()
    assert list(entries(path)) == [(0, 16, 3)]
    rewrite_record(path, lambda record: record[RECORD_KEY]["units"].__setitem__(0, [0, 8, 4, 999, True, 0]))
    with ZarrTrajectoryStore.open(str(path)) as reader:
        assert reader.read(torch.arange(16), fields=("policy_version",))["policy_version"].tolist() == [0] * 8 + [1] * 8
    with ZarrTrajectoryStore.open(str(path), "a") as store:
        store.append(single_turn(4, 2, seed=2))
    assert (0, 8, 4) not in entries(path)  # the next publish lists entries of listed units only


@pytest.mark.parametrize("bad", [[0, 8, 4, "seven", True, 0], [0, 8, 4, 0, 1, 0], [0, 8, 4, 0, True],
                                 {"no": "list"}])
def test_a_malformed_entry_is_refused_naming_the_key_and_the_fix(tmp_path, bad):
    path = tmp_path / "b"
    with ZarrTrajectoryStore.create(str(path), SCHEMA, segment_rows=64) as store:
        store.append(single_turn(8, 0))
    before = sorted(p.name for p in (path / "units").iterdir())
    rewrite_record(path, lambda record: record[RECORD_KEY]["units"].__setitem__(0, bad))
    with pytest.raises(StoreCorruptedError, match=f"'{RECORD_KEY}' is malformed.*repair"):
        ZarrTrajectoryStore.open(str(path))
    assert sorted(p.name for p in (path / "units").iterdir()) == before  # nothing stored was touched


def batch_of(turns: list[int], version: int, seed: int) -> TrajectoryBatch:
    """Trajectories of ``turns`` turns each (1: single-turn rows), all sampled by ``version``."""
    rows = []
    for t, count in enumerate(turns):
        for step in range(count):
            rows.append({"prompt_tokens": torch.arange(2, dtype=torch.int32), "response_tokens":
                         torch.arange(1 + (seed + step) % 3, dtype=torch.int32),
                         "response_log_probs": torch.full((1 + (seed + step) % 3,), -0.5),
                         "group_id": seed, "trajectory_id": 100 * seed + t, "step": step, "reward": 0.5,
                         "policy_version": version, "done": step == count - 1, "terminated": step == count - 1,
                         "truncated": False, "termination_reason": 0 if step < count - 1 else 1,
                         "prompt_text": "p", "response_text": "r"})
    return TrajectoryBatch.from_rows(rows)


appends = st.lists(st.tuples(st.lists(st.integers(1, 3), min_size=1, max_size=4), st.integers(0, 2)),
                   min_size=1, max_size=8)


@settings(max_examples=40, deadline=None)
@given(appends=appends, segment_rows=st.sampled_from([4, 8, 32]), close=st.booleans(),
       fields=st.sampled_from([("done", "step"), ("policy_version",), CONSTANT_FIELDS]))
def test_what_the_record_answers_equals_what_the_units_hold(tmp_path_factory, appends, segment_rows, close, fields):
    path = tmp_path_factory.mktemp("b") / "b"
    store = ZarrTrajectoryStore.create(str(path), SCHEMA, segment_rows=segment_rows)
    for seed, (turns, version) in enumerate(appends):
        store.append(batch_of(turns, version, seed))
    store.flush()
    if close:
        store.close()
    with ZarrTrajectoryStore.open(str(path)) as reader:
        positions = torch.randperm(len(reader), generator=torch.Generator().manual_seed(len(reader)))
        whole = reader.read(positions)  # every field: read from the units
        answered = reader.read(positions, fields=fields)
        for name in fields:
            assert torch.equal(answered[name], whole[name]), name
    if not close:
        store.close()


@pytest.mark.parametrize("damage", ["wrong value", "malformed"])
def test_verify_names_a_wrong_or_malformed_entry_and_repair_rewrites_the_record_without_them(tmp_path, damage,
                                                                                              capsys):
    path = tmp_path / "b"
    store = ZarrTrajectoryStore.create(str(path), SCHEMA, segment_rows=64)
    store.append(single_turn(8, 3))
    store.append(single_turn(8, 4, seed=1))
    store.close()  # one merged fragment: versions 3 and 4, done and step constant
    expected = ZarrTrajectoryStore.open(str(path)).read(torch.arange(16))
    entry = [0, 16, 4, 3, True, 0] if damage == "wrong value" else [0, 16, 4, 3, "yes", 0]
    rewrite_record(path, lambda record: record[RECORD_KEY]["units"].__setitem__(0, entry))
    assert main(["inspect", str(path), "--verify"]) == 1
    out = capsys.readouterr().out
    assert "000000000000000-0000000016f has policy_version = 3, its rows hold [3, 4]" in out or \
        (damage == "malformed" and "'unit_constants' is malformed" in out), out
    (report,) = repair_buffer(str(path))  # a dry run says what it would write
    assert not report.unrecoverable and any("without its 'unit_constants'" in a for a in report.actions)
    assert RECORD_KEY in record_of(path)
    (report,) = repair_buffer(str(path), apply=True)
    assert RECORD_KEY not in record_of(path) and list(path.glob("repair-*/zarr.json"))
    (checked,) = verify_buffer(str(path))
    assert checked.ok, checked.problems
    with ZarrTrajectoryStore.open(str(path)) as reader:  # every row as written, read from the units
        got = reader.read(torch.arange(16))
        for name in CONSTANT_FIELDS + ("reward", "group_id"):
            assert torch.equal(got[name], expected[name]), name
