"""Retention with a branch at an ``s3://`` URL (moto's S3 server on loopback), end to end with ``run``.

A parent at the URL (the default pipeline, its tiny model on CPU, one collector, a Zarr shard at the
URL) runs with ``retention.max_rows`` and ``hold_rewind_points=false`` (only its newest checkpoint
holds rows), is branched at step 4, and runs on to step 16: its rules ask to drop rows the branch
reads, and it keeps them (``runs/retention.py``). The branch then continues online to step 16
with the same rules: only its own shard's oldest segments go, their objects deleted, the parent's
objects keep their etags, and the branch's buffer still reads from the parent's rows it started with.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from integration.test_branch_at_url import objects
from integration.test_branch_online import FIELDS
from integration.test_branch_online_at_url import AT_URL
from integration.test_replay_at_url import DEFAULT, logged

from rlhf_pipeline.cli.main import main
from rlhf_pipeline.files.object_run_store import ObjectRunStore
from rlhf_pipeline.runs.branch import PARENT_ROWS
from rlhf_pipeline.storage import open_buffer, open_store

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

BOUND = ["segment_rows=16", "retention.max_rows=96", "retention.hold_rewind_points=false"]


def bounded(env, cwd, home: str, name: str, steps: int) -> None:
    sets = [word for item in [*AT_URL, *BOUND] for word in ("--set", item)]
    ran = subprocess.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--steps", str(steps),
                          "--home", home, "--run-name", name, *sets], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]


def dropped(url: str) -> int:
    return int(sum(r.get("retention/rows_dropped", 0) for r in logged(url, "collector/metrics-0000.jsonl")))


def test_a_parent_at_a_url_keeps_its_branchs_rows_and_the_branch_drops_only_its_own(s3_server, s3_env, tmp_path):
    home = s3_server.url("runs")
    parent = f"{home}/parent"
    bounded(s3_env, tmp_path, home, "parent", 8)
    assert main(["branch", parent, "--from-step", "4", "kept"]) == 0
    kept = f"{home}/kept"
    lineage = json.loads(ObjectRunStore(kept).read("branch.json"))
    (name, inherited), = lineage["buffer_rows"].items()
    selection = json.loads(ObjectRunStore(kept).read(f"{PARENT_ROWS}/selection.json"))
    (part,) = selection["parts"]
    first_read = int(part["first_row"])

    bounded(s3_env, tmp_path, home, "parent", 16)  # the parent runs on beside its branch
    with open_store(part["location"]) as shard:
        held, written = shard.first_row, shard.next_row
    assert written - 96 > inherited  # max_rows asked to drop every row the branch reads...
    assert held <= first_read  # ...and the parent kept them
    with open_buffer(f"{kept}/{PARENT_ROWS}") as rows:  # the branch reads every row it names
        assert len(rows) == inherited - first_read
        rows.read(torch.arange(len(rows)), fields=list(FIELDS))

    before = objects(s3_server, parent)
    bounded(s3_env, tmp_path, home, "kept", 16)
    assert objects(s3_server, parent) == before  # the parent's objects were only read
    assert [m["step"] for m in logged(kept)] == list(range(1, 17))
    own_location = f"{kept}/buffer/{part['location'].rsplit('/', 1)[-1]}"
    with open_store(own_location) as own:
        own_first, own_next = own.first_row, own.next_row
    assert dropped(kept) == own_first > 0 and own_first % 16 == 0  # whole own segments only
    units = {int(key.split("/")[1].split("-")[0]) for key in s3_server.keys(own_location) if key.count("/") > 1}
    assert min(units) == own_first  # the dropped segments' objects are gone
    assert sum(r.get("retention/bytes_freed", 0) for r in logged(kept, "collector/metrics-0000.jsonl")) > 0
    with open_buffer(f"{kept}/buffer") as union:  # the union's ids stay put: the branch's own rows after N
        shard = union.shards[0]
        assert (shard.first_row, shard.next_row) == (inherited + own_first, inherited + own_next)
