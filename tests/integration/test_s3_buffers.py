"""Buffers on object storage, the run directory local: the commands on ``s3://`` buffers against
moto's S3 server on loopback (``inspect``, ``convert`` to and from S3, ``replay --buffer s3://...``
training a tiny model), and ``run`` with its buffer at a URL (``buffer_url``) on S3. The run's code
above the object store is one program for every cloud: Azure's side of it (a sharded buffer at an
``az://`` prefix written, killed mid-append, read as the union of its shards and inspected by the CLI)
is ``tests/storage/test_object_store.py``'s.

The commands find the server through ``AWS_ENDPOINT_URL`` and the AWS credentials variables, as
a user's shell would give them. They run in this process (``command``): what they do at a URL is
under test, not their process, and each CLI start would import torch again (seconds on a busy
machine); ``run``, whose children are real processes anyway, starts as one (``cli``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from integration.test_default_pipeline import SMALL as RUN_SMALL
from integration.test_replay import DEFAULT, SMALL_CLI, batches, losses, record, recorded_rows, replay
import preloaded

from rlhf_pipeline.files.shard_names import spread_shard_name
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.pipeline import PipelineError, load_pipeline_module, make_settings
from rlhf_pipeline.runs.run import run_command
from rlhf_pipeline.storage import open_store
from rlhf_pipeline.storage.buffers import buffer_stats

REPO = Path(__file__).resolve().parents[2]
SHARD0 = spread_shard_name(0)  # collector 0's shard at an object-store URL


def cli(server, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    result = preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", *args], cwd=REPO, env=server.env(),
                           capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    return result


def command(server, *args: str) -> subprocess.CompletedProcess:
    """``rlhf-pipeline ARGS`` in this process, with ``server``'s variables (``server.env()``) the
    environment for the call; it must exit 0. What it printed comes back as ``stdout``/``stderr``."""
    import contextlib
    import io
    from unittest import mock

    from rlhf_pipeline.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, server.env(), clear=True), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        code = main(list(args))
    assert code == 0, out.getvalue() + err.getvalue()[-3000:]
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def local_source(tmp_path_factory) -> Path:
    return record(tmp_path_factory.mktemp("recorded") / "buffer", recorded_rows(96))


@pytest.fixture(scope="module")
def s3_source(s3_server, local_source) -> str:
    """The recorded buffer converted onto S3 by ``rlhf-pipeline convert``, every row verified."""
    url = s3_server.url()
    out = command(s3_server, "convert", str(local_source), url, "--to", "zarr", "--verify", "--quiet").stdout
    assert f"{url}: 96 rows" in out and "every row verified" in out
    return url


def test_inspect_and_convert_back_from_s3(s3_server, s3_source, local_source, tmp_path):
    stats = json.loads(command(s3_server, "inspect", s3_source, "--json").stdout)
    local = buffer_stats(str(local_source)).to_json()
    assert stats["backend"] == "zarr" and stats["rows"] == 96
    for key in ("groups", "prompt_tokens", "response_tokens", "raw_bytes", "reward_mean"):
        assert stats[key] == local[key], key
    assert 0 < stats["bytes_on_disk"] == sum(  # on S3: the objects' sizes
        item["Size"] for page in s3_server.client().get_paginator("list_objects_v2").paginate(
            Bucket=s3_source.split("/")[2], Prefix=s3_source.split("/", 3)[3] + "/")
        for item in page["Contents"])
    table = command(s3_server, "inspect", s3_source).stdout  # says what it counted: no du at a URL
    assert "(the objects' sizes)" in table and "du" not in table and "the objects take" in table
    verified = command(s3_server, "inspect", s3_source, "--verify", "--quiet").stdout
    assert "96 rows: no damage found" in verified

    # a memmap buffer at a URL is refused before a row is read (filter said so after reading them all,
    # blaming a memmap source for the --to memmap it was given)
    elsewhere = s3_server.url("memmap-here")
    for argv, said in ((["convert", s3_source, elsewhere, "--to", "memmap"], "Zarr store: give --to zarr"),
                       (["filter", s3_source, elsewhere, "--where", "reward > 0", "--to", "memmap"],
                        "--to memmap was given: give --to zarr"),
                       (["filter", str(local_source), elsewhere, "--where", "reward > 0"],
                        "the source is a memmap store: give --to zarr")):
        with pytest.raises(AssertionError, match=said) as refused:
            command(s3_server, *argv)
        assert "[filter] rows" not in str(refused.value), argv
    assert s3_server.keys(elsewhere) == []

    back = tmp_path / "back"
    command(s3_server, "convert", s3_source, str(back), "--to", "memmap", "--verify", "--quiet")
    with open_store(local_source) as a, open_store(back) as b:
        assert a.read(torch.arange(96)).equal(b.read(torch.arange(96)))


def test_a_selection_saved_at_a_url_is_kept_there_and_read_in_place(s3_server, s3_source, local_source, tmp_path,
                                                                    monkeypatch):
    """``filter --selection`` to a URL wrote a directory named ``s3:`` where it ran and said the selection
    was saved; it is kept at the URL now, and every command that reads a buffer opens it there."""
    from rlhf_pipeline.storage import open_buffer

    monkeypatch.chdir(tmp_path)
    url = s3_server.url("kept-selection")
    where = "reward > 0.3"
    said = command(s3_server, "filter", s3_source, url, "--where", where, "--selection").stdout
    assert f"{url}: a selection of {s3_source} (no rows copied)" in said
    assert list(tmp_path.iterdir()) == [] and "selection.json" in s3_server.keys(url)
    command(s3_server, "filter", str(local_source), str(tmp_path / "here"), "--where", where, "--selection")
    stats = json.loads(command(s3_server, "inspect", url, "--json").stdout)
    assert stats["backend"] == "selection" and 0 < stats["rows"] < 96
    with mock_env(s3_server), open_buffer(url) as there, open_buffer(str(tmp_path / "here")) as here:
        assert len(there) == len(here) == stats["rows"]
        assert there.read(torch.arange(len(there))).equal(here.read(torch.arange(len(here))))
    assert "no damage found" in command(s3_server, "inspect", "--verify", url).stdout
    again = command(s3_server, "filter", url, s3_server.url("narrower"), "--where", "reward > 0.6", "--selection")
    assert f"a selection of {url}" in again.stdout
    with pytest.raises(AssertionError, match="holds a saved selection; choose a new URL"):
        command(s3_server, "filter", s3_source, url, "--where", where, "--selection")
    with pytest.raises(AssertionError, match=f"reads its rows in place from any machine, and {local_source}"):
        command(s3_server, "filter", str(local_source), s3_server.url("of-local-rows"), "--where", where,
                "--selection")


def mock_env(server):
    from unittest import mock

    return mock.patch.dict(os.environ, server.env(), clear=True)


def test_replay_from_s3_trains_on_the_same_rows_as_from_disk(s3_server, s3_source, local_source, tmp_path):
    home = tmp_path / "home"
    command(s3_server, "replay", DEFAULT, "--buffer", s3_source, "--steps", "3", "--order", "sequential",
        "--seed", "3", "--home", str(home), "--run-name", "from-s3", *SMALL_CLI)
    from_disk = replay(home, "from-disk", local_source, steps=3, order="sequential", seed=3)
    assert len(batches(home / "from-s3")) == 3
    assert batches(home / "from-s3") == batches(from_disk)
    assert losses(home / "from-s3") == losses(from_disk)


@pytest.mark.parametrize("object_server", ["s3"], indirect=True)
def test_run_with_the_buffer_at_a_url_then_verify_and_replay_it(object_server, tmp_path):
    """The collector writes ``URL/00-shard-0000`` (its spread name; a Zarr store without being told), the
    learner reads the union, the run directory stays local; then ``inspect --verify`` and ``replay`` of
    that URL, and ``inspect`` and ``replay`` of the run, which stands for the buffer at its URL."""
    url = object_server.url("buffer")
    out = cli(object_server, "run", DEFAULT, "--steps", "2", "--home", str(tmp_path), "--run-name", "remote",
              *RUN_SMALL, "--set", f"buffer_url={url}", "--set", "buffer_lock_lease_s=12", timeout=600)
    assert "[run] done: 2 learner steps" in out.stderr, out.stderr[-3000:]
    assert f"writing to {url}/{SHARD0} (writer lock lease 12 s)" in out.stderr  # the setting reached the lock
    run = tmp_path / "remote"
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2]
    assert not (run / "buffer").exists()  # the rows went to the object store only
    keys = object_server.keys(url)
    assert f"{SHARD0}/zarr.json" in keys and f"{SHARD0}/writer.lock" not in keys  # the collector let go

    stats = json.loads(command(object_server, "inspect", url + "/", "--json").stdout)
    assert stats["backend"] == "sharded" and stats["extra"]["shards"] == 1
    assert stats["rows"] >= 32 and stats["rows"] % 4 == 0  # two learner batches of 16, whole groups of 4
    assert "no damage found" in command(object_server, "inspect", "--verify", url + "/").stdout

    command(object_server, "replay", DEFAULT, "--buffer", url, "--steps", "1", "--home", str(tmp_path),
            "--run-name", "replayed", *RUN_SMALL)
    assert [r["step"] for r in read_metrics(tmp_path / "replayed" / "metrics.jsonl")] == [1]

    by_run = json.loads(command(object_server, "inspect", str(run), "--json").stdout)
    # the buffer at its URL, not its RUN/buffer, which does not exist
    assert by_run["buffer"] == {**stats, "location": url}
    replayed = command(object_server, "replay", DEFAULT, "--buffer", str(run), "--steps", "1", "--home",
                       str(tmp_path), "--run-name", "replayed-by-run", *RUN_SMALL)
    assert f"is a run: its buffer {url}" in replayed.stderr
    assert batches(tmp_path / "replayed-by-run") == batches(tmp_path / "replayed")


def test_a_memmap_buffer_at_a_url_is_a_settings_error(tmp_path):
    """A buffer_url takes a Zarr buffer without being told (only Zarr lives at a URL); told memmap, it is
    refused."""
    module = load_pipeline_module(DEFAULT)
    assert make_settings(module, ["buffer_url=s3://bucket/run/buffer"]).buffer_backend == "zarr"
    assert make_settings(module, ["buffer_url=none"]).buffer_backend == "memmap"
    with pytest.raises(PipelineError, match=r"'buffer_url' .*needs buffer_backend=zarr.*leave buffer_backend unset"):
        run_command("run", pipeline_path=DEFAULT, home=str(tmp_path),
                    overrides=["buffer_url=s3://bucket/run/buffer", "buffer_backend=memmap"])
    with pytest.raises(PipelineError, match=r"'buffer_url' must be a URL such as s3://"):
        run_command("run", pipeline_path=DEFAULT, home=str(tmp_path),
                    overrides=["buffer_backend=zarr", "buffer_url=/tmp/not-a-url"])
    with pytest.raises(PipelineError, match=r"'buffer_lock_lease_s' must be >= 3 seconds"):
        run_command("run", pipeline_path=DEFAULT, home=str(tmp_path),
                    overrides=["buffer_backend=zarr", "buffer_url=s3://bucket/run/buffer", "buffer_lock_lease_s=0.5"])
    assert not (tmp_path / "default").exists()
