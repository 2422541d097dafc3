"""``collect`` and ``learn`` as separate processes sharing one run directory; stop and resume;
several collectors (one buffer shard each) feeding one learner."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import kill_when, run_child_pids
import preloaded

from rlhf_pipeline.cli.main import main
from rlhf_pipeline.files.run_paths import RunPaths
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.pipeline import load_pipeline_module, make_settings
from rlhf_pipeline.storage import ShardedStoreReader, create_store, open_buffer, open_store
from rlhf_pipeline.storage.sharded import list_shards
from rlhf_pipeline.storage.writer_state import decode

REPO = Path(__file__).resolve().parents[2]
DEFAULT = str(REPO / "pipelines" / "default.py")
SMALL = ["--set", "warm_start_steps=5", "--set", "prompts_per_round=4", "--set", "group_size=4",
         "--set", "learner.batch_size=16", "--set", "learner.sample_window=32",
         "--set", "learner.new_rows_per_step=16", "--set", "learner.checkpoint_every=2"]


def start(command: str, home: Path, *extra: str) -> subprocess.Popen:
    return preloaded.Popen(
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

    # the finished run continued, its collector started first: the STOP of the learner that finished is
    # there, and the collector collects for the next learner instead of stopping at once (it did, and
    # the learner then waited for rows that never came); the new learner's STOP ends it
    collector = start("collect", tmp_path)
    said = collector.stdout.readline()
    while said and "finished before this collector started" not in said:
        said = collector.stdout.readline()
    assert "collecting for the next learner" in said
    finish(start("learn", tmp_path, "--steps", "4"))
    collector_out = finish(collector)
    assert "[collector] stopped after" in collector_out and "stopped after 0 rounds" not in collector_out
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4]

    # resume without a collector: offline replay over the recorded buffer, from step 4 to 5. In this
    # process, as the refusal below: what the learner resumes from is on disk, and each CLI start
    # would only import torch again
    learn = ["learn", DEFAULT, "--home", str(tmp_path), "--run-name", "shared", *SMALL]
    capfd.readouterr()
    assert main([*learn, "--steps", "5", "--set", "learner.sampler=window", "--set", "learner.new_rows_per_step=0",
                 "--set", "max_lag=none"]) == 0
    learner_out = "".join(capfd.readouterr())
    assert "resuming from" in learner_out and "(step 4)" in learner_out
    assert "note: settings changed since step 4: learner." in learner_out
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4, 5]

    # settings that define the data may not change under an existing run
    assert main([*learn, "--steps", "6", "--set", "group_size=8"]) == 2
    out = "".join(capfd.readouterr())
    assert "group_size: was 4, now 8" in out and "--run-name" in out


def test_a_collector_started_while_another_process_prepares_the_run_says_it_waits(tmp_path):
    """``collect`` beside a ``learn`` that builds the initial policy (tool_use.py's warm start: minutes)
    waits on the run's preparation lock: it said nothing meanwhile. The lock is held here as that
    ``learn`` holds it."""
    import fcntl
    import select

    (tmp_path / "shared").mkdir()
    with open(tmp_path / "shared" / ".prepare.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        collector = start("collect", tmp_path, "--steps", "1")
        try:  # a silent wait fails here, not at the suite's timeout (far beyond a start on a loaded machine)
            said = collector.stdout.readline() if select.select([collector.stdout], [], [], 120)[0] else ""
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    assert said.startswith(f"[run] another process is preparing {tmp_path / 'shared'} (building its initial "
                           f"policy, or creating its buffer): waiting for it"), said
    out = finish(collector)  # then it prepares the run itself and collects its round
    assert "[run] building the initial policy" in out and "[collector] stopped after 1 round " in out, out[-3000:]


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


def test_a_damaged_settings_json_is_refused_in_one_line_by_each_command_that_reads_it(tmp_path, capsys):
    """``settings.json`` cut short, or edited into something else, was a JSONDecodeError traceback from
    the learner's start (and from ``branch`` and a resumed replay); each refuses in one line naming the
    file and the way out, and changes nothing in the run."""
    run = tmp_path / "damaged"
    run.mkdir()
    damaged = b'{"steps": 300, '
    (run / "settings.json").write_bytes(damaged)
    home = ["--home", str(tmp_path)]
    for argv in (["learn", DEFAULT, *home, "--run-name", "damaged", *SMALL, "--steps", "1"],
                 ["branch", "damaged", *home, "--from-step", "2", "child"],
                 ["replay", DEFAULT, *home, "--run-name", "damaged", "--buffer", str(tmp_path / "any"), "--steps", "1"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if not line.startswith("[")]  # a start's own log lines
        assert "Traceback" not in err and len(lines) == 1, err
        assert f"{run / 'settings.json'} is damaged" in lines[0], lines
        assert "restore it from a copy, or delete it" in lines[0], lines
    assert (run / "settings.json").read_bytes() == damaged and not (tmp_path / "child").exists()


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
    with pytest.raises(RunError, match="buffer_backend: was None, now 'zarr'") as refused:
        prepare_run(changed, paths)
    assert "Resume with the same settings, or" in str(refused.value)  # no value of its own to give back
    # a start without the run's own --set (a `collect` joining it): the refusal gives the words back
    with pytest.raises(RunError) as refused:
        prepare_run(build_pipeline(module, make_settings(module, ["temperature=0.5"]), paths), paths)
    assert ("(temperature: was 1.0, now 0.5; warm_start_steps: was 0, now 200). Resume with the same settings "
            "(--set temperature=1.0 --set warm_start_steps=0), or start a new run") in str(refused.value)


def test_two_collectors_feed_one_learner_through_buffer_shards_and_one_killed_resumes_exactly(tmp_path, capfd):
    """``run --collectors 2`` (a sharded Zarr buffer): collector k writes buffer/shard-k, the learner
    samples both. kill -9 of collector 1 stops the run; the same command resumes it, no round lost or
    doubled, and ends cleanly.

    The window sampler makes no draw while a shard is empty, so even its first steps use both
    collectors' rows; the exact sampler takes what the shards hold (tests/learn/test_exact_sampler.py).
    """
    from rlhf_pipeline.storage import ShardedStoreReader

    command = [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--collectors", "2",
               "--home", str(tmp_path), "--run-name", "crash", *SMALL, "--set", "buffer_backend=zarr",
               "--set", "learner.sampler=window"]
    run = tmp_path / "crash"
    first = preloaded.Popen([*command, "--steps", "50"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    out = kill_when(first, lambda: (run / "metrics.jsonl").exists() and len(read_metrics(run / "metrics.jsonl")) >= 3,
                    victims=lambda: run_child_pids("collect-1", str(run.parent), "crash"), timeout=240)
    assert first.returncode != 0 and "collector 1 ended early (was killed by SIGKILL" in out, out[-3000:]
    stopped_at = read_metrics(run / "metrics.jsonl")[-1]["step"]

    resumed = preloaded.run([*command, "--steps", str(stopped_at + 3)], cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr
    assert "leaked semaphore" not in resumed.stderr  # Blosc's mutex (storage/zarr/layout.py)
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, stopped_at + 4))
    # clean shutdown: the learner finished, wrote STOP, and both collectors ended on it
    assert f"[run] done: {stopped_at + 3} learner steps" in resumed.stderr
    # named alike: each of several by its index (collector 0 once said "[collector]" beside "[collector 1]")
    assert "[collector 0] stopped after" in resumed.stderr and "[collector 1] stopped after" in resumed.stderr
    assert "[collector] " not in resumed.stderr
    assert (run / "STOP").exists()

    with open_buffer(run / "buffer", mode="r") as union:
        assert isinstance(union, ShardedStoreReader)
        assert {type(s).__name__ for s in union.shards.values()} == {"ZarrTrajectoryStore"}
    # each collector wrote its own shard, with ids that carry its index, and kept its own state
    assert [k for k, _ in list_shards(run / "buffer")] == [0, 1]
    for k, path in list_shards(run / "buffer"):
        with open_store(path, mode="r") as shard:
            ids = shard.read(torch.arange(len(shard)), fields=("trajectory_id", "group_id"))
            assert decode(shard.writer_state, path)["writer"]["config"]["collector_index"] == k  # its own state
        assert len(ids["trajectory_id"]) > 0 and len(ids["trajectory_id"]) % 4 == 0
        assert bool((ids["group_id"] >> 40 == k).all()) and bool((ids["trajectory_id"] >> 40 == k).all())
        local = (ids["trajectory_id"] - (k << 40)).tolist()
        # every round exactly once: the ids the collector handed out, in order, without a gap
        assert local == list(range(len(local))), (k, local)
        groups = (ids["group_id"] - (k << 40)).tolist()
        assert groups == [i // 4 for i in range(len(groups))], k  # whole groups of 4

    # the learner's union: ids unique across shards, whole groups of 4
    with open_buffer(run / "buffer", mode="r") as union:
        rows = union.read(torch.arange(len(union)), fields=("group_id", "trajectory_id", "policy_version"))
    assert rows["trajectory_id"].unique().numel() == len(rows)
    assert rows["group_id"].unique().numel() * 4 == len(rows)
    assert int(rows["policy_version"].max()) >= 1  # collectors picked up published weights
    # and it trained on rows of both collectors
    assert max(r["charts/collectors_in_batch"] for r in records) == 2
    # a branch of it says that online it may not train what the run trained (which rows a step takes from
    # each shard depends on timing; a second run of this one differs from the first too)
    assert main(["branch", str(run), "--from-step", str(stopped_at + 3), "twin"]) == 0
    assert ("[branch] note: the parent's 2 collectors each continue where they stood, but online the steps after "
            f"{stopped_at + 3} may differ from the parent's") in capfd.readouterr().err


def test_run_with_two_learner_ranks_writes_one_set_of_files(tmp_path):
    """``learner.world_size=2``: run starts two learner ranks beside the collector; rank 0 alone
    writes metrics, weights and checkpoints, and both ranks train on rank 0's draws of the live buffer."""
    done = preloaded.run(
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


# ============================================================ a run at a URL
# ``run --home s3://...`` / ``az://...``: every piece of run state at the URL (moto's S3 server, Azurite
# for Azure, on loopback), local disk only a cache; endpoint and credentials from the environment as a
# user's shell gives them (``run_home`` sets them here; the children inherit them).
ZARR = ["--set", "buffer_backend=zarr"]
# after a kill, what only counts differs: how many rows the buffer held when a step taken again
# drew (a killed run's collector had run ahead; those rows are kept)
LABELS = ("buffer_rows", "rows_generated")


def command_at(home: str, name: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--home", home, "--run-name", name,
            *SMALL, *ZARR, *extra]


def rows_of(buffer: str) -> dict:
    with open_buffer(buffer, mode="r") as store:
        rows = store.read(torch.arange(len(store)), fields=("policy_version", "reward", "response_tokens"))
    return {"versions": rows["policy_version"].tolist(), "rewards": rows["reward"].tolist(),
            "tokens": [t.tolist() for t in rows["response_tokens"].to_list()]}


@pytest.mark.parametrize("run_home", ["s3"], indirect=True)
def test_a_run_at_a_url_keeps_its_state_there_and_trains_as_in_a_directory(run_home, tmp_path, monkeypatch, capsys):
    import json

    from integration.run_location import logged, trained

    from rlhf_pipeline.files.run_paths import cache_dir
    from rlhf_pipeline.files.shard_names import spread_shard_name
    from rlhf_pipeline.pipeline import RunPaths, load_pipeline_module, make_settings
    from rlhf_pipeline.runs.lineage import run_store_at

    home = run_home
    at_url = preloaded.run([*command_at(home, "exp1"), "--steps", "4"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=600)
    assert at_url.returncode == 0, at_url.stderr[-3000:]
    assert f"[run] run directory {home}/exp1" in at_url.stderr
    assert "[run] done: 4 learner steps" in at_url.stderr, at_url.stderr[-3000:]
    keys = set(run_store_at(f"{home}/exp1").walk())
    assert any(key.startswith("collector/shard-0000.history/row_") for key in keys), sorted(keys)
    for key in ("settings.json", "pipeline.py", "pacing.json",
                "checkpoints/step_00000004.pt", "weights/policy_00000004.safetensors",
                "metrics.jsonl.parts/00000000.jsonl", "collector/metrics-0000.jsonl.parts/00000000.jsonl",
                f"buffer/{spread_shard_name(0)}/zarr.json", "STOP"):
        assert key in keys, sorted(keys)
    assert "run.lock" not in keys and not any(k.endswith(".partial") for k in keys)  # let go; nothing half-written
    assert any(k.startswith("tensorboard/events.out.tfevents") for k in keys)
    assert list(tmp_path.iterdir()) == [tmp_path / "cache"]  # no s3: directory beside the command
    cache = cache_dir(f"{home}/exp1")
    assert not any(p.is_file() and p.name != ".prepare.lock" and not {"tensorboard", "fetched"} & set(p.parts)
                   for p in cache.rglob("*"))
    # the collector loaded its weights through this machine's copies (files/machine_cache.py), by etag
    copies = [p.name for p in (cache / "fetched" / "weights").iterdir() if p.suffix == ".safetensors"]
    assert copies and all(name.startswith("policy_000000") and name.count(".") == 2 for name in copies), copies

    # the commands that read a run take its URL (what they need is copied into the cache); in this
    # process, from tmp_path (what they get at a URL is the point, not their process: each CLI start
    # imports torch again, seconds on a busy machine)
    monkeypatch.chdir(tmp_path)
    assert main(["export-model", f"{home}/exp1", "--list-versions"]) == 0
    assert "v4 (weights policy_00000004.safetensors)" in capsys.readouterr().out
    assert main(["export-model", f"{home}/exp1", str(tmp_path / "model")]) == 0
    assert "policy version 4" in capsys.readouterr().out
    assert (tmp_path / "model" / "config.json").is_file()
    assert not (cache / "weights").exists() and not (cache / "checkpoints").exists()  # only the version exported is read
    assert main(["plot", f"{home}/exp1", "--out", str(tmp_path / "charts")]) == 0
    assert (tmp_path / "charts" / "overview.png").is_file()
    capsys.readouterr()
    assert main(["inspect", f"{home}/exp1/buffer/", "--json"]) == 0
    assert '"shards": 1' in capsys.readouterr().out
    assert main(["show", f"{home}/exp1", "--color", "never"]) == 0
    shown = capsys.readouterr()
    assert "── turn 0" in shown.out
    assert "tokens shown by id" not in shown.err  # decoded with the tokenizer of the run's own pipeline copy
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "charts", "model"]  # no s3: directory

    # a buffer at a URL made before shards took spread names (buffer/shard-0000) goes on as it is: nothing
    # made beside it, and the collector paces by the name the learner counts it under (else the rounds
    # the stall rule lets through take the newest weights, and the run trains differently). Run beside
    # the same run in a local directory
    legacy = RunPaths.at_url(f"{home}/legacy")
    module = load_pipeline_module(DEFAULT)
    settings = make_settings(module, [a for a in [*SMALL, *ZARR] if a != "--set"])
    module.build(settings, legacy).create_buffer(f"{legacy.url}/buffer/shard-0000").close()
    legacy_run = preloaded.Popen([*command_at(home, "legacy"), "--steps", "4"], cwd=tmp_path,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        local = preloaded.run([*command_at(str(tmp_path / "local"), "exp1"), "--steps", "4"], cwd=REPO,
                              capture_output=True, text=True, timeout=600)
        legacy_err = legacy_run.communicate(timeout=600)[1]
    finally:
        if legacy_run.poll() is None:
            legacy_run.kill()
    assert local.returncode == 0, local.stderr[-3000:]
    assert trained(logged(f"{home}/exp1")) == trained(logged(tmp_path / "local" / "exp1"))
    assert rows_of(f"{home}/exp1/buffer") == rows_of(str(tmp_path / "local" / "exp1" / "buffer"))

    assert legacy_run.returncode == 0, legacy_err[-3000:]
    assert f"writing to {legacy.url}/buffer/shard-0000" in legacy_err, legacy_err[-3000:]
    assert {key.split("/", 1)[0] for key in run_store_at(f"{legacy.url}/buffer").walk()} == {"shard-0000"}
    assert json.loads(legacy.store.read("pacing.json"))["consumed"] == {"shard-0000": 4 * 16}
    assert trained(logged(legacy.url)) == trained(logged(f"{home}/exp1"))


# each cloud's kill test: the sides killed in turn, each once the run has logged this many more
# learner steps; the steps each start asks for; the steps the last, uninterrupted start adds. A step
# at a URL costs about a second, paid twice (the killed run and the plain one): the learner is killed
# once step 3 is logged, past its first checkpoint (step 2, learner.checkpoint_every=2) and a version
# published beyond it, which is all its kill needs, and each later start adds 2 steps
KILLS = {"s3": ((("learn", 3), ("collect", 2)), 60, 2), "az": ((("learn", 3),), 40, 2)}


@pytest.mark.parametrize("run_home", ["s3", "azure"], indirect=True)
def test_processes_killed_at_a_url_resume_exactly(run_home, tmp_path):
    """kill -9 of the learner (and on S3 then of the collector, in the resumed run; on Azure the same
    program, only ``files/cloud_objects.py`` knows the cloud); the same command resumes each time, and
    the run trains exactly as an uninterrupted one with the same steps: the same rows (tokens, rewards)
    and the same losses and rewards step by step. One collector: which of several collectors' rows a
    batch holds first is timing, so only one is deterministic.

    Only counts may differ after the learner's kill (``LABELS``): the buffer holds the rows its
    collector wrote ahead before the kill. The versions it published past its checkpoint are
    published again under the same numbers, so the rows sampled with them and the collector's next
    rounds have the uninterrupted run's versions (tests/integration/test_resume_at_every_distance.py
    kills at every distance from the checkpoint)."""
    from integration.run_location import logged, trained

    from rlhf_pipeline.files.shard_names import spread_shard_name
    from rlhf_pipeline.runs.lineage import run_store_at

    home = run_home
    run_url = f"{home}/crash"
    base = command_at(home, "crash")
    victims, steps, extra = KILLS[home.split("://")[0]]
    done = 0
    for side, after in victims:
        started = preloaded.Popen([*base, "--steps", str(steps)], cwd=tmp_path, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        out = kill_when(started, lambda: len(logged(run_url)) >= done + after,
                        victims=lambda: run_child_pids(side, home), poll_s=0.1)
        assert started.returncode != 0, out[-3000:]
        if done:  # a start after a kill
            assert f"[learner] resuming from {run_url}/checkpoints/step_" in out, out[-3000:]
        assert ("the learner failed" if side == "learn" else "the collector ended early") in out, out[-3000:]
        assert "was killed by SIGKILL" in out, out[-3000:]
        done = len(logged(run_url))
    shard0 = spread_shard_name(0)
    keys = set(run_store_at(run_url).walk())
    for key in ("settings.json", "pipeline.py", f"buffer/{shard0}/zarr.json"):
        assert key in keys, sorted(keys)
    total = logged(run_url)[-1]["step"] + extra

    resumed = preloaded.run([*base, "--steps", str(total)], cwd=tmp_path, capture_output=True, text=True,
                            timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"[learner] resuming from {run_url}/checkpoints/step_" in resumed.stderr, resumed.stderr[-3000:]
    assert "run.lock" not in set(run_store_at(run_url).walk())  # let go
    with open_store(f"{run_url}/buffer/{shard0}", mode="r") as shard:
        ids = shard.read(torch.arange(len(shard)), fields=("trajectory_id", "group_id"))
    # every round exactly once: the ids the collector handed out, in order, without a gap
    rows = len(ids["trajectory_id"])
    assert ids["trajectory_id"].tolist() == list(range(rows))
    assert ids["group_id"].tolist() == [i // 4 for i in range(rows)]

    plain = preloaded.run([*command_at(home, "plain"), "--steps", str(total)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert plain.returncode == 0, plain.stderr[-3000:]
    resumed_steps, uninterrupted = trained(logged(run_url), LABELS), trained(logged(f"{home}/plain"), LABELS)
    assert [r["step"] for r in resumed_steps] == list(range(1, total + 1))  # every step once, in order
    for step, (a, b) in enumerate(zip(resumed_steps, uninterrupted, strict=True), start=1):
        assert a == b, f"step {step}: {sorted(set(a.items()) ^ set(b.items()))}"
    a, b = rows_of(f"{run_url}/buffer"), rows_of(f"{home}/plain/buffer")
    trained_rows = total * 16  # the rows the learner took in (how far the collector ran ahead at the end is timing)
    assert min(len(a["tokens"]), len(b["tokens"])) >= trained_rows
    assert {key: v[:trained_rows] for key, v in a.items()} == {key: v[:trained_rows] for key, v in b.items()}
    assert list(tmp_path.iterdir()) == [tmp_path / "cache"]  # no s3: or az: directory beside the command


@pytest.mark.parametrize("run_home", ["s3"], indirect=True)
def test_a_collector_and_a_learner_started_apart_meet_at_the_url(run_home, tmp_path):
    """``collect`` and ``learn`` as separate commands (as on two machines: each with its own
    cache directory and working directory), meeting only at the run's URL."""
    from integration.run_location import logged

    home = run_home
    base = [sys.executable, "-m", "rlhf_pipeline.cli.main"]
    args = [DEFAULT, "--home", home, "--run-name", "apart", *SMALL, *ZARR]
    machines = {}
    for side in ("collector", "learner"):
        (tmp_path / side).mkdir()
        machines[side] = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / side / "cache")}
    collector = preloaded.Popen([*base, "collect", *args], cwd=tmp_path / "collector", env=machines["collector"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        learner = preloaded.run([*base, "learn", *args, "--steps", "3"], cwd=tmp_path / "learner",
                                env=machines["learner"], capture_output=True, text=True, timeout=600)
        out, _ = collector.communicate(timeout=120)  # ends by itself: the learner wrote STOP
    finally:
        if collector.poll() is None:
            collector.kill()
    assert learner.returncode == 0, learner.stderr[-3000:]
    assert collector.returncode == 0 and "[collector] stopped after" in out, out[-3000:]
    assert [r["step"] for r in logged(f"{home}/apart")] == [1, 2, 3]
    assert int(max(rows_of(f"{home}/apart/buffer")["versions"])) >= 1  # the collector took the learner's weights
    for side in ("collector", "learner"):
        assert [p.name for p in (tmp_path / side).iterdir()] == ["cache"]


@pytest.mark.parametrize("run_home", ["s3"], indirect=True)
@pytest.mark.parametrize("pipeline", ["default", "tool_use"])
def test_a_run_at_a_url_told_to_make_memmap_shards_is_refused_in_one_line(run_home, pipeline, tmp_path):
    """``buffer_backend=memmap`` given for a run at a URL (a run setting of every pipeline): refused before
    any row, lock or local directory is made."""
    from rlhf_pipeline.runs.lineage import run_store_at

    refused = preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run",
                              str(REPO / "pipelines" / f"{pipeline}.py"), "--home", run_home, "--steps", "1",
                             "--set", "buffer_backend=memmap"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2, refused.stderr[-3000:]
    errors = [line for line in refused.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "needs a Zarr buffer" in errors[0] and "leave buffer_backend unset" in errors[0], \
        refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr
    assert run_store_at(f"{run_home}/{pipeline}").walk() == []  # not even the lock: it was let go
    assert not (tmp_path / "s3:").exists()


@pytest.mark.parametrize("run_home", ["s3"], indirect=True)
def test_a_run_at_a_url_takes_a_zarr_buffer_without_being_told(run_home, tmp_path):
    """Only Zarr lives at a URL, so the buffer of a run there is Zarr unless told otherwise (memmap, the
    default in a directory, was refused until ``--set buffer_backend=zarr`` was added). Its settings.json
    records it, and a resume that does not say it either goes on."""
    import json

    from rlhf_pipeline.runs.lineage import run_store_at

    command = [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--home", run_home, "--run-name",
               "untold", *SMALL]
    for steps in (2, 3):
        ran = preloaded.run([*command, "--steps", str(steps)], cwd=tmp_path, capture_output=True, text=True,
                            timeout=600)
        assert ran.returncode == 0, ran.stderr[-3000:]
    assert "resuming from" in ran.stderr and "settings changed" not in ran.stderr, ran.stderr[-3000:]
    settings = json.loads(run_store_at(f"{run_home}/untold").read("settings.json"))
    assert settings["buffer_backend"] == "zarr"
    assert len(rows_of(f"{run_home}/untold/buffer")["versions"]) >= 3 * 16


# ============================================================ groups pending at a kill, wherever the run lives
PENDING_ROWS = 200  # 50 groups of 4

PENDING_COLLECTOR = textwrap.dedent("""
    import sys, torch
    torch.set_num_threads(1)
    sys.path.insert(0, {tests!r})
    from helpers import make_batch
    from rlhf_pipeline.files.run_paths import RunPaths
    from rlhf_pipeline.pipeline import load_pipeline_module, make_settings
    from rlhf_pipeline.storage import open_store
    from rlhf_pipeline.storage.torchrl_glue import make_replay_buffer

    module = load_pipeline_module({pipeline!r})
    settings = make_settings(module, ["buffer_backend=zarr", "group_size=4", "buffer_lock_lease_s=3"])
    run = RunPaths.at({run_url!r})
    pipeline = module.build(settings, run)
    store = open_store(run.shard_location(0), mode="a", lock_wait_s=60, lock_lease_s=3)
    write_path = pipeline.make_write_path(store)
    rb = make_replay_buffer(store, transforms=write_path)
    pending = write_path[0].pending
    held = set(pending.trajectory_ids().tolist())
    if store.next_row:
        held |= set(store.read_global(torch.arange(store.next_row))["trajectory_id"].tolist())
    print("resumed", pending.num_rows, len(held), flush=True)
    batch = make_batch({rows} // 4, 4, seed=5)
    order = [i for i in torch.randperm({rows}, generator=torch.Generator().manual_seed(3)).tolist() if i not in held]
    sizes = [1, 2, 3, 1, 3, 2] * {rows}
    pos = k = 0
    while pos < len(order):
        rows = order[pos:pos + sizes[k]]
        rb.extend(batch.select(rows))
        print("acked", *rows, flush=True)
        pos += sizes[k]; k += 1
    store.close()
    print("finished", pending.num_rows, flush=True)
""")


def _create_shard(run_location: str) -> None:
    """The run's shard, as ``run`` creates it: the pipeline's ``create_buffer``."""
    module = load_pipeline_module(REPO / "pipelines" / "default.py")
    settings = make_settings(module, ["buffer_backend=zarr", "group_size=4"])
    run = RunPaths.at(run_location)
    module.build(settings, run).create_buffer(run.shard_location(0)).close()


def _collector(tmp_path: Path, run_url: str, machine: str) -> subprocess.Popen:
    """A collector process on ``machine``: its own working directory and cache directory."""
    where = tmp_path / machine
    where.mkdir()
    script = where / "collector.py"
    script.write_text(PENDING_COLLECTOR.format(tests=str(REPO / "tests"), pipeline=DEFAULT, run_url=run_url,
                                               rows=PENDING_ROWS))
    return subprocess.Popen([sys.executable, str(script)], cwd=where, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "XDG_CACHE_HOME": str(where / "cache"), "OMP_NUM_THREADS": "1"})


def _collect_here(run_url: str) -> str:
    """The collector's script run to its end in this process, which imported torch already (a process
    of its own would import it again); what it printed."""
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(PENDING_COLLECTOR.format(tests=str(REPO / "tests"), pipeline=DEFAULT, run_url=run_url,
                                      rows=PENDING_ROWS), {"__name__": "collector"})
    return printed.getvalue()


def _finish(process: subprocess.Popen) -> str:
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, out[-2000:] + err[-3000:]
    return out


def _rows(shard_url: str):
    with open_store(shard_url, mode="r") as store:
        return store.read_global(torch.arange(store.next_row))


def _nothing_local(machine: Path) -> bool:
    return not any(p.is_file() and p.name != "collector.py" for p in machine.rglob("*"))


def test_a_collector_killed_with_pending_groups_resumes_on_another_machine(run_home, tmp_path):
    """A collector killed with ``kill -9`` while groups are pending, resumed on "another machine" (a
    fresh process with an empty cache directory of its own): the pending groups are found in the
    shard's own commit record (its writer state), and the buffer ends with every group whole, once,
    equal to an uninterrupted run's. The collector here sends each group's completions over several
    writes (as a streaming collector would), which is what leaves groups pending between writes; the
    pipeline's own collector writes whole groups per round."""
    home = run_home
    for name in ("crash", "plain"):
        _create_shard(f"{home}/{name}")

    first = _collector(tmp_path, f"{home}/crash", "machine-a")
    acked: list[int] = []
    try:
        for line in first.stdout:
            acked += [int(x) for x in line.split()[1:]] if line.startswith("acked") else []
            if len(acked) >= 30:
                first.send_signal(signal.SIGKILL)  # lands wherever the collector is by now
                break
        first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == -signal.SIGKILL
    shard0 = RunPaths.at(f"{home}/crash").shard_location(0).rsplit("/", 1)[-1]  # a spread name at a URL
    with open_store(f"{home}/crash/buffer/{shard0}", mode="r") as shard:  # published with the shard's rows
        assert decode(shard.writer_state, shard.location)["write_path"][0]["rows"] is not None
    assert _nothing_local(tmp_path / "machine-a")  # the pending groups were never only on its disk

    out = _finish(_collector(tmp_path, f"{home}/crash", "machine-b"))
    _, pending_rows, held = out.splitlines()[0].split()
    assert int(pending_rows) > 0, out  # it resumed with groups pending, found at the URL
    assert len(acked) <= int(held) < PENDING_ROWS  # every acknowledged row was stored or pending; the kill came midway
    assert out.splitlines()[-1] == "finished 0"
    assert _nothing_local(tmp_path / "machine-b")

    # the run nobody kills, in this process: its rows do not depend on timing
    assert _collect_here(f"{home}/plain").splitlines()[-1] == "finished 0"
    crashed, plain = _rows(f"{home}/crash/buffer/{shard0}"), _rows(f"{home}/plain/buffer/{shard0}")
    ids = crashed["trajectory_id"]
    assert sorted(ids.tolist()) == list(range(PENDING_ROWS))  # every row once
    assert torch.bincount(crashed["group_id"]).tolist() == [4] * (PENDING_ROWS // 4)  # every group whole
    # the same rows, advantages included, as the run nobody killed (the order within one append may differ)
    assert crashed.select(torch.argsort(ids)).equal(plain.select(torch.argsort(plain["trajectory_id"])))
