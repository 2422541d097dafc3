"""A branch at an ``s3://`` URL of a run with collectors at the same URL, continued online with
``run`` (``runs/branch_online_url.py``; moto's S3 server on loopback).

The parent (the default pipeline, its tiny model on CPU, one collector, a Zarr buffer at the URL)
trains 8 steps; it is branched at step 4. ``run`` on the branch with nothing changed trains the
parent's steps 5-8 exactly: the same rows (the parent's up to the branch rows read in place at the
parent's URL, then those its collector writes again into the branch's own shard at the branch's
URL), the same losses and weights; the parent's objects keep their etags and bytes.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from integration.test_branch_at_url import objects
from integration.test_branch_online import FIELDS, NOT_COMPARED, REPO, SETTINGS
from integration.test_replay_at_url import DEFAULT, logged, same_weights

from rlhf_pipeline.cli.main import main
from rlhf_pipeline.files.object_run_store import ObjectRunStore
from rlhf_pipeline.storage import open_buffer, open_store

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


def run(env: dict, cwd, home: str, name: str) -> str:
    sets = [word for item in [*SETTINGS, "buffer_backend=zarr"] for word in ("--set", item)]
    ran = subprocess.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--steps", "8", "--home",
                          home, "--run-name", name, *sets], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    return ran.stderr


def trained(url: str) -> list[dict]:
    return [{k: v for k, v in m.items() if not any(t in k for t in NOT_COMPARED)} for m in logged(url)]


def rows(location: str, first: int = 0) -> list[dict]:
    with open_buffer(location) if location.endswith("/buffer") else open_store(location) as store:
        count = len(store) - first
        batch = store.read(torch.arange(first, first + count), fields=FIELDS)
    return [{name: (batch[name].row(i) if hasattr(batch[name], "row") else batch[name][i]).tolist()
             for name in FIELDS} for i in range(count)]


def test_a_branch_at_a_url_with_nothing_changed_trains_online_what_the_parent_trained(s3_server, s3_env, tmp_path):
    home = s3_server.url("runs")
    run(s3_env, tmp_path, home, "parent")
    parent = f"{home}/parent"
    assert any(key.startswith("collector/shard-0000.history/row_") for key in objects(s3_server, parent))
    before = objects(s3_server, parent)
    assert main(["branch", parent, "--from-step", "4", "same"]) == 0
    same = f"{home}/same"
    inherited = json.loads(ObjectRunStore(same).read("branch.json"))["buffer_rows"]
    run(s3_env, tmp_path, home, "same")
    assert objects(s3_server, parent) == before  # the parent's objects were only read
    assert [m["step"] for m in logged(same)] == list(range(1, 9))
    assert any(m["losses/loss"] != 0 for m in logged(parent)[4:])  # something to compare
    assert trained(same) == trained(parent)
    assert same_weights(ObjectRunStore(same), ObjectRunStore(parent))
    (name, count), = inherited.items()
    with open_buffer(f"{same}/buffer") as union:  # the parent's shard read in place below the branch rows
        shard = union.shards[0]
        assert (shard.parent.location, shard.parent_rows) == (f"{parent}/buffer/{name}", count)
        assert shard.own.location == f"{same}/buffer/{name}"
    assert rows(f"{same}/buffer") == rows(f"{parent}/buffer")
    own = rows(f"{same}/buffer/{name}")
    assert own and own == rows(f"{parent}/buffer", first=count)
