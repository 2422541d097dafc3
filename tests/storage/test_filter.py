"""``filter``: rows and whole groups kept by a condition, into a new buffer (storage/filtering.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import make_batch
from rlhf_pipeline.cli.main import main
from rlhf_pipeline.schema import StoreSchema, TrajectoryBatch
from rlhf_pipeline.storage import create_store, open_buffer, open_store
from rlhf_pipeline.storage.filtering import GroupTable, chunk_bounds, filter_buffer, select_positions
from rlhf_pipeline.storage.sharded import shard_path
from rlhf_pipeline.storage.where import WhereError

SCHEMA = StoreSchema(("advantage", "ref_log_probs"))


def curriculum_batch(i: int, *, shard: int = 0) -> TrajectoryBatch:
    """Four groups of 4: one all-correct (1.0), one all-wrong (0.0), two mixed."""
    base = shard << 40
    batch = make_batch(4, 4, seed=10 * shard + i, optional=SCHEMA.optional, first_group_id=base + 4 * i,
                       first_trajectory_id=base + 16 * i, policy_version=i)
    reward = torch.tensor([1.0] * 4 + [0.0] * 4 + [1.0, 0.0, 0.0, 1.0] + [0.5, 0.5, 0.5, 1.0])
    return batch.with_columns(reward=reward)


def fill(path, backend: str = "memmap", batches: int = 5, **options) -> TrajectoryBatch:
    written = [curriculum_batch(i) for i in range(batches)]
    with create_store(path, backend, SCHEMA, segment_rows=16, **options) as store:
        for batch in written:
            store.append(batch)
    return TrajectoryBatch.cat(written)


def kept_rows(everything: TrajectoryBatch, keep) -> TrajectoryBatch:
    return everything.select(torch.tensor([i for i in range(len(everything)) if keep(i)], dtype=torch.int64))


# ====================================================================== group statistics
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.sampled_from([0.0, 0.1, 0.3, 1.0, -2.5, 7.25])),
                min_size=1, max_size=60),
       st.lists(st.integers(1, 59), max_size=5))
def test_group_table_from_chunks_equals_direct_statistics(rows, cuts):
    groups = np.array([g for g, _ in rows], dtype=np.int64)
    rewards = np.array([r for _, r in rows], dtype=np.float32)
    edges = [0, *sorted({c for c in cuts if c < len(rows)}), len(rows)]
    partials = [GroupTable.of_chunk(groups[a:b], rewards[a:b]) for a, b in zip(edges[:-1], edges[1:]) if b > a]
    table = GroupTable.combine(partials)
    stats = table.columns_for(groups)
    for g in np.unique(groups):
        mine = rewards[groups == g].astype(np.float64)
        at = groups == g
        assert (stats["group_size"][at] == mine.size).all()
        np.testing.assert_allclose(stats["group_reward_mean"][at], mine.mean(), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(stats["group_reward_std"][at], mine.std(), rtol=1e-9, atol=1e-12)
        assert (stats["group_reward_min"][at] == mine.min()).all() and (stats["group_reward_max"][at] == mine.max()).all()
        if (mine == mine[0]).all():  # all equal: exactly zero, so "std > 0" never keeps such a group
            assert (stats["group_reward_std"][at] == 0.0).all()


def unit_starts(store) -> set[int]:
    """Where the store's storage units start, by its own account (segments of 16 rows here)."""
    if hasattr(store, "unit_bounds"):
        return {start for start, _ in store.unit_bounds()}
    return set(range(0, len(store), 16))


def test_chunks_follow_storage_units_and_cover_every_row(tmp_path):
    fill(tmp_path / "b", batches=5)  # 80 rows, segments of 16
    with open_store(tmp_path / "b") as store:
        bounds = chunk_bounds(store, len(store), chunk_rows=20)
        assert bounds[0][0] == 0 and bounds[-1][1] == 80
        assert all(a == b for (_, a), (b, _) in zip(bounds[:-1], bounds[1:]))
        assert {start for start, _ in bounds} <= unit_starts(store)  # a chunk never splits a unit
        assert all(b - a >= 20 for a, b in bounds[:-1])  # small units are merged up to chunk_rows


# ====================================================================== the new buffer
@pytest.mark.parametrize(("backend", "to"), [("memmap", None), ("zarr", None), ("memmap", "zarr")])
def test_kept_rows_are_byte_identical_in_source_order(tmp_path, backend, to):
    everything = fill(tmp_path / "src", backend)
    result = filter_buffer(tmp_path / "src", tmp_path / "dst", "group_reward_std > 0", to=to)
    expected = kept_rows(everything, lambda i: i % 16 >= 8)  # the two mixed groups of every batch
    assert (result.rows_in, result.rows_kept, result.groups_in, result.groups_kept) == (80, 40, 20, 10)
    with open_store(tmp_path / "dst") as out:
        assert out.backend_name == (to or backend)
        assert out.schema == SCHEMA and out.segment_rows == 16
        assert out.read(torch.arange(len(out))).equal(expected)
    assert result.stats.rows == 40
    assert not (tmp_path / "dst.partial").exists()
    with open_store(tmp_path / "src") as src:  # the source is untouched
        assert src.read(torch.arange(len(src))).equal(everything)


