"""``collect`` and ``learn`` as separate processes sharing one run directory; stop and resume;
several collectors (one buffer shard each) feeding one learner."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import kill_when, run_child_pids

from rlhf_pipeline.cli.main import main
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.storage import ShardedStoreReader, create_store, open_buffer, open_store
from rlhf_pipeline.storage.sharded import list_shards
from rlhf_pipeline.storage.writer_state import decode

REPO = Path(__file__).resolve().parents[2]
DEFAULT = str(REPO / "pipelines" / "default.py")
SMALL = ["--set", "warm_start_steps=5", "--set", "prompts_per_round=4", "--set", "group_size=4",
         "--set", "learner.batch_size=16", "--set", "learner.sample_window=32",
         "--set", "learner.new_rows_per_step=16", "--set", "learner.checkpoint_every=2"]


def start(command: str, home: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "rlhf_pipeline.cli.main", command, DEFAULT, "--home", str(home),
         "--run-name", "shared", *SMALL, *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def finish(process: subprocess.Popen, timeout: float = 300) -> str:
    out, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, out[-3000:]
    return out


def test_collector_and_learner_processes_share_a_buffer_and_resume(tmp_path, capfd):
    run = tmp_path / "shared"
    collector = start("collect", tmp_path)
    learner = start("learn", tmp_path, "--steps", "3")
    finish(learner)
    collector_out = finish(collector)  # ends by itself: the learner wrote STOP when done
    assert "[collector] stopped after" in collector_out

    with open_buffer(run / "buffer", mode="r") as store:
        versions = store.read(torch.arange(len(store)))["policy_version"]
    assert int(versions.max()) >= 1  # the collector picked up weights the learner published

    # resume without a collector: offline replay over the recorded buffer, from step 3 to 5. In this
    # process, as the refusal below: what the learner resumes from is on disk, and each CLI start
    # would only import torch again
    learn = ["learn", DEFAULT, "--home", str(tmp_path), "--run-name", "shared", *SMALL]
    capfd.readouterr()
    assert main([*learn, "--steps", "5", "--set", "learner.sampler=window", "--set", "learner.new_rows_per_step=0",
                 "--set", "max_lag=none"]) == 0
    learner_out = "".join(capfd.readouterr())
    assert "resuming from" in learner_out and "(step 3)" in learner_out
    assert "learner settings changed" in learner_out
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4, 5]

    # settings that define the data may not change under an existing run
    assert main([*learn, "--steps", "6", "--set", "group_size=8"]) == 2
    out = "".join(capfd.readouterr())
    assert "group_size: was 4, now 8" in out and "--run-name" in out


def test_two_collectors_feed_one_learner_through_buffer_shards(tmp_path):
    """``run --collectors 2``: collector k writes buffer/shard-k, the learner samples both.

    The window sampler makes no draw while a shard is empty, so even its first steps use both
    collectors' rows; the exact sampler takes what the shards hold (tests/learn/test_exact_sampler.py).
    """
    result = subprocess.run(
        [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--collectors", "2", "--steps", "4",
         "--home", str(tmp_path), "--run-name", "two", *SMALL, "--set", "learner.sampler=window"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "two"
    # clean shutdown: the learner finished, wrote STOP, and both collectors ended on it
    assert "[run] done: 4 learner steps" in result.stderr
    # named alike: each of several by its index (collector 0 once said "[collector]" beside "[collector 1]")
    assert "[collector 0] stopped after" in result.stderr and "[collector 1] stopped after" in result.stderr
    assert "[collector] " not in result.stderr
    assert (run / "STOP").exists()

    # each collector wrote its own shard, with ids that carry its index, and kept its own state
    assert [k for k, _ in list_shards(run / "buffer")] == [0, 1]
    for k, path in list_shards(run / "buffer"):
        with open_store(path, mode="r") as shard:
            assert len(shard) > 0 and len(shard) % 4 == 0
            ids = shard.read(torch.arange(len(shard)), fields=("group_id", "trajectory_id"))
            assert bool((ids["group_id"] >> 40 == k).all()) and bool((ids["trajectory_id"] >> 40 == k).all())
            assert decode(shard.writer_state, path)["writer"]["config"]["collector_index"] == k  # its own state

    # the learner's union: ids unique across shards, whole groups of 4
    with open_buffer(run / "buffer", mode="r") as union:
        rows = union.read(torch.arange(len(union)), fields=("group_id", "trajectory_id", "policy_version"))
    assert rows["trajectory_id"].unique().numel() == len(rows)
    assert rows["group_id"].unique().numel() * 4 == len(rows)
    assert int(rows["policy_version"].max()) >= 1  # collectors picked up published weights

    # and it trained on rows of both collectors
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert max(r["charts/collectors_in_batch"] for r in records) == 2


def test_a_second_collector_with_a_live_ones_index_is_refused_in_one_line(tmp_path, capsys):
    """``collect --collector-index 0`` beside a live collector 0 printed a StoreLockedError traceback
    (exit 1) with Python advice (``mode='r'``); every other refusal is one line, exit 2."""
    from rlhf_pipeline.storage.locking import WriterLock

    argv = ["collect", DEFAULT, "--home", str(tmp_path), "--run-name", "shared", *SMALL, "--steps", "1"]
    shard = tmp_path / "shared" / "buffer" / "shard-0000"
    create_store(shard, "memmap").close()  # collector 0's shard, as a first collector made it
    with WriterLock(shard / "writer.lock"):  # held by collector 0 while it runs
        assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("[")]  # the start's own log lines
    assert len(lines) == 1 and "Traceback" not in err, err
    assert re.search(rf"collector 0 of this run is already running: process {os.getpid()} on .* writes "
                     rf".*shard-0000.*another --collector-index", lines[0]), lines
    assert "mode=" not in lines[0]
    # a store error no command words itself (here a damaged shard) is one line too, not a traceback
    (shard / "manifest.json").write_bytes(b"{")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and re.search(r"collect: error: .*shard-0000.*manifest.json", err), err


def test_single_store_buffers_of_older_runs_keep_one_collector(tmp_path):
    """A run made before shards keeps ``buffer/`` as one store and ``collector/state.pt``."""
    from rlhf_pipeline.pipeline import RunPaths, load_pipeline_module, make_settings
    from rlhf_pipeline.runs.processes import build_pipeline
    from rlhf_pipeline.runs.run_directory import prepare_run, RunError

    module = load_pipeline_module(DEFAULT)
    paths = RunPaths(tmp_path / "old")
    pipeline = build_pipeline(module, make_settings(module, ["warm_start_steps=0"]), paths)
    pipeline.create_buffer(paths.buffer).close()  # the old layout
    prepare_run(pipeline, paths, shards=(0,))
    assert paths.single_store_buffer and not list_shards(paths.buffer)
    assert paths.collector_state(0) == paths.root / "collector" / "state.pt"
    with open_buffer(paths.buffer) as store:
        assert not isinstance(store, ShardedStoreReader)
    with pytest.raises(RunError, match=r"single-store buffer .* collector\(s\) \[1\] need a new run"):
        prepare_run(pipeline, paths, shards=(0, 1))

    new = RunPaths(tmp_path / "new")
    prepare_run(build_pipeline(module, make_settings(module, ["warm_start_steps=0"]), new), new, shards=(0, 1))
    assert [k for k, _ in list_shards(new.buffer)] == [0, 1] and not new.single_store_buffer
    assert new.collector_state(1) == new.root / "collector" / "shard-0001.pt"


@pytest.mark.parametrize("backend", ["memmap", "zarr"])
def test_a_start_killed_while_making_a_shard_leaves_nothing_taken_for_a_shard(tmp_path, backend):
    """A shard is made as ``shard-NNNN.creating`` and renamed into place: what a start killed
    midway leaves (here: a store made but never renamed, without its commit record) is not a
    shard to readers, and the next start makes the shard afresh."""
    from rlhf_pipeline.pipeline import RunPaths, load_pipeline_module, make_settings
    from rlhf_pipeline.runs.processes import build_pipeline
    from rlhf_pipeline.runs.run_directory import prepare_run
    from rlhf_pipeline.storage import detect_backend

    module = load_pipeline_module(DEFAULT)
    paths = RunPaths(tmp_path / "run")
    pipeline = build_pipeline(module, make_settings(module, ["warm_start_steps=0", f"buffer_backend={backend}"]),
                              paths)
    leftover = paths.buffer / "shard-0000.creating"
    pipeline.create_buffer(leftover).close()
    record = {"memmap": "manifest.json", "zarr": "zarr.json"}[backend]
    assert (leftover / record).exists()
    (leftover / record).unlink()  # killed before the store was complete
    assert list_shards(paths.buffer) == []

    prepare_run(pipeline, paths, shards=(0,))
    assert not leftover.exists()
    assert [k for k, _ in list_shards(paths.buffer)] == [0]
    assert detect_backend(str(paths.shard(0))) == backend
    with open_store(str(paths.shard(0)), mode="a") as store:
        assert len(store) == 0
    with open_buffer(paths.buffer) as union:
        assert len(union) == 0


def test_settings_added_to_a_pipeline_since_a_run_started_keep_their_default(tmp_path):
    """A resumed run whose settings.json predates a new setting: the default is no change."""
    import json

    from rlhf_pipeline.pipeline import RunPaths, load_pipeline_module, make_settings
    from rlhf_pipeline.runs.processes import build_pipeline
    from rlhf_pipeline.runs.run_directory import prepare_run, RunError

    module = load_pipeline_module(DEFAULT)
    paths = RunPaths(tmp_path / "run")
    prepare_run(build_pipeline(module, make_settings(module, ["warm_start_steps=0"]), paths), paths)
    saved = json.loads(paths.settings_file.read_text())
    del saved["buffer_backend"]  # as written before the setting existed
    paths.settings_file.write_text(json.dumps(saved))

    prepare_run(build_pipeline(module, make_settings(module, ["warm_start_steps=0"]), paths), paths)
    changed = build_pipeline(module, make_settings(module, ["warm_start_steps=0", "buffer_backend=zarr"]), paths)
    with pytest.raises(RunError, match="buffer_backend: was None, now 'zarr'"):
        prepare_run(changed, paths)


def test_a_collector_killed_mid_run_of_a_sharded_zarr_buffer_resumes_exactly(tmp_path):
    """kill -9 of collector 1 stops the run; the same command resumes; no round is lost or doubled."""
    from rlhf_pipeline.storage import ShardedStoreReader

    command = [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--collectors", "2",
               "--home", str(tmp_path), "--run-name", "crash", *SMALL, "--set", "buffer_backend=zarr"]
    run = tmp_path / "crash"
    first = subprocess.Popen([*command, "--steps", "50"], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    out = kill_when(first, lambda: (run / "metrics.jsonl").exists() and len(read_metrics(run / "metrics.jsonl")) >= 3,
                    victims=lambda: run_child_pids("collect-1", str(run.parent), "crash"), timeout=240)
    assert first.returncode != 0 and "collector 1 exited early" in out, out[-3000:]
    stopped_at = read_metrics(run / "metrics.jsonl")[-1]["step"]

    resumed = subprocess.run([*command, "--steps", str(stopped_at + 3)], cwd=REPO, capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(1, stopped_at + 4))

    with open_buffer(run / "buffer", mode="r") as union:
        assert isinstance(union, ShardedStoreReader)
        assert {type(s).__name__ for s in union.shards.values()} == {"ZarrTrajectoryStore"}
    for k, path in list_shards(run / "buffer"):
        with open_store(path, mode="r") as shard:
            ids = shard.read(torch.arange(len(shard)), fields=("trajectory_id", "group_id"))
        local = (ids["trajectory_id"] - (k << 40)).tolist()
        # every round exactly once: the ids the collector handed out, in order, without a gap
        assert local == list(range(len(local))), (k, local)
        groups = (ids["group_id"] - (k << 40)).tolist()
        assert groups == [i // 4 for i in range(len(groups))], k


def test_run_with_two_learner_ranks_writes_one_set_of_files(tmp_path):
    """``learner.world_size=2``: run starts two learner ranks beside the collector; rank 0 alone
    writes metrics, weights and checkpoints, and both ranks train on rank 0's draws of the live buffer."""
    done = subprocess.run(
        [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--steps", "3", "--home", str(tmp_path),
         "--run-name", "ranks", *SMALL, "--set", "learner.world_size=2"],
        cwd=REPO, capture_output=True, text=True, timeout=400, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    run = tmp_path / "ranks"
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3]  # one line a step: rank 0's
    assert all(r["charts/rows"] == 16 for r in read_metrics(run / "metrics.jsonl"))  # both ranks' rows
    from rlhf_pipeline.learn.checkpoint import CheckpointManager
    from rlhf_pipeline.coordination.weights import latest_version

    assert CheckpointManager(run / "checkpoints").latest_step() == 3 and latest_version(run) == 3
    assert done.stderr.count("[run] done: 3 learner steps") == 1


