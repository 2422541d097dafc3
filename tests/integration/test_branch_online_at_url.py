"""A branch at an ``s3://`` URL of a run with collectors at the same URL, continued online with
``run`` (``runs/branch_online_url.py``; moto's S3 server on loopback).

The parent (the default pipeline, its tiny model on CPU, one collector, a Zarr buffer at the URL)
trains 8 steps; it is branched at step 4. ``run`` on the branch with nothing changed trains the
parent's steps 5-8 exactly: the same rows (the parent's up to the branch rows read in place at the
parent's URL, then those its collector writes again into the branch's own shard at the branch's
URL), the same losses and weights; the parent's objects keep their etags and bytes. A branch's
``run`` killed with SIGKILL (launcher and children at once) after its first steps and started again
ends where the parent does.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
import torch
from helpers import kill_when
from integration.test_branch import printed_command
from integration.test_branch_at_url import objects
from integration.test_branch_online import FIELDS, NOT_COMPARED, REPO, SETTINGS, same_rows
from integration.test_replay_at_url import DEFAULT, logged, same_weights

from rlhf_pipeline.cli.main import main
from rlhf_pipeline.files.object_run_store import ObjectRunStore
from rlhf_pipeline.storage import open_buffer, open_store

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


# the shortest writer-lock lease: a collector killed with SIGKILL holds its shard's lock at the URL
# until the lease runs out
AT_URL = [*SETTINGS, "buffer_backend=zarr", "buffer_lock_lease_s=3"]


def command(home: str, name: str) -> list[str]:
    sets = [word for item in AT_URL for word in ("--set", item)]
    return [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--steps", "8", "--home", home,
            "--run-name", name, *sets]


def run(env: dict, cwd, home: str, name: str) -> str:
    ran = subprocess.run(command(home, name), cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
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


@pytest.fixture()
def parent(s3_server, s3_env, tmp_path):
    home = s3_server.url("runs")
    run(s3_env, tmp_path, home, "parent")
    return home, f"{home}/parent"


def test_a_branch_at_a_url_with_nothing_changed_trains_online_what_the_parent_trained(s3_server, s3_env, tmp_path,
                                                                                     parent, capsys):
    home, parent = parent
    kept = objects(s3_server, parent)
    # the collector's states, and copies of the weights versions they held, at the parent's URL
    assert any(key.startswith("collector/shard-0000.history/row_") for key in kept)
    assert any(key.startswith("collector/shard-0000.history/policy_") for key in kept)
    before = objects(s3_server, parent)
    assert main(["branch", parent, "--from-step", "4", "same"]) == 0
    # the parent's command with every --set it was given, the pipeline file as PIPELINE.py: run as printed
    printed = printed_command(capsys.readouterr().err, "run")
    assert printed[3:8] == ["run", "PIPELINE.py", "--home", home, "--run-name"]
    same = f"{home}/same"
    inherited = json.loads(ObjectRunStore(same).read("branch.json"))["buffer_rows"]
    ran = subprocess.run([DEFAULT if word == "PIPELINE.py" else word for word in printed], cwd=tmp_path, env=s3_env,
                         capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "changed" not in ran.stderr, ran.stderr[-3000:]  # no setting left out of the printed command
    assert objects(s3_server, parent) == before  # the parent's objects were only read
    # a branch continued online is not branched again yet: one line naming its parent
    assert main(["branch", same, "--from-step", "8", "again"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is a branch continued online" in err and parent in err and len(err.splitlines()) == 1, err
    assert s3_server.keys(f"{home}/again") == []
    assert [m["step"] for m in logged(same)] == list(range(1, 9))
    assert any(m["losses/loss"] != 0 for m in logged(parent)[4:])  # something to compare
    assert trained(same) == trained(parent)
    assert same_weights(ObjectRunStore(same), ObjectRunStore(parent))
    (name, count), = inherited.items()
    with open_buffer(f"{same}/buffer") as union:  # the parent's shard read in place below the branch rows
        shard = union.shards[0]
        assert (shard.parent.location, shard.parent_rows) == (f"{parent}/buffer/{name}", count)
        assert shard.own.location == f"{same}/buffer/{name}"
    assert same_rows(rows(f"{same}/buffer"), rows(f"{parent}/buffer"))
    assert same_rows(rows(f"{same}/buffer/{name}"), rows(f"{parent}/buffer", first=count))


def test_a_branch_at_a_url_killed_mid_run_resumes_online_to_what_the_parent_trained(s3_server, s3_env, tmp_path,
                                                                                   parent):
    home, parent = parent
    before = objects(s3_server, parent)
    assert main(["branch", parent, "--from-step", "4", "killed"]) == 0
    killed = f"{home}/killed"
    first = subprocess.Popen(command(home, "killed"), cwd=tmp_path, env=s3_env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    # the branch starts with the parent's 4 steps; killed once it trained 2 of its own
    kill_when(first, lambda: len(logged(killed)) >= 6, whole_group=True, poll_s=0.1, wait_s=60)
    assert first.returncode == -signal.SIGKILL
    assert 6 <= len(logged(killed)) < 8, "the kill came after the branch had finished; nothing was resumed"
    assert "resuming from" in run(s3_env, tmp_path, home, "killed")
    assert trained(killed) == trained(parent)
    assert same_weights(ObjectRunStore(killed), ObjectRunStore(parent))
    assert same_rows(rows(f"{killed}/buffer"), rows(f"{parent}/buffer"))
    assert objects(s3_server, parent) == before


def test_a_collector_with_groups_pending_at_the_branch_rows_is_refused_online_at_a_url(s3_server, s3_env, capsys):
    """The position history at a URL keeps the shard's writer state whole, its write path's pending
    groups too: a collector with rows of groups not whole yet at the branch rows is refused in one
    line, not restarted without them."""
    from helpers import make_batch

    from rlhf_pipeline.collect.position_history import PositionHistory, history_key
    from rlhf_pipeline.files.run_paths import RunPaths
    from rlhf_pipeline.storage.writer_state import encode
    from rlhf_pipeline.transforms.pending_groups import PendingGroups

    home = s3_server.url("runs")
    parent = RunPaths.at_url(f"{home}/parent")
    parent.store.write("settings.json", b"{}")
    pending = PendingGroups()
    pending.add(make_batch(1, 2))  # half a group of 4
    history = PositionHistory(parent.store, history_key("collector/shard-0000.pt"))
    history.record(32, encode({"policy_version": 2}, [pending.to_payload()]))
    ObjectRunStore(f"{home}/b").write("branch.json", json.dumps({
        "parent": parent.url, "step": 2, "replay_source": None, "buffer_rows": {"shard-0000": 32},
        "policy_version": 2}).encode())
    assert main(["learn", DEFAULT, "--home", home, "--run-name", "b", "--set", "buffer_backend=zarr"]) == 2
    err = capsys.readouterr().err.strip()
    assert "had rows of groups not whole yet pending at row 32 of shard-0000" in err, err
    assert len(err.splitlines()) == 1, err
    assert not any(key.startswith("collector/") for key in s3_server.keys(f"{home}/b"))
