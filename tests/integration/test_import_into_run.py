"""``import SOURCE RUN``: the rows get a shard of their own in the run's buffer, scored by the run's
newest policy rebuilt from its own pipeline copy and settings, and ``inspect`` of the run's buffer
shows them, for a run in a directory, at an ``s3://`` URL (moto's S3 server on loopback) and at an
``az://`` URL (Azurite), one test over ``run_home``. An import into a run at a URL killed with
``kill -9`` resumes from its record there with no row lost or doubled. Real processes.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
import torch
from helpers import kill_when
import preloaded
from integration.test_default_pipeline import DEFAULT

from rlhf_pipeline.cli.main import main
from rlhf_pipeline.coordination.weights import load_weights, publish_weights
from rlhf_pipeline.dataio.run_pipeline import load_run_pipeline
from rlhf_pipeline.files.object_run_store import ObjectRunStore
from rlhf_pipeline.files.shard_names import IMPORT_SHARD_FIRST, spread_shard_name
from rlhf_pipeline.pipeline import RunPaths, load_pipeline_module, make_settings
from rlhf_pipeline.runs.processes import build_pipeline, collect_main
from rlhf_pipeline.runs.run_directory import hold_run_directory, prepare_run
from rlhf_pipeline.schema.ids import collector_index_of
from rlhf_pipeline.storage import open_buffer, open_store
from rlhf_pipeline.storage.buffers import find_shard
from rlhf_pipeline.transforms.ref_logprobs import reference_log_probs

IMPORTED = spread_shard_name(IMPORT_SHARD_FIRST)  # the import's shard at an object-store URL

SMALL = ("warm_start_steps=0", "hidden_size=32", "num_layers=1", "num_heads=2", "group_size=4",
         "buffer_backend=zarr")
CLI = [sys.executable, "-m", "rlhf_pipeline.cli.main"]


@pytest.fixture()
def env(s3_env):
    return s3_env  # the module's tests name it env


def run_at(location: str, *, collected: bool = False, versions: int = 1) -> RunPaths:
    """A run at ``location`` (a directory or a URL) as ``run --home`` prepares it: settings, the
    pipeline copy, collector 0's shard and weights version 0; ``collected``: with one round of
    collector 0's rows; ``versions``: policy versions published in all, each with other weights."""
    module = load_pipeline_module(DEFAULT)
    paths = RunPaths.at(location)
    pipeline = build_pipeline(module, make_settings(module, list(SMALL)), paths)
    model = prepare_run(pipeline, paths)
    if collected:
        assert collect_main(pipeline, paths, rounds=1) == 0
    for version in range(1, versions):
        state = {k: v + 0.01 * version if v.is_floating_point() else v for k, v in model.state_dict().items()}
        publish_weights(paths.store, state, version)
    return paths


def write_jsonl(path, groups: int, *, log_probs: bool = False, ids: bool = False):
    """``groups`` groups of 4 sums; ``ids``: with group and trajectory ids, counted from 0 as a run's export's."""
    records = []
    for g in range(groups):
        a, b = g % 17, (3 * g) % 13
        for d in (0, 1, 0, -1):
            completion = str(a + b + d)
            record = {"messages": [{"role": "user", "content": f"{a}+{b}="}], "completion": completion,
                      "reward": float(d == 0)}
            if log_probs:
                record["log_probs"] = [-0.5] * (len(completion) + 1)  # + EOS
            if ids:
                record.update(group_id=g, trajectory_id=len(records))
            records.append(record)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def rows_of(location: str):
    with open_buffer(location, mode="r") as store:
        return store.read(torch.arange(len(store)))


