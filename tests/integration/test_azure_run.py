"""``run`` with the buffer on Azure Blob Storage (``buffer_url=az://...``), against Azurite on
loopback: the same program as on S3 (``test_s3_run.py``), the account from
``AZURE_STORAGE_CONNECTION_STRING`` as a user's shell would give it; then ``inspect --verify`` and
``replay`` of that URL.
"""

from __future__ import annotations

import json

from integration.test_default_pipeline import DEFAULT, SMALL
from integration.test_s3_buffers import cli, command

from rlhf_pipeline.files.shard_names import spread_shard_name
from rlhf_pipeline.learn.metrics import read_metrics

SHARD0 = spread_shard_name(0)  # collector 0's shard at an object-store URL


def test_run_with_the_buffer_on_azure_then_verify_and_replay_it(azure_server, tmp_path):
    url = azure_server.url("buffer")
    out = cli(azure_server, "run", DEFAULT, "--steps", "2", "--home", str(tmp_path), "--run-name", "on-azure",
              *SMALL, "--set", "buffer_backend=zarr", "--set", f"buffer_url={url}", timeout=600)
    assert "[run] done: 2 learner steps" in out.stderr, out.stderr[-3000:]
    assert f"writing to {url}/{SHARD0}" in out.stderr
    run = tmp_path / "on-azure"
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2]
    assert not (run / "buffer").exists()  # the rows went to the object store only
    keys = azure_server.keys(url)
    assert f"{SHARD0}/zarr.json" in keys and f"{SHARD0}/writer.lock" not in keys  # the collector let go

    stats = json.loads(command(azure_server, "inspect", url + "/", "--json").stdout)
    assert stats["backend"] == "sharded" and stats["extra"]["shards"] == 1
    assert stats["rows"] >= 32 and stats["rows"] % 4 == 0  # two learner batches of 16, whole groups of 4
    assert "no damage found" in command(azure_server, "inspect", "--verify", url + "/").stdout

    command(azure_server, "replay", DEFAULT, "--buffer", url, "--steps", "1", "--home", str(tmp_path),
            "--run-name", "replayed", *SMALL)
    assert [r["step"] for r in read_metrics(tmp_path / "replayed" / "metrics.jsonl")] == [1]
