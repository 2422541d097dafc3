"""``rlhf-pipeline inspect`` on real buffers: the table, the JSON, the errors, and no torch import."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import make_batch
import preloaded

from rlhf_pipeline.cli.main import main
from rlhf_pipeline.storage.memmap import MemmapTrajectoryStore


def test_inspect_prints_json_and_a_table(tmp_path, capsys):
    path = tmp_path / "buffer"
    with MemmapTrajectoryStore.create(path, segment_rows=8) as store:
        store.append(make_batch(2, 4, policy_version=3))
        store.append(make_batch(1, 4, seed=1, first_group_id=2, policy_version=4))
        expected = store.stats()
        # the writer is still open: inspect takes no lock
        assert main(["inspect", str(path), "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
    assert data["rows"] == 12 and data["groups"] == 3 and data["segments"] == 2
    assert data["policy_versions"] == {"3": 8, "4": 4}
    assert data["response_tokens"] == expected.response_tokens
    assert data["disk_bytes_per_raw_byte"] == expected.bytes_on_disk / expected.raw_bytes
    assert main(["inspect", str(path)]) == 0
    table = capsys.readouterr().out
    assert "rows held" in table and "v3: 8, v4: 4" in table and "memmap" in table and "disk/raw" in table


def test_many_policy_versions_are_summarized_and_ordered_as_numbers(tmp_path, capsys):
    path = tmp_path / "buffer"
    versions = [0, 1, 2, 3, 9, 10, 11, 30, 100, 101]
    with MemmapTrajectoryStore.create(path, segment_rows=8) as store:
        for i, version in enumerate(versions):
            store.append(make_batch(1, 2, seed=i, first_group_id=i, first_trajectory_id=2 * i, policy_version=version))
    assert main(["inspect", str(path), "--json"]) == 0
    raw = capsys.readouterr().out
    assert list(json.loads(raw)["policy_versions"]) == [str(v) for v in versions]  # 100 after 30, not after 10
    assert main(["inspect", str(path)]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("policy versions"))
    assert "10 versions (v0-v3, v9-v11, v30, v100-v101)" in line and "v9: 2" not in line


def test_inspect_of_a_non_buffer_or_a_missing_path_says_so_in_one_line(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    assert "is not a replay buffer" in capsys.readouterr().err
    # the directory of runs (`inspect storage`): "not a replay buffer" did not say what it is instead
    for name in ("default", "tool_use", "a", "b", "c"):
        (tmp_path / "home" / name / "buffer").mkdir(parents=True)
    for command in ("inspect", "export"):
        assert main([command, str(tmp_path / "home"), *([str(tmp_path / "x.jsonl")] if command == "export" else [])]) == 2
        err = capsys.readouterr().err.strip()
        assert err.endswith(f"{tmp_path / 'home'} is a directory of runs (a, b, c, default and 1 more), not a buffer: "
                            f"give one of them, e.g. {tmp_path / 'home' / 'a'}"), err
    missing = tmp_path / "no" / "such" / "buffer"
    for command in (["inspect", str(missing)], ["inspect", str(missing), "--verify"], ["repair", str(missing)],
                    ["convert", str(missing), str(tmp_path / "out"), "--to", "zarr"]):
        assert main(command) == 2, command
        err = capsys.readouterr().err
        assert err.strip().count("\n") == 0 and f"{missing} does not exist" in err, (command, err)


def test_inspect_of_a_run_whose_first_start_wrote_only_its_holder_file_says_what_it_is(tmp_path, capsys):
    """A ``run`` takes its directory (``run.lock``) first and writes ``settings.json`` after its checks:
    between them, or killed there, the directory is a run not started, not a buffer that is not one."""
    from rlhf_pipeline.files.run_paths import RunPaths
    from rlhf_pipeline.runs.run_directory import hold_run_directory

    with hold_run_directory(RunPaths(tmp_path / "r"), "run"):
        assert main(["inspect", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "has not written its settings.json (only its run.lock" in err, err
    assert "is not a replay buffer" not in err and f"or delete {tmp_path / 'r'}" in err


def test_inspect_imports_no_torch(tmp_path):
    path = tmp_path / "buffer"
    with MemmapTrajectoryStore.create(path, segment_rows=8) as store:
        store.append(make_batch(2, 4))
    script = ("import sys\nfrom rlhf_pipeline.cli.main import main\n"
              f"assert main(['inspect', {str(path)!r}]) == 0\nassert main(['inspect', {str(path)!r}, '--verify']) == 0\n"
              "heavy = [m for m in ('torch', 'tensordict', 'torchrl', 'transformers') if m in sys.modules]\n"
              "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True)


def test_output_into_a_closed_pipe_ends_quietly(tmp_path):
    """``rlhf-pipeline inspect BUF | head -1``: the reader leaves early; no BrokenPipeError traceback."""
    path = tmp_path / "buffer"
    with MemmapTrajectoryStore.create(path, segment_rows=8) as store:
        store.append(make_batch(2, 4))
    for command in (["inspect", str(path)], ["filter", "--list-names"]):
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader is gone before anything is written
        try:
            done = preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", *command], stdout=write_end,
                                 stderr=subprocess.PIPE, text=True, timeout=120)
        finally:
            os.close(write_end)
        assert done.returncode == 1 and done.stderr == "", (command, done.stderr)


def test_disk_to_raw_ratio_is_described_by_its_value():
    from rlhf_pipeline.cli.inspect_cmd import describe_ratio

    assert describe_ratio(1.624) == "1.624  (the files take 62% more than the raw payload)"
    assert describe_ratio(0.412) == "0.412  (the files take 59% less than the raw payload: compressed)"
    assert describe_ratio(12.894) == "12.894  (the files take 12.9 times the raw payload)"
    assert describe_ratio(1.0) == "1.000  (the files take what the raw payload does)"
    assert describe_ratio(float("nan")) == "-"
    assert describe_ratio(0.412, "the objects") == "0.412  (the objects take 59% less than the raw payload: compressed)"


def test_multi_turn_trajectories_are_counted_with_how_they_ended(tmp_path, capsys):
    """Every backend, a run's shards and a selection report the same trajectories; with no torch."""
    from helpers import TRAJECTORIES, multi_turn_rows

    from rlhf_pipeline.schema import StoreSchema
    from rlhf_pipeline.storage import create_store
    from rlhf_pipeline.storage.filtering import filter_buffer
    from rlhf_pipeline.storage.sharded import shard_path

    schema = StoreSchema(optional=("termination_reason",))
    for backend in ("memmap", "zarr"):
        with create_store(tmp_path / backend, backend, schema, segment_rows=4) as store:
            store.append(multi_turn_rows())
    run_buffer = tmp_path / "run_buffer"  # two collectors' shards, trajectory ids apart
    for shard, backend in enumerate(("memmap", "zarr")):
        with create_store(shard_path(run_buffer, shard), backend, schema, segment_rows=4) as store:
            store.append(multi_turn_rows(first_trajectory=shard << 40))
    filter_buffer(tmp_path / "zarr", tmp_path / "long.sel", "trajectory_turns >= 3", selection=True)

    turns = [t for t, _, _ in TRAJECTORIES]
    ended = {}
    for _, reason, _ in TRAJECTORIES:
        ended[reason.name] = ended.get(reason.name, 0) + 1
    for location, copies in (("memmap", 1), ("zarr", 1), ("run_buffer", 2)):
        assert main(["inspect", str(tmp_path / location), "--json"]) == 0
        got = json.loads(capsys.readouterr().out)["trajectories"]
        assert got == {"count": 6 * copies, "multi_turn": 4 * copies, "turns_max": 5,
                       "turns_mean": sum(turns) / 6, "ended": {k: n * copies for k, n in sorted(ended.items())}}
    assert main(["inspect", str(tmp_path / "long.sel"), "--json"]) == 0
    selected = json.loads(capsys.readouterr().out)["trajectories"]
    assert selected["count"] == 3 and selected["ended"] == {"ENV_DONE": 1, "MAX_TURNS": 1, "TOKEN_BUDGET": 1}
    assert main(["inspect", str(tmp_path / "memmap")]) == 0
    assert "6  (4 of several turns; turns mean 2.67, max 5); ended: ENV_DONE 3" in capsys.readouterr().out

    script = ("import sys\nfrom rlhf_pipeline.cli.main import main\n"
              f"assert main(['inspect', {str(tmp_path / 'zarr')!r}]) == 0\n"
              "heavy = [m for m in ('torch', 'tensordict', 'torchrl', 'transformers') if m in sys.modules]\n"
              "assert not heavy, heavy\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0 and "TOOL_ERROR 1" in done.stdout, done.stderr[-2000:]


def test_agent_buffers_report_their_tool_calls_and_failures(tmp_path, capsys):
    """Per-turn tool counts summed per store, per run of shards and per selection; absent without them."""
    from helpers import multi_turn_rows

    from rlhf_pipeline.schema import StoreSchema
    from rlhf_pipeline.storage import create_store
    from rlhf_pipeline.storage.filtering import filter_buffer
    from rlhf_pipeline.storage.sharded import shard_path

    schema = StoreSchema(optional=("termination_reason", "tool_calls", "tool_errors", "tool_error_kinds"))
    run_buffer = tmp_path / "run_buffer"
    for shard, backend in enumerate(("memmap", "zarr")):
        with create_store(shard_path(run_buffer, shard), backend, schema, segment_rows=4) as store:
            store.append(multi_turn_rows(first_trajectory=shard << 40, tool_counts=True))
    filter_buffer(shard_path(run_buffer, 1), tmp_path / "failed.sel", "trajectory_tool_errors > 0", selection=True)
    # per trajectory (calls, errors): (4, 0), (1, 1), (6, 0), (2, 0), (0, 0), (8, 1) -- see multi_turn_rows
    one_store = {"tool_calls": 21, "with_tool_calls": 5, "tool_errors": 2, "with_tool_errors": 2,
                 "tool_error_turns": {"malformed": 1, "timeout": 1}}
    for location, expected in ((shard_path(run_buffer, 0), one_store), (shard_path(run_buffer, 1), one_store),
                               (run_buffer, {"tool_calls": 42, "with_tool_calls": 10, "tool_errors": 4,
                                             "with_tool_errors": 4, "tool_error_turns": {"malformed": 2, "timeout": 2}}),
                               (tmp_path / "failed.sel", {"tool_calls": 9, "with_tool_calls": 2, "tool_errors": 2,
                                                          "with_tool_errors": 2,
                                                          "tool_error_turns": {"malformed": 1, "timeout": 1}})):
        assert main(["inspect", str(location), "--json"]) == 0
        got = json.loads(capsys.readouterr().out)["trajectories"]
        assert {k: got[k] for k in expected} == expected, location
    assert main(["inspect", str(run_buffer)]) == 0
    assert ("tool calls 42 in 10 trajectories, failed 4 in 4 trajectories (turns failing by kind: malformed 2, "
            "timeout 2)") in capsys.readouterr().out

    with create_store(tmp_path / "old", "memmap", StoreSchema(optional=("termination_reason",))) as store:
        store.append(multi_turn_rows())
    assert main(["inspect", str(tmp_path / "old"), "--json"]) == 0
    assert "tool_calls" not in json.loads(capsys.readouterr().out)["trajectories"]


def test_inspect_of_a_run_lists_its_rewind_points_parent_and_branches(tmp_path, capsys):
    import torch

    from rlhf_pipeline.learn.checkpoint import CheckpointManager, Progress

    run = tmp_path / "parent"
    with MemmapTrajectoryStore.create(run / "buffer", segment_rows=8) as store:
        store.append(make_batch(2, 4, policy_version=0))
    checkpoints = CheckpointManager(run / "checkpoints", keep_last=1, keep_every=2)
    for step in (1, 2, 3):
        checkpoints.save(Progress(seed=0, step=step, policy_version=step), {"w": torch.zeros(1)},
                         record={"buffer_rows": {"": 4 * step}})
    (tmp_path / "child").mkdir()
    (tmp_path / "child" / "parent-rows").mkdir()  # a branch of a run with collectors reads the parent's rows
    (tmp_path / "child" / "parent-rows" / "selection.json").write_text("{}")
    (tmp_path / "child" / "branch.json").write_text(json.dumps({"parent": str(run), "step": 2,
                                                                "buffer_rows": {"": 8}}))
    assert main(["inspect", str(run), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(p["step"], p["buffer_rows"]) for p in data["run"]["rewind_points"]] == [(2, {"": 8}), (3, {"": 12})]
    assert data["run"]["branches"] == [{"run": str(tmp_path / "child"), "step": 2, "parent_rows": {"": 8},
                                        "reads": None, "detached": False}]
    assert data["run"]["parent"] is None and data["buffer"]["rows"] == 8
    assert main(["inspect", str(run)]) == 0
    table = capsys.readouterr().out
    assert "step 2  policy version 2  buffer rows store=8" in table
    assert "(from step 2; reads the parent's rows below store=8)" in table
    assert "rows held" in table  # then the buffer's table
