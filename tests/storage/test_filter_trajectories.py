"""``filter`` on multi-turn buffers: trajectory statistics, reasons by name, never half a trajectory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import TRAJECTORIES, multi_turn_rows

from rlhf_pipeline.cli.main import main
from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.schema.termination import TerminationReason as R
from rlhf_pipeline.storage import create_store, open_store
from rlhf_pipeline.storage.filtering import filter_buffer, select_positions
from rlhf_pipeline.storage.where import WhereError, parse_where

@pytest.fixture(params=["memmap", "zarr"])
def buffer(request, tmp_path):
    path = tmp_path / "buf"
    # segments of 4 rows: trajectories straddle storage units, so their statistics need the first pass
    with create_store(path, request.param, StoreSchema(optional=("termination_reason",)), segment_rows=4) as store:
        store.append(multi_turn_rows())
    return path


def kept_trajectories(path, where: str) -> dict[int, list[int]]:
    with open_store(str(path), mode="r") as store:
        positions = select_positions(store, where, chunk_rows=4).positions
        rows = store.read(torch.as_tensor(positions), fields=("trajectory_id", "step"))
    out: dict[int, list[int]] = {}
    for trajectory, step in zip(rows["trajectory_id"].tolist(), rows["step"].tolist(), strict=True):
        out.setdefault(trajectory, []).append(step)
    return out


def test_trajectory_statistics_and_reason_names_select_whole_trajectories(buffer):
    assert kept_trajectories(buffer, "trajectory_end == MAX_TURNS") == {2: [0, 1, 2, 3]}
    assert kept_trajectories(buffer, "trajectory_end in (TOOL_ERROR, TOKEN_BUDGET)") == {1: [0], 5: [0, 1, 2, 3, 4]}
    assert kept_trajectories(buffer, "trajectory_turns >= 4") == {2: [0, 1, 2, 3], 5: [0, 1, 2, 3, 4]}
    assert kept_trajectories(buffer, "trajectory_return == 3") == {0: [0, 1, 2]}  # 3 turns of reward 1
    # the row value: only done rows carry a reason, so only trajectories of one turn pass whole
    assert kept_trajectories(buffer, "termination_reason == ENV_DONE") == {4: [0]}


def test_a_row_condition_keeps_a_trajectory_only_when_every_turn_meets_it(buffer):
    with open_store(str(buffer), mode="r") as store:
        rows = store.read(torch.arange(len(store)))
    lengths = rows["response_tokens"].lengths().numpy()
    trajectory = rows["trajectory_id"].numpy()
    expected = {t: list(range(int((trajectory == t).sum()))) for t in np.unique(trajectory)
                if (lengths[trajectory == t] <= 4).all()}
    assert 0 < len(expected) < len(TRAJECTORIES)  # the premise: some trajectories have a long turn, some not
    assert kept_trajectories(buffer, "response_length <= 4") == expected
    # only the done rows meet this one: no trajectory of several turns survives it
    assert kept_trajectories(buffer, "done") == {1: [0], 4: [0]}
    # ...and what the others' done rows were is counted, for the command to say why they went
    with open_store(str(buffer), mode="r") as store:
        done_rows = int(store.read(torch.arange(len(store)), fields=("done",))["done"].sum())
        chosen = select_positions(store, "done", chunk_rows=4)
    assert chosen.rows_dropped_with_trajectories == done_rows - 2 > 0


def test_filter_says_how_many_rows_that_met_the_condition_went_with_their_trajectories(buffer, capsys):
    with open_store(str(buffer), mode="r") as store:
        rows = store.read(torch.arange(len(store)), fields=("step", "done"))
    later_turns = int((rows["step"] > 0).sum())
    assert main(["filter", str(buffer), "--where", "step > 0", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"kept 0 of {len(rows)} rows" in out
    assert f"{later_turns} more rows met the condition but were dropped with their trajectories" in out, out
    assert main(["filter", str(buffer), "--where", "trajectory_turns > 1", "--dry-run"]) == 0
    assert "dropped with their trajectories" not in capsys.readouterr().out


def test_a_filtered_buffer_holds_whole_trajectories_byte_for_byte(buffer, tmp_path):
    result = filter_buffer(buffer, tmp_path / "out", "trajectory_end != TOKEN_BUDGET and trajectory_turns > 1")
    with open_store(str(buffer), mode="r") as src, open_store(str(tmp_path / "out"), mode="r") as out:
        source, kept = src.read(torch.arange(len(src))), out.read(torch.arange(len(out)))
    keep = np.isin(source["trajectory_id"].numpy(), [0, 2, 3])
    assert result.rows_kept == int(keep.sum()) == len(kept)
    assert kept.equal(source.select(torch.from_numpy(np.nonzero(keep)[0])))


def test_names_the_buffer_lacks_and_the_list_of_names(tmp_path, capsys):
    with pytest.raises(WhereError, match="does not store field 'termination_reason'"):
        parse_where("trajectory_end == MAX_TURNS", stored_fields=("reward", "trajectory_id"))
    with pytest.raises(WhereError, match="unknown name 'MAX_TURN'; did you mean 'MAX_TURNS'"):
        parse_where("trajectory_end == MAX_TURN")
    assert main(["filter", "--list-names"]) == 0
    listing = capsys.readouterr().out
    assert "trajectory_turns" in listing and f"MAX_TURNS = {int(R.MAX_TURNS)}" in listing


@pytest.fixture(params=["memmap", "zarr"])
def agent_buffer(request, tmp_path):
    path = tmp_path / "agent"
    schema = StoreSchema(optional=("termination_reason", "tool_calls", "tool_errors", "tool_error_kinds"))
    with create_store(path, request.param, schema, segment_rows=4) as store:
        store.append(multi_turn_rows(tool_counts=True))
    return path


def test_tool_statistics_select_whole_trajectories(agent_buffer):
    # per trajectory (calls, errors): (4, 0), (1, 1), (6, 0), (2, 0), (0, 0), (8, 1) -- see multi_turn_rows
    assert kept_trajectories(agent_buffer, "trajectory_tool_errors > 0") == {1: [0], 5: [0, 1, 2, 3, 4]}
    assert kept_trajectories(agent_buffer, "trajectory_tool_calls == 0") == {4: [0]}
    assert kept_trajectories(agent_buffer, "trajectory_tool_errors == 0 and trajectory_tool_calls >= 4") == {
        0: [0, 1, 2], 2: [0, 1, 2, 3]}
    assert kept_trajectories(agent_buffer, "trajectory_tool_errors / max(trajectory_tool_calls, 1) > 0.5") == {1: [0]}
    # the row values: a trajectory is kept only when every turn passes, so the one with a failed
    # call in its middle turn goes whole, not its other four turns
    assert kept_trajectories(agent_buffer, "tool_errors == 0") == {0: [0, 1, 2], 2: [0, 1, 2, 3], 3: [0, 1], 4: [0]}
    # by kind: the TOOL_ERROR trajectory's call was malformed, the 5-turn one's timed out
    assert kept_trajectories(agent_buffer, "not tool_error_timeout") == {0: [0, 1, 2], 1: [0], 2: [0, 1, 2, 3],
                                                                        3: [0, 1], 4: [0]}
    assert kept_trajectories(agent_buffer, "tool_error_malformed") == {1: [0]}


def test_tool_statistics_on_a_buffer_written_without_tool_counts(buffer):
    # a buffer from before the fields existed still opens and filters by everything else ...
    assert kept_trajectories(buffer, "trajectory_turns == 2") == {3: [0, 1]}
    # ... and a tool statistic is refused before any row is read, naming the missing field
    for name, field in (("trajectory_tool_errors", "tool_errors"), ("trajectory_tool_calls", "tool_calls"),
                        ("tool_errors", "tool_errors")):
        with pytest.raises(WhereError, match=f"uses '{name}', but this buffer does not store field '{field}'"):
            filter_buffer(buffer, None, f"{name} == 0")


def test_a_filtered_buffer_may_be_one_zip_file(buffer, tmp_path):
    archive = tmp_path / "kept.zip"
    with open_store(str(buffer), mode="r") as store:
        backend = store.backend_name
    if backend == "memmap":  # kept in the source's backend unless told
        with pytest.raises(ValueError, match="give --to zarr"):
            filter_buffer(buffer, archive, "trajectory_turns > 1")
        assert not archive.exists()
    result = filter_buffer(buffer, archive, "trajectory_turns > 1", to="zarr")
    assert archive.is_file() and result.stats.rows == result.rows_kept > 0
    with open_store(str(buffer), mode="r") as src, open_store(str(archive), mode="r") as out:
        source = src.read(torch.arange(len(src)))
        keep = np.isin(source["trajectory_id"].numpy(), [0, 2, 3, 5])
        assert out.read(torch.arange(len(out))).equal(source.select(torch.from_numpy(np.nonzero(keep)[0])))