def test_a_resumed_collector_numbers_its_rounds_on_from_where_it_stopped(tmp_path, capsys):
    """Every 50th round is said; a collector resumed after 30 rounds says round 50 after 20 more
    (it once counted again from 1: its 20th round then, nothing said)."""
    argv = ["collect", DEFAULT, "--home", str(tmp_path), "--run-name", "rounds", "--set", "warm_start_steps=0",
            "--set", "prompts_per_round=2", "--set", "group_size=2",
            "--set", "max_lag=none"]  # alone: no learner to pace it
    assert main([*argv, "--steps", "30"]) == 0
    assert "[collector] stopped after 30 rounds" in capsys.readouterr().err
    assert main([*argv, "--steps", "20"]) == 0
    err = capsys.readouterr().err
    assert "[collector] round 50: 4 rows, shard 200 rows" in err, err
    assert "[collector] stopped after 20 rounds" in err


def test_a_collector_position_file_of_a_run_made_before_writer_states_is_refused_in_one_line(tmp_path, capsys):
    """Such a run kept its collector's position in ``collector/shard-0000.pt`` beside a shard whose
    appends carried no state: it cannot be resumed exactly, and is refused by name, not restarted
    from the first prompt (its ids would repeat)."""
    from helpers import make_batch

    argv = ["collect", DEFAULT, "--home", str(tmp_path), "--run-name", "old", "--set", "warm_start_steps=0",
            "--set", "max_lag=none", "--steps", "1"]
    shard = tmp_path / "old" / "buffer" / "shard-0000"
    with create_store(shard, "memmap", schema=None) as store:
        store.append(make_batch(2, 4))  # rows written the old way: no writer state
    (tmp_path / "old" / "collector").mkdir()
    torch.save({"format": 1, "committed": {}, "loop": {}, "inflight": None},
               tmp_path / "old" / "collector" / "shard-0000.pt")
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("[")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "shard-0000.pt is the collector position of a run made before" in lines[0], lines
    with open_store(shard, mode="r") as store:
        assert store.next_row == 8  # nothing written
