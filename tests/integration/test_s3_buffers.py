"""The commands on ``s3://`` buffers, against moto's S3 server on loopback: ``inspect``,
``convert`` to and from S3, and ``replay --buffer s3://...`` training a tiny model.

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
from integration.test_replay import DEFAULT, SMALL_CLI, batches, losses, record, recorded_rows, replay

from rlhf_pipeline.storage import open_store
from rlhf_pipeline.storage.buffers import buffer_stats

REPO = Path(__file__).resolve().parents[2]


def cli(s3_server, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "rlhf_pipeline.cli.main", *args], cwd=REPO, env=s3_server.env(),
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
    verified = command(s3_server, "inspect", s3_source, "--verify", "--quiet").stdout
    assert "96 rows: no damage found" in verified

    back = tmp_path / "back"
    command(s3_server, "convert", s3_source, str(back), "--to", "memmap", "--verify", "--quiet")
    with open_store(local_source) as a, open_store(back) as b:
        assert a.read(torch.arange(96)).equal(b.read(torch.arange(96)))


def test_replay_from_s3_trains_on_the_same_rows_as_from_disk(s3_server, s3_source, local_source, tmp_path):
    home = tmp_path / "home"
    command(s3_server, "replay", DEFAULT, "--buffer", s3_source, "--steps", "3", "--order", "sequential",
        "--seed", "3", "--home", str(home), "--run-name", "from-s3", *SMALL_CLI)
    from_disk = replay(home, "from-disk", local_source, steps=3, order="sequential", seed=3)
    assert len(batches(home / "from-s3")) == 3
    assert batches(home / "from-s3") == batches(from_disk)
    assert losses(home / "from-s3") == losses(from_disk)