def test_an_import_into_a_run_gets_a_shard_of_its_own_scored_by_its_newest_policy(run_home, tmp_path, capsys,
                                                                                  monkeypatch):
    """The commands run in this process, from ``tmp_path`` (each CLI start would import torch again:
    seconds on a busy machine; the import killed as a process is the test at a URL below)."""
    run = run_at(f"{run_home}/run", collected=True, versions=3)
    collected = len(rows_of(find_shard(run.buffer_location, 0)))
    source = write_jsonl(tmp_path / "toy.jsonl", 3)
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["import", str(source), run.location, "--quiet"]) == 0
    shard = find_shard(run.buffer_location, IMPORT_SHARD_FIRST)
    out, err = capsys.readouterr()
    assert f"{shard}: 12 rows imported" in out
    # what the run's learner will do with them: max_lag=1 lets it train rows 1 version old at most
    assert ("the rows of this import (policy version 2) it has not taken by the time it trains with version 4 are "
            "passed over, untrained (charts/rows_dropped_stale)") in err, err
    rows = rows_of(shard)
    assert len(rows) == 12 and rows["policy_version"].eq(2).all()
    assert collector_index_of(rows["group_id"]).eq(IMPORT_SHARD_FIRST).all()
    assert collector_index_of(rows["trajectory_id"]).eq(IMPORT_SHARD_FIRST).all()
    # scored by the run's newest weights, rebuilt from the run's own pipeline copy and settings
    model = load_run_pipeline(run).make_model()
    model.load_state_dict(load_weights(run.store, 2)[0])
    expected = reference_log_probs(model, rows["prompt_tokens"], rows["response_tokens"])
    assert torch.allclose(rows["response_log_probs"].values, expected.values, atol=1e-5)
    assert any(name.startswith("import-") for name in run.store.list("imports"))  # recorded
    with hold_run_directory(run, "the test"):  # let go
        pass
    assert not any(p.name.endswith(":") for p in tmp_path.rglob("*"))  # no s3: or az: directory

    assert main(["inspect", f"{run.buffer_location}/", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)  # the learner's view: collector 0's rows and the import's
    assert collected > 0 and stats["rows"] == collected + 12 and stats["extra"]["shards"] == 2
    assert f"{shard.rpartition('/')[2]}: 12" in stats["extra"]["shard_rows"]

    assert main(["import", str(source), run.buffer_location]) == 0
    assert "was already imported" in capsys.readouterr().err
    assert main(["import", str(source), "run", "--home", run_home]) == 0  # the run by its name
    assert "was already imported" in capsys.readouterr().err
    assert len(rows_of(shard)) == 12
    # collector 0 has run (its position history exists): its shard is refused, ids would collide
    assert main(["import", str(source), find_shard(run.buffer_location, 0), "--quiet"]) == 2
    assert "is written by collector 0" in capsys.readouterr().err
    # rows sampled long ago (their log-probs given, version 0): the learner, at version 2, passes them all over
    sampled = write_jsonl(tmp_path / "sampled.jsonl", 2, log_probs=True)
    assert main(["import", str(sampled), run.location, "--quiet", "--policy-version", "0"]) == 0
    err = capsys.readouterr().err
    assert "the run's learner, at version 2, trains no row more than 1 version older" in err, err
    assert "it will pass over all of these rows (policy version 0)" in err


def test_an_import_with_an_unsupported_url_scheme_is_refused(env, tmp_path, monkeypatch, capsys):
    source = write_jsonl(tmp_path / "toy.jsonl", 1)
    monkeypatch.chdir(tmp_path)
    for url in ("gs://bucket/run", "file:///tmp/run"):
        assert main(["import", str(source), url, "--pipeline", DEFAULT]) == 2
        err = capsys.readouterr().err
        assert f"BUFFER {url!r} is a URL with a scheme a run cannot live at" in err
        assert "import into a local path" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["toy.jsonl"]  # nothing taken for a local path


def test_an_import_into_a_run_at_a_url_killed_midway_resumes_without_duplicates(s3_server, env, tmp_path):
    runs = {name: run_at(s3_server.url(name)) for name in ("killed", "clean")}
    # 240 rows in appends of one group, their ids given (numbered again in the import's shard, as the killed
    # import numbered them before)
    source = write_jsonl(tmp_path / "big.jsonl", 60, log_probs=True, ids=True)
    killed, clean = runs["killed"], runs["clean"]
    shard = f"{killed.url}/buffer/{IMPORTED}"
    command = [*CLI, "import", str(source), killed.url, "--rows-per-chunk", "4", "--quiet"]
    process = preloaded.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def rows_now() -> int:
        try:
            with open_store(shard, mode="r") as store:
                return len(store)
        except Exception:  # noqa: BLE001 - not created yet; look again
            return 0

    stderr = kill_when(process, lambda: rows_now() >= 20, timeout=240, wait_s=120).decode()
    assert process.returncode == -signal.SIGKILL, stderr[-3000:]
    assert 20 <= len(rows_of(shard)) < 240

    # the same command again (in this process: the killed one's lease is taken over at once on this host)
    assert main(command[3:]) == 0
    assert main(["import", str(source), clean.url, "--rows-per-chunk", "64", "--quiet"]) == 0
    rows, expected = rows_of(shard), rows_of(f"{clean.url}/buffer/{IMPORTED}")
    assert len(rows) == 240 and rows["trajectory_id"].unique().numel() == 240
    assert rows.equal(expected)
    assert set(collector_index_of(torch.cat([rows["group_id"], rows["trajectory_id"]])).tolist()) == {9000}
    store = ObjectRunStore(killed.url)
    record, = [k for k in store.list("imports")]
    assert record.startswith("import-")


def test_an_import_into_a_store_at_a_url_outside_a_run(s3_server, env, tmp_path, monkeypatch, capsys):
    """A bare Zarr store at a URL: created by the pipeline's create_buffer (Zarr without being told: only
    Zarr lives at a URL), its import record under ``<store>/imports/``; a memmap setting is refused before
    anything is made."""
    monkeypatch.chdir(tmp_path)
    source = write_jsonl(tmp_path / "toy.jsonl", 2, log_probs=True)
    url = s3_server.url("store")
    settings = [a for s in SMALL if not s.startswith("buffer_backend") for a in ("--set", s)]
    assert main(["import", str(source), url, "--pipeline", DEFAULT, "--quiet", *settings,
                 "--set", "buffer_backend=memmap"]) == 2
    assert "only a Zarr buffer can live, but setting 'buffer_backend' is 'memmap'" in capsys.readouterr().err
    assert s3_server.keys(url) == [] and not any(p.name.endswith(":") for p in tmp_path.rglob("*"))

    assert main(["import", str(source), url, "--pipeline", DEFAULT, "--quiet", *settings]) == 0
    assert len(rows_of(url)) == 8
    assert any(k.startswith("imports/import-") for k in s3_server.keys(url))
    assert main(["import", str(source), url, "--pipeline", DEFAULT, *settings, "--set", "buffer_backend=zarr"]) == 0
    assert "was already imported" in capsys.readouterr().err and len(rows_of(url)) == 8
