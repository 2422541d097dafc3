"""``replay --home s3://...``: the replay run at a URL (moto's S3 server on loopback), local disk only
a cache. It trains exactly as the same replay in a local directory, from a source that is itself
at a URL, and a replay killed with ``kill -9`` resumes from the URL to the same losses, rows and
weights. Real processes; endpoint and credentials from the AWS variables, as a user's shell gives them.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import torch
from helpers import kill_when
from integration.test_replay import (
    DEFAULT,
    ROWS,
    SMALL,
    SMALL_CLI,
    record,
    recorded_rows,
)
from integration.test_run_at_url import trained

from rlhf_pipeline.cli.main import main
from rlhf_pipeline.coordination.weights import load_weights
from rlhf_pipeline.files.object_run_store import ObjectRunStore
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.runs.replay import ReplayOptions, replay_command

EPOCHS = ["--epochs", "2", "--seed", "7"]  # 12 steps of 16 rows; checkpoints every 2 steps
IN_PROCESS = {"epochs": 2, "seed": 7}  # the same, as ReplayOptions for a replay in this process


@pytest.fixture()
def env(s3_env):
    return s3_env  # the module's tests name it env, as test_run_at_url.py does


@pytest.fixture()
def source(s3_server, env, tmp_path) -> str:
    """The recorded buffer as a Zarr store at a URL (BUFFER may be a URL too)."""
    url = s3_server.url("recorded")
    record(url, recorded_rows(ROWS), backend="zarr")
    return url


def replay(env, cwd, home: str, name: str, source: str, *extra: str, **popen) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "rlhf_pipeline.cli.main", "replay", DEFAULT, "--buffer", source,
               "--home", home, "--run-name", name, *SMALL_CLI, *EPOCHS, *extra]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, **popen)


def logged(run: str, log: str = "metrics.jsonl") -> list[dict]:
    if "://" in run:
        return read_metrics(log, store=ObjectRunStore(run))
    return read_metrics(f"{run}/{log}")


def same_weights(a, b) -> bool:
    (wa, _), (wb, _) = load_weights(a), load_weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_replay_at_a_url_keeps_its_state_there_and_trains_as_in_a_directory(s3_server, env, source, tmp_path,
                                                                              monkeypatch, capsys):
    home = s3_server.url("runs")
    at_url = replay(env, tmp_path, home, "r1", source)
    assert at_url.returncode == 0, at_url.stderr[-3000:]
    assert f"steps (2 epochs, order shuffle) into {home}/r1" in at_url.stderr
    keys = set(s3_server.keys(f"{home}/r1"))
    for key in ("settings.json", "pipeline.py", "weights/policy_00000012.safetensors", "checkpoints/step_00000012.pt",
                "metrics.jsonl.parts/00000000.jsonl", "batches.jsonl.parts/00000000.jsonl"):
        assert key in keys, sorted(keys)
    assert "run.lock" not in keys and not any(k.endswith(".partial") for k in keys)
    assert "pacing.json" not in keys  # no collectors read it: no PUT of it per step
    assert list(tmp_path.iterdir()) == [tmp_path / "cache"]  # no s3: directory beside the command
    store = ObjectRunStore(f"{home}/r1")
    assert b'"buffer": "' + source.encode() + b'"' in store.read("settings.json")

    # the same replay in a local directory, in this process (its CLI start would only import torch again)
    replay_command(DEFAULT, ReplayOptions(buffer=source, **IN_PROCESS), home=str(tmp_path / "local"),
                   run_name="r1", overrides=SMALL)
    local_run = str(tmp_path / "local" / "r1")
    assert trained(logged(f"{home}/r1")) == trained(logged(local_run))
    assert [r["trajectory_ids"] for r in logged(f"{home}/r1", "batches.jsonl")] == \
        [r["trajectory_ids"] for r in logged(local_run, "batches.jsonl")]
    assert same_weights(store, tmp_path / "local" / "r1")

    # a run at a URL as starting weights (in this process: one step is enough to start from them)
    replay_command(DEFAULT, ReplayOptions(buffer=source, init_from=f"{home}/r1", steps=1), home=str(tmp_path / "local"),
                   run_name="from-url", overrides=SMALL)
    (start, version), (newest, _) = load_weights(tmp_path / "local" / "from-url", 0), load_weights(store)
    assert version == 0 and all(torch.equal(start[k], newest[k]) for k in newest)

    # the same command again: finished, nothing retrained; a changed option is refused, naming it
    # (in this process: the refusal comes before any training)
    monkeypatch.chdir(tmp_path)
    assert main(["replay", DEFAULT, "--buffer", source, "--home", home, "--run-name", "r1", *SMALL_CLI, *EPOCHS,
                 "--order", "sequential"]) == 2
    refused = capsys.readouterr().err
    assert "--order: was 'shuffle', now 'sequential'" in refused, refused[-3000:]
    assert f"{home}/r1 holds a replay started with other settings" in refused
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "local"]  # no s3: directory


def test_a_replay_killed_at_a_url_resumes_to_the_same_losses_rows_and_weights(s3_server, env, source, tmp_path,
                                                                              monkeypatch):
    """The kill lands after a checkpoint of step 2 or later and before the last; the same command
    resumes from the newest checkpoint at the URL."""
    home = s3_server.url("runs")
    run = f"{home}/killed"
    command = [sys.executable, "-m", "rlhf_pipeline.cli.main", "replay", DEFAULT, "--buffer", source,
               "--home", home, "--run-name", "killed", *SMALL_CLI, *EPOCHS]
    first = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    store = ObjectRunStore(run)
    # a checkpoint at step 2 or later, and the run not finished (10 steps of margin to the end)
    err = kill_when(first, lambda: any(n.startswith("step_") and 2 <= int(n[5:13]) < 12
                                       for n in store.list("checkpoints")), wait_s=60)
    assert first.returncode == -signal.SIGKILL, err[-3000:]
    assert "checkpoints/step_00000012.pt" not in s3_server.keys(run), "the kill came after the replay had finished"

    resumed = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"[learner] resuming from {run}/checkpoints/step_" in resumed.stderr, resumed.stderr[-3000:]
    assert [r["step"] for r in logged(run)] == list(range(1, 13))  # every step once, in order
    assert [r["step"] for r in logged(run, "batches.jsonl")] == list(range(1, 13))

    # the uninterrupted replay to compare with, in this process (from tmp_path, whose listing is checked
    # below): its CLI start would only import torch again
    monkeypatch.chdir(tmp_path)
    replay_command(DEFAULT, ReplayOptions(buffer=source, **IN_PROCESS), home=home, run_name="plain",
                   overrides=SMALL)
    # every chart the same, the versions' numbers too: a replay killed after publishing versions past its
    # checkpoint publishes them again under the same numbers; the losses, the rows of every step and the
    # weights are the same
    pairs = zip(trained(logged(run)), trained(logged(f"{home}/plain")), strict=True)
    for step, (a, b) in enumerate(pairs, start=1):
        assert a == b, f"step {step}: {sorted(set(a.items()) ^ set(b.items()))}"
    assert logged(run, "batches.jsonl") != [] and \
        [r["trajectory_ids"] for r in logged(run, "batches.jsonl")] == \
        [r["trajectory_ids"] for r in logged(f"{home}/plain", "batches.jsonl")]
    assert same_weights(store, ObjectRunStore(f"{home}/plain"))
    assert list(tmp_path.iterdir()) == [tmp_path / "cache"]


def test_a_replay_home_or_init_from_with_an_unsupported_scheme_is_refused(env, source, tmp_path, monkeypatch,
                                                                          capsys):
    """In this process: each refusal comes before any training, and a CLI start costs seconds."""
    from rlhf_pipeline.cli.main import main

    monkeypatch.chdir(tmp_path)
    base = ["replay", DEFAULT, *SMALL_CLI, "--steps", "1"]
    assert main([*base, "--buffer", source, "--home", "gs://bucket/runs", "--run-name", "r"]) == 2
    assert "--home 'gs://bucket/runs' is a URL with a scheme a run cannot live at yet" in capsys.readouterr().err
    home = str(tmp_path / "home")
    assert main([*base, "--buffer", source, "--home", home, "--run-name", "r", "--init-from", "ftp://host/run"]) == 2
    assert "--init-from: RUN 'ftp://host/run' is a URL with a scheme a run cannot live at" in capsys.readouterr().err
    assert main([*base, "--buffer", "foo://bucket/buffer", "--home", home, "--run-name", "r"]) == 2
    assert "foo:// is not a URL scheme a buffer can be read at" in capsys.readouterr().err
    assert not any(p.name.endswith(":") for p in tmp_path.rglob("*"))  # no URL taken for a local path
    assert not (tmp_path / "home" / "r" / "settings.json").exists()
