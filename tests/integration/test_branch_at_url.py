"""``rlhf-pipeline branch`` of a run at an ``s3://`` URL, at a URL beside it (moto's S3 server on
loopback). A replay parent at the URL trains 12 steps from a source at a URL; its branch at step 6
continues with the same ``replay`` command and trains the parent's steps 7-12 exactly (rows, losses,
weights); the checkpoint and weights are copied server-side (no GET of them during the branch);
the parent's objects keep their etags and bytes; ``inspect`` of either URL shows the lineage; a
branch stopped before ``branch.json`` is refused by ``replay`` in one line and made again by
``branch``; a local/URL mix is refused by name. A parent with collectors at the URL (a Zarr buffer
there) branches with its ``parent-rows/`` selection at the branch's URL, naming the parent's shards
in place, and the branch replays only rows the parent had published by the branch step.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from integration.test_branch import OPTIONS, SETTINGS
from integration.test_replay import ROWS, record, recorded_rows
from integration.test_replay_at_url import DEFAULT, logged, same_weights
from integration.test_run_at_url import trained

from rlhf_pipeline.cli.main import main
from rlhf_pipeline.files.object_run_store import ObjectRunStore
from rlhf_pipeline.runs.replay import ReplayOptions, replay_command

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

NOT_COMPARED = ("learning_rate",)


def objects(s3_server, url: str) -> dict[str, tuple[str, str]]:
    """Every object under ``url``: its etag and a digest of its bytes, read by a client of our own."""
    from s3_server import BUCKET

    prefix = url.removeprefix(f"s3://{BUCKET}/") + "/"
    pages = s3_server.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return {item["Key"][len(prefix):]: (item["ETag"], hashlib.sha256(s3_server.get(url, item["Key"][len(prefix):]))
                                        .hexdigest()) for page in pages for item in page.get("Contents", [])}


def replay(home: str, name: str, source: str) -> int:
    return replay_command(DEFAULT, ReplayOptions(buffer=source, **OPTIONS), home=home, run_name=name,
                          overrides=SETTINGS)


@pytest.fixture()
def parent(s3_server, s3_env, tmp_path, monkeypatch):
    """A replay at a URL, 12 steps, from a recorded source at a URL; returns (home, source, parent URL)."""
    monkeypatch.chdir(tmp_path)
    source = s3_server.url("recorded")
    record(source, recorded_rows(ROWS), backend="zarr")
    home = s3_server.url("runs")
    assert replay(home, "parent", source) == 0
    return home, source, f"{home}/parent"


def test_a_branch_at_a_url_continues_with_replay_as_the_parent_trained(s3_server, parent, capsys):
    home, source, parent_url = parent
    before = objects(s3_server, parent_url)
    with s3_server.requests.recording() as requests:
        assert main(["branch", parent_url, "--from-step", "6", "same"]) == 0
    err = capsys.readouterr().err
    assert f"[branch] {home}/same: from {parent_url} at step 6 (no setting changed)" in err
    # the parent's replay command: its flags and every --set it was given, under the branch's name
    assert f"rlhf-pipeline replay PIPELINE.py --buffer {source} --epochs 2 --order shuffle --seed 3" in err, err
    assert f"--home {home} --run-name same --set hidden_size=32" in err, err
    # the checkpoint and the weights were copied on the server: this process never read them
    reads = [path for method, path in requests if method == "GET"]
    assert not any("/parent/checkpoints/step_00000006.pt" in p or "/parent/weights/" in p for p in reads), reads
    made = objects(s3_server, f"{home}/same")
    assert "branch.json" in made and "branch.making" not in made
    assert made["checkpoints/step_00000006.pt"] == before["checkpoints/step_00000006.pt"]  # same bytes, same etag
    assert objects(s3_server, parent_url) == before  # branching only read the parent

    assert replay(home, "same", source) == 0
    assert objects(s3_server, parent_url) == before  # nor did training the branch write to it
    branch, whole = logged(f"{home}/same"), logged(parent_url)
    assert [m["step"] for m in branch] == list(range(1, 13))
    assert trained(branch, NOT_COMPARED) == trained(whole, NOT_COMPARED)  # steps 7-12 trained again: the same
    assert [r["trajectory_ids"] for r in logged(f"{home}/same", "batches.jsonl")] == \
        [r["trajectory_ids"] for r in logged(parent_url, "batches.jsonl")]
    assert same_weights(ObjectRunStore(f"{home}/same"), ObjectRunStore(parent_url))

    assert main(["inspect", parent_url, "--json"]) == 0
    lineage = json.loads(capsys.readouterr().out)["run"]
    assert lineage["branches"] == [{"run": f"{home}/same", "step": 6, "parent_rows": None, "reads": None,
                                    "detached": False}]
    assert [p["step"] for p in lineage["rewind_points"]] == [6, 12]
    assert main(["inspect", f"{home}/same"]) == 0
    assert f"branched from  {parent_url} at step 6 (no setting changed)" in capsys.readouterr().out

    from rlhf_pipeline.dataio.plots import load_runs
    from rlhf_pipeline.files.run_cache import local_copy

    drawn = load_runs([local_copy(parent_url), local_copy(f"{home}/same")])  # what plot draws, from the cache
    assert list(drawn) == ["parent", "same (branch at step 6)"]
    assert [r["step"] for r in drawn["same (branch at step 6)"].records] == list(range(6, 13))

    # a branch of a replay reads none of its parent's rows: detach records it, and the lineage stays
    assert main(["detach", f"{home}/same"]) == 0
    assert "it read no parent rows" in capsys.readouterr().err
    assert json.loads(s3_server.get(f"{home}/same", "branch.json"))["detached"]["rows_copied"] == 0
    assert main(["inspect", parent_url]) == 0
    assert f"{home}/same (from step 6; detached)" in capsys.readouterr().out
    assert objects(s3_server, parent_url) == before


def test_a_branch_stopped_before_branch_json_is_refused_then_made_again(s3_server, parent, capsys):
    home, source, parent_url = parent
    assert main(["branch", parent_url, "--from-step", "6", "cut", "--set", "learner.lr=1e-3"]) == 0
    # what a kill before its last object leaves: the marker, no branch.json
    from s3_server import BUCKET

    prefix = f"{home}/cut".removeprefix(f"s3://{BUCKET}/")
    client = s3_server.client()
    client.delete_object(Bucket=BUCKET, Key=f"{prefix}/branch.json")
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/branch.making", Body=b"{}")
    capsys.readouterr()
    assert main(["replay", DEFAULT, "--buffer", source, "--home", home, "--run-name", "cut",
                 *[w for s in SETTINGS for w in ("--set", s)], "--epochs", "2", "--seed", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is a branch left half-made" in err and len(err.splitlines()) == 1, err
    assert main(["inspect", parent_url, "--json"]) == 0  # not a branch yet: the parent does not list it
    assert json.loads(capsys.readouterr().out)["run"]["branches"] == []
    assert main(["branch", parent_url, "--from-step", "6", "cut", "--set", "learner.lr=1e-3"]) == 0
    assert "left half-made" in capsys.readouterr().err
    made = objects(s3_server, f"{home}/cut")
    assert "branch.json" in made and "branch.making" not in made
    assert json.loads(s3_server.get(f"{home}/cut", "settings.json"))["learner"]["lr"] == 1e-3
    # a branch that is whole is a run: another branch of that name is refused
    assert main(["branch", parent_url, "--from-step", "6", "cut"]) == 2
    assert "holds objects already" in capsys.readouterr().err


def test_a_branch_at_a_url_of_a_run_with_collectors_replays_the_parents_rows_up_to_the_step(s3_server, s3_env,
                                                                                            tmp_path, capsys):
    import subprocess
    import sys

    from integration.test_branch import ONLINE, REPO

    from rlhf_pipeline.learn.metrics import read_metrics
    from rlhf_pipeline.storage import open_buffer

    home = s3_server.url("runs")
    sets = [arg for item in [*ONLINE, "buffer_backend=zarr"] for arg in ("--set", item)]
    ran = subprocess.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--steps", "8", "--home",
                          home, "--run-name", "parent", *sets], cwd=tmp_path, env=s3_env, capture_output=True,
                         text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    parent_url = f"{home}/parent"
    before = objects(s3_server, parent_url)
    assert main(["branch", parent_url, "--from-step", "4", "offline", "--set", "learner.lr=1e-3"]) == 0
    assert f"--buffer {home}/offline/parent-rows --home {home} --run-name offline" in capsys.readouterr().err
    branch = f"{home}/offline"
    keys = set(s3_server.keys(branch))  # per-shard ranges in selection.json: no per-row ids file (row_ranges.py)
    assert {"parent-rows/selection.json", "branch.json"} <= keys and "parent-rows/rows.npy" not in keys
    record = json.loads(s3_server.get(branch, "branch.json"))
    with open_buffer(f"{parent_url}/buffer") as whole, open_buffer(f"{branch}/parent-rows") as at_step:
        assert len(at_step) == sum(record["buffer_rows"].values()) < len(whole)
        everything = set(whole.read(torch.arange(len(whole)), fields=("trajectory_id",))["trajectory_id"].tolist())
        readable = set(at_step.read(torch.arange(len(at_step)), fields=("trajectory_id",))["trajectory_id"].tolist())
    later = everything - readable
    assert later and readable < everything
    # offline it continues over those rows only (online: test_branch_online_at_url.py)
    assert replay_command(DEFAULT, ReplayOptions(buffer=f"{branch}/parent-rows", steps=8), home=home,
                          run_name="offline", overrides=ONLINE + ["buffer_backend=zarr", "learner.lr=1e-3"]) == 0
    capsys.readouterr()
    # once continued offline it cannot go on online (its learner is past the collectors' states): one line
    assert main(["learn", DEFAULT, "--home", home, "--run-name", "offline", "--set", "buffer_backend=zarr"]) == 2
    err = capsys.readouterr().err.strip()
    assert "it was continued offline already (it has a checkpoint of step 8)" in err, err
    assert "continue it offline with rlhf-pipeline replay" in err and len(err.splitlines()) == 1, err
    metrics = read_metrics("metrics.jsonl", store=ObjectRunStore(branch))
    assert [m["step"] for m in metrics] == list(range(1, 9))
    assert [m["charts/learning_rate"] for m in metrics[4:]] == [1e-3] * 4
    trained_ids = {i for r in read_metrics("batches.jsonl", store=ObjectRunStore(branch)) for i in r["trajectory_ids"]}
    assert trained_ids and trained_ids <= readable and not trained_ids & later
    assert objects(s3_server, parent_url) == before  # the parent's objects were only read
    assert main(["inspect", parent_url]) == 0
    assert f"{branch} (from step 4;" in capsys.readouterr().out

    # detached, the branch outlives its parent: its own copy of the rows (a Zarr store at its URL)
    with open_buffer(f"{branch}/parent-rows") as at_step:
        held = at_step.read(torch.arange(len(at_step)), fields=("trajectory_id",))["trajectory_id"].tolist()
    from s3_server import BUCKET

    client, prefix = s3_server.client(), parent_url.removeprefix(f"s3://{BUCKET}/")
    # what a detach killed while copying leaves: part of a store at own-rows/, the selection not switched
    client.put_object(Bucket=BUCKET, Key=f"{prefix.rsplit('/', 1)[0]}/offline/own-rows/zarr.json", Body=b"{")
    assert main(["detach", branch]) == 0
    assert f"{len(held)} parent rows copied into {branch}/own-rows" in capsys.readouterr().err
    assert objects(s3_server, parent_url) == before
    for key in s3_server.keys(parent_url):
        client.delete_object(Bucket=BUCKET, Key=f"{prefix}/{key}")
    with open_buffer(f"{branch}/parent-rows") as own:
        assert own.read(torch.arange(len(own)), fields=("trajectory_id",))["trajectory_id"].tolist() == held
    assert replay_command(DEFAULT, ReplayOptions(buffer=f"{branch}/parent-rows", steps=10), home=home,
                          run_name="offline", overrides=ONLINE + ["buffer_backend=zarr", "learner.lr=1e-3"]) == 0
    metrics = read_metrics("metrics.jsonl", store=ObjectRunStore(branch))
    assert [m["step"] for m in metrics] == list(range(1, 11))  # resumed at step 8, over its own rows
    assert main(["inspect", branch]) == 0
    assert f"branched from  {parent_url} at step 4" in capsys.readouterr().out


def test_a_branch_at_an_az_url_continues_with_replay_as_the_parent_trained(azure_server, tmp_path, monkeypatch,
                                                                           capsys):
    """On Azure Blob Storage (Azurite) the copies go through the client (a GET, then a PUT); the rest
    is the same: the branch trains the parent's steps 7-12, the parent's blobs are unchanged."""
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azure_server.env()["AZURE_STORAGE_CONNECTION_STRING"])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    source = azure_server.url("recorded")
    record(source, recorded_rows(ROWS), backend="zarr")
    home = azure_server.url("runs")
    assert replay(home, "parent", source) == 0
    parent_url = f"{home}/parent"

    def blobs(url: str) -> dict[str, str]:
        return {key: hashlib.sha256(azure_server.get(url, key)).hexdigest() for key in azure_server.keys(url)}

    before = blobs(parent_url)
    assert main(["branch", parent_url, "--from-step", "6", "same"]) == 0
    assert replay(home, "same", source) == 0
    assert blobs(parent_url) == before
    assert trained(logged(f"{home}/same"), NOT_COMPARED) == trained(logged(parent_url), NOT_COMPARED)
    assert same_weights(ObjectRunStore(f"{home}/same"), ObjectRunStore(parent_url))
    assert main(["inspect", parent_url, "--json"]) == 0
    assert [b["run"] for b in json.loads(capsys.readouterr().out)["run"]["branches"]] == [f"{home}/same"]