def test_curriculum_conditions_drop_equal_and_all_correct_groups(tmp_path):
    everything = fill(tmp_path / "src")
    result = filter_buffer(tmp_path / "src", tmp_path / "not_solved", "group_reward_min < 1 and policy_version >= 2")
    with open_store(tmp_path / "not_solved") as out:
        expected = kept_rows(everything, lambda i: i // 16 >= 2 and not i % 16 < 4)
        assert out.read(torch.arange(len(out))).equal(expected)
    assert result.groups_kept == 9
    rows = filter_buffer(tmp_path / "src", None, "reward == 1 and response_length <= 10")
    lengths = everything["response_tokens"].lengths()
    assert rows.output == "count" and rows.rows_kept == int(((everything["reward"] == 1) & (lengths <= 10)).sum())


def test_whole_groups_keeps_a_group_only_when_every_row_matches(tmp_path):
    everything = fill(tmp_path / "src", batches=2)
    lengths = everything["response_tokens"].lengths()
    groups = everything["group_id"]
    chosen = select_positions(open_buffer(tmp_path / "src"), "response_length > 5", whole_groups=True)
    ok = {int(g) for g in torch.unique(groups) if bool((lengths[groups == g] > 5).all())}
    assert chosen.positions.tolist() == [i for i in range(len(everything)) if int(groups[i]) in ok]
    assert chosen.groups_kept == len(ok)
    rowwise = select_positions(open_buffer(tmp_path / "src"), "response_length > 5")
    assert rowwise.positions.tolist() == torch.nonzero(lengths > 5).reshape(-1).tolist()


def test_a_sharded_run_buffer_filters_into_one_store(tmp_path):
    buffer = tmp_path / "buffer"
    written = {}
    for shard in (0, 1):
        with create_store(shard_path(buffer, shard), "memmap", SCHEMA, segment_rows=8) as store:
            batches = [curriculum_batch(i, shard=shard) for i in range(2)]
            for b in batches:
                store.append(b)
            written[shard] = TrajectoryBatch.cat(batches)
    filter_buffer(buffer, tmp_path / "out", "group_reward_std > 0 and collector == 1")
    with open_store(tmp_path / "out") as out:
        assert out.read(torch.arange(len(out))).equal(kept_rows(written[1], lambda i: i % 16 >= 8))


def test_nothing_is_written_for_a_bad_expression_or_an_existing_destination(tmp_path):
    fill(tmp_path / "src", batches=1)
    with pytest.raises(WhereError, match="unknown name 'rewards'; did you mean 'reward'"):
        filter_buffer(tmp_path / "src", tmp_path / "dst", "rewards > 0")
    assert not (tmp_path / "dst").exists() and not (tmp_path / "dst.partial").exists()
    kept = fill(tmp_path / "other", batches=2)
    with pytest.raises(FileExistsError, match="choose a new path"):
        filter_buffer(tmp_path / "src", tmp_path / "other", "reward > 0")
    with open_store(tmp_path / "other") as other:
        assert other.read(torch.arange(len(other))).equal(kept)


def test_an_interrupted_copy_leaves_no_destination(tmp_path):
    fill(tmp_path / "src", batches=5)

    def interrupt(stage, done, total):
        if stage == "copy" and done < total:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        filter_buffer(tmp_path / "src", tmp_path / "dst", "reward >= 0", chunk_rows=16, progress=interrupt)
    assert not (tmp_path / "dst").exists() and not (tmp_path / "dst.partial").exists()
    filter_buffer(tmp_path / "src", tmp_path / "dst", "reward >= 0", chunk_rows=16)  # and again, complete
    with open_store(tmp_path / "dst") as out:
        assert len(out) == 80


def test_a_destination_inside_the_source_or_any_buffer_is_refused_and_nothing_is_written(tmp_path, capsys):
    """``filter RUN/buffer RUN/buffer/shard-0001`` once made a shard of the run's own buffer holding
    every kept row again (its learner then trained them twice)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "settings.json").write_text("{}")
    fill(run / "buffer" / "shard-0000", batches=2)
    fill(tmp_path / "other", batches=1)
    refused = [
        (run / "buffer", run / "buffer" / "shard-0001", "is inside .*buffer, the buffer being filtered"),
        (run / "buffer" / "shard-0000", run / "buffer" / "shard-0000" / "kept", "the buffer being filtered"),
        (tmp_path / "other", run / "buffer" / "shard-0002", "is inside the buffer .*run/buffer: a store written there"),
        (tmp_path / "other", tmp_path / "other" / "sel", "the buffer being filtered"),
    ]
    for src, dst, message in refused:
        for extra in ([], ["--selection"]):
            assert main(["filter", str(src), str(dst), "--quiet", *extra, "--where", "reward >= 0"]) == 2
            err = capsys.readouterr().err
            assert re.search(message, err) and len(err.strip().splitlines()) == 1, err
            assert not dst.exists() and not Path(f"{dst}.partial").exists()
    with open_buffer(run / "buffer") as union:
        assert len(union) == 32  # shard-0000's rows, once
    assert main(["filter", str(run / "buffer"), str(tmp_path / "kept"), "--quiet", "--where", "reward >= 0"]) == 0


def test_a_second_filter_into_the_same_destination_is_refused_in_one_line(tmp_path, capsys):
    """Two filters racing into one DST: the second deleted the first's DST.partial and one of them
    died with an OSError traceback. Now the one building holds DST.partial; the other is refused."""
    everything = fill(tmp_path / "src", batches=5)
    second = {}

    def run_second(stage, done, total):
        if stage == "copy" and not second:  # the first is building DST.partial now
            second["rc"] = main(["filter", str(tmp_path / "src"), str(tmp_path / "dst"), "--quiet", "--where",
                                 "reward >= 0"])
            second["err"] = capsys.readouterr().err

    filter_buffer(tmp_path / "src", tmp_path / "dst", "reward >= -10", chunk_rows=16, progress=run_second)
    assert second["rc"] == 2 and "another filter is writing" in second["err"], second
    assert len(second["err"].strip().splitlines()) == 1
    with open_store(tmp_path / "dst") as out:
        assert out.read(torch.arange(len(out))).equal(everything)  # the first one's rows, whole
    assert main(["filter", str(tmp_path / "src"), str(tmp_path / "dst"), "--quiet", "--where", "reward >= 0"]) == 2
    assert "exists" in capsys.readouterr().err


def test_what_a_killed_filter_left_in_the_partial_is_cleared_by_the_next(tmp_path):
    everything = fill(tmp_path / "src", batches=2)
    leftover = tmp_path / "dst.partial"
    fill(leftover, batches=1)  # a killed filter's half-built store: no process holds it
    filter_buffer(tmp_path / "src", tmp_path / "dst", "reward >= -10")
    assert not leftover.exists()
    with open_store(tmp_path / "dst") as out:
        assert out.read(torch.arange(len(out))).equal(everything)


# ====================================================================== the command
def test_filter_command_counts_writes_and_explains_errors(tmp_path, capsys):
    fill(tmp_path / "src", batches=2)
    assert main(["filter", str(tmp_path / "src"), "--dry-run", "--json", "--where", "group_reward_std > 0"]) == 0
    counted = json.loads(capsys.readouterr().out)
    assert (counted["rows_in"], counted["rows_kept"], counted["groups_kept"]) == (32, 16, 4)
    assert main(["filter", str(tmp_path / "src"), str(tmp_path / "sel"), "--selection", "--quiet",
                 "--where", "group_reward_std > 0"]) == 0
    assert "a selection of" in capsys.readouterr().out
    assert main(["filter", str(tmp_path / "src"), str(tmp_path / "z"), "--to", "zarr", "--codec", "zstd", "--quiet",
                 "--groups", "--where", "policy_version == 1"]) == 0
    assert "zarr buffer, 16 rows" in capsys.readouterr().out
    assert main(["filter", str(tmp_path / "src"), str(tmp_path / "x"), "--where", "reward.imag > 0"]) == 2
    assert "Attribute at column 1 is not allowed" in capsys.readouterr().err
    assert main(["filter", str(tmp_path / "src"), "--where", "reward > 0"]) == 2
    assert "--dry-run" in capsys.readouterr().err
    assert main(["filter", "--list-names"]) == 0
    assert "group_reward_std" in capsys.readouterr().out


def test_rows_are_read_by_id_so_a_growing_shard_or_eviction_changes_nothing(tmp_path):
    from rlhf_pipeline.storage.row_keys import keys_of, parts_of, positions_of, read_by_position

    buffer = tmp_path / "buffer"
    writers = [create_store(shard_path(buffer, k), "memmap", SCHEMA, segment_rows=8) for k in (0, 1)]
    for k, w in enumerate(writers):
        w.append(curriculum_batch(0, shard=k))
    union = open_buffer(buffer)
    snapshot = parts_of(union)
    positions = np.array([20, 3, 17])  # two rows of shard 1, one of shard 0
    before = union.read(torch.from_numpy(positions))
    parts, ids = keys_of(union, positions, snapshot)
    writers[0].append(curriculum_batch(1))  # shard 0 grows: shard 1's positions move by 16
    union.refresh()
    assert not union.read(torch.from_numpy(positions)).equal(before)
    assert read_by_position(snapshot, positions).equal(before)
    assert positions_of(union, parts, ids).tolist() == [36, 3, 33]
    for w in writers:
        w.close()
    union.close()
