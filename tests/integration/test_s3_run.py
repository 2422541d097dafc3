"""``run`` with the buffer on object storage (``buffer_url``), against moto's S3 server on loopback:
the collector writes ``URL/00-shard-0000`` (its spread name), the learner reads the union, the run directory stays
local; then ``inspect`` and ``replay`` of that URL. Real processes, endpoint and credentials
from the AWS variables as a user's shell would give them.
"""

from __future__ import annotations

import json

import pytest
from integration.test_default_pipeline import DEFAULT, SMALL
from integration.test_s3_buffers import cli, command

from rlhf_pipeline.files.shard_names import spread_shard_name
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.pipeline import PipelineError
from rlhf_pipeline.runs.run import run_command

SHARD0 = spread_shard_name(0)  # collector 0's shard at an object-store URL


def test_run_with_the_buffer_at_a_url_then_inspect_and_replay_it(s3_server, tmp_path):
    url = s3_server.url("buffer")
    out = cli(s3_server, "run", DEFAULT, "--steps", "2", "--home", str(tmp_path), "--run-name", "on-s3", *SMALL,
              "--set", "buffer_backend=zarr", "--set", f"buffer_url={url}", "--set", "buffer_lock_lease_s=12",
              timeout=600)
    assert "[run] done: 2 learner steps" in out.stderr, out.stderr[-3000:]
    assert f"writing to {url}/{SHARD0} (writer lock lease 12 s)" in out.stderr  # the setting reached the lock
    run = tmp_path / "on-s3"
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2]
    assert not (run / "buffer").exists()  # the rows went to the object store only
    keys = s3_server.keys(url)
    assert f"{SHARD0}/zarr.json" in keys and f"{SHARD0}/writer.lock" not in keys  # the collector let go

    stats = json.loads(command(s3_server, "inspect", url + "/", "--json").stdout)
    assert stats["backend"] == "sharded" and stats["extra"]["shards"] == 1
    assert stats["rows"] >= 32 and stats["rows"] % 4 == 0  # two learner batches of 16, whole groups of 4

    command(s3_server, "replay", DEFAULT, "--buffer", url, "--steps", "1", "--home", str(tmp_path),
            "--run-name", "replayed", *SMALL)
    assert [r["step"] for r in read_metrics(tmp_path / "replayed" / "metrics.jsonl")] == [1]


def test_a_memmap_buffer_at_a_url_is_a_settings_error(tmp_path):
    with pytest.raises(PipelineError, match=r"'buffer_url' .*needs buffer_backend=zarr.*--set buffer_backend=zarr"):
        run_command("run", pipeline_path=DEFAULT, home=str(tmp_path), overrides=["buffer_url=s3://bucket/run/buffer"])
    with pytest.raises(PipelineError, match=r"'buffer_url' must be a URL such as s3://"):
        run_command("run", pipeline_path=DEFAULT, home=str(tmp_path),
                    overrides=["buffer_backend=zarr", "buffer_url=/tmp/not-a-url"])
    with pytest.raises(PipelineError, match=r"'buffer_lock_lease_s' must be >= 3 seconds"):
        run_command("run", pipeline_path=DEFAULT, home=str(tmp_path),
                    overrides=["buffer_backend=zarr", "buffer_url=s3://bucket/run/buffer", "buffer_lock_lease_s=0.5"])
    assert not (tmp_path / "default").exists()
