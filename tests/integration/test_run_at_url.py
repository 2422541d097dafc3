"""``run --home s3://...`` and ``run --home az://...``: every piece of run state at the URL (moto's
S3 server, Azurite for Azure, on loopback), local disk only a cache. The run trains exactly as the
same run in a local directory; processes killed with ``kill -9`` resume from the URL, with no round
lost or doubled and no step missing: on S3 a learner and then a collector, on Azure (the same
program; only ``files/cloud_objects.py`` knows the cloud) a learner. Real processes; endpoint and
credentials from the environment as a user's shell gives them (the AWS variables,
``AZURE_STORAGE_CONNECTION_STRING``). The other tests run on S3 only: what they check is above the
cloud. The Azure case skips, saying what to install, without the ``azure`` extra or Azurite.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import kill_when, run_child_pids
from integration.test_default_pipeline import DEFAULT, SMALL

from rlhf_pipeline.cli.main import main
from rlhf_pipeline.files.object_run_store import ObjectRunStore
from rlhf_pipeline.files.run_paths import cache_dir
from rlhf_pipeline.files.shard_names import spread_shard_name
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.pipeline import RunPaths, load_pipeline_module, make_settings
from rlhf_pipeline.storage import open_buffer, open_store

SHARD0 = spread_shard_name(0)  # collector 0's shard at an object-store URL

REPO = Path(__file__).resolve().parents[2]
ZARR = ["--set", "buffer_backend=zarr"]
TIMING = ("time", "tokens_per_s", "_s")  # metrics that measure time, not what was trained


def command(home: str, name: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--home", home, "--run-name", name,
            *SMALL, *ZARR, *extra]


# what tells a child (and this process, reading the results) where each cloud's server is
CLOUD_VARIABLES = {"s3": ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL"),
                   "az": ("AZURE_STORAGE_CONNECTION_STRING",)}


@pytest.fixture()
def server(request):
    """Where the runs live: moto's S3 server, or Azurite in a test parametrized with "azure"."""
    return request.getfixturevalue(f"{getattr(request, 'param', 's3')}_server")


@pytest.fixture()
def env(server, tmp_path, monkeypatch):
    """The cloud's variables for the children and this process (reading the results); the cache
    of runs at a URL under tmp_path."""
    environment = {**server.env(), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    for key in (*CLOUD_VARIABLES[server.url().split("://")[0]], "XDG_CACHE_HOME"):
        monkeypatch.setenv(key, environment[key])
    return environment


def learner_metrics(run_url: str | None = None, run_dir: Path | None = None) -> list[dict]:
    if run_url is not None:
        return read_metrics("metrics.jsonl", store=ObjectRunStore(run_url))
    return read_metrics(run_dir / "metrics.jsonl")


# after a kill, what only counts differs: how many rows the buffer held when a step taken again
# drew (a killed run's collector had run ahead; those rows are kept)
LABELS = ("buffer_rows", "rows_generated")


def trained(records: list[dict], labels: tuple[str, ...] = ()) -> list[dict]:
    """What was trained, step by step: the metrics less those measuring time (and ``labels``)."""
    return [{k: v for k, v in r.items() if not k.endswith(TIMING) and not any(n in k for n in labels)}
            for r in records]


def assert_trained_as_uninterrupted(run_url: str, plain_url: str, steps: int) -> None:
    """The run at ``run_url`` (interrupted and resumed) logged every step once, in order, each equal
    to the uninterrupted run's but for ``LABELS``."""
    resumed = trained(learner_metrics(run_url), LABELS)
    uninterrupted = trained(learner_metrics(plain_url), LABELS)
    assert [r["step"] for r in resumed] == list(range(1, steps + 1))  # every step once, in order
    for step, (a, b) in enumerate(zip(resumed, uninterrupted, strict=True), start=1):
        assert a == b, f"step {step}: {sorted(set(a.items()) ^ set(b.items()))}"


def rows_of(buffer: str) -> dict:
    with open_buffer(buffer, mode="r") as store:
        rows = store.read(torch.arange(len(store)), fields=("policy_version", "reward", "response_tokens"))
    return {"versions": rows["policy_version"].tolist(), "rewards": rows["reward"].tolist(),
            "tokens": [t.tolist() for t in rows["response_tokens"].to_list()]}


def test_a_run_at_a_url_keeps_its_state_there_and_trains_as_in_a_directory(s3_server, env, tmp_path, monkeypatch,
                                                                           capsys):
    home = s3_server.url("runs")
    at_url = subprocess.run([*command(home, "exp1"), "--steps", "4"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=600)
    assert at_url.returncode == 0, at_url.stderr[-3000:]
    assert f"[run] run directory {home}/exp1" in at_url.stderr
    assert "[run] done: 4 learner steps" in at_url.stderr, at_url.stderr[-3000:]
    keys = set(s3_server.keys(f"{home}/exp1"))
    assert any(key.startswith("collector/shard-0000.history/row_") for key in keys), sorted(keys)
    for key in ("settings.json", "pipeline.py", "pacing.json",
                "checkpoints/step_00000004.pt", "weights/policy_00000004.safetensors",
                "metrics.jsonl.parts/00000000.jsonl", "collector/metrics-0000.jsonl.parts/00000000.jsonl",
                f"buffer/{SHARD0}/zarr.json", "STOP"):
        assert key in keys, sorted(keys)
    assert "run.lock" not in keys and not any(k.endswith(".partial") for k in keys)  # let go; nothing half-written
    assert any(k.startswith("tensorboard/events.out.tfevents") for k in keys)
    assert list(tmp_path.iterdir()) == [tmp_path / "cache"]  # no s3: directory beside the command
    cache = cache_dir(f"{home}/exp1")
    assert not any(p.is_file() and p.name != ".prepare.lock" and not {"tensorboard", "fetched"} & set(p.parts)
                   for p in cache.rglob("*"))
    # the collector loaded its weights through this machine's copies (files/machine_cache.py), by etag
    copies = [p.name for p in (cache / "fetched" / "weights").iterdir() if p.suffix == ".safetensors"]
    assert copies and all(name.startswith("policy_000000") and name.count(".") == 2 for name in copies), copies

    # the commands that read a run take its URL (what they need is copied into the cache); in this
    # process, from tmp_path (what they get at a URL is the point, not their process: each CLI start
    # imports torch again, seconds on a busy machine)
    monkeypatch.chdir(tmp_path)
    assert main(["export-model", f"{home}/exp1", "--list-versions"]) == 0
    assert "v4 (weights policy_00000004.safetensors)" in capsys.readouterr().out
    assert main(["export-model", f"{home}/exp1", str(tmp_path / "model")]) == 0
    assert "policy version 4" in capsys.readouterr().out
    assert (tmp_path / "model" / "config.json").is_file()
    assert main(["plot", f"{home}/exp1", "--out", str(tmp_path / "charts")]) == 0
    assert (tmp_path / "charts" / "overview.png").is_file()
    capsys.readouterr()
    assert main(["inspect", f"{home}/exp1/buffer/", "--json"]) == 0
    assert '"shards": 1' in capsys.readouterr().out
    assert main(["show", f"{home}/exp1", "--color", "never"]) == 0
    shown = capsys.readouterr()
    assert "── turn 0" in shown.out
    assert "tokens shown by id" not in shown.err  # decoded with the tokenizer of the run's own pipeline copy
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "charts", "model"]  # no s3: directory

    # a buffer at a URL made before shards took spread names (buffer/shard-0000) goes on as it is: nothing
    # made beside it, and the collector paces by the name the learner counts it under (else the rounds
    # the stall rule lets through take the newest weights, and the run trains differently). Run beside
    # the same run in a local directory
    legacy = RunPaths.at_url(f"{home}/legacy")
    module = load_pipeline_module(DEFAULT)
    settings = make_settings(module, [a for a in [*SMALL, *ZARR] if a != "--set"])
    module.build(settings, legacy).create_buffer(f"{legacy.url}/buffer/shard-0000").close()
    legacy_run = subprocess.Popen([*command(home, "legacy"), "--steps", "4"], cwd=tmp_path, env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        local = subprocess.run([*command(str(tmp_path / "local"), "exp1"), "--steps", "4"], cwd=REPO, env=env,
                               capture_output=True, text=True, timeout=600)
        legacy_err = legacy_run.communicate(timeout=600)[1]
    finally:
        if legacy_run.poll() is None:
            legacy_run.kill()
    assert local.returncode == 0, local.stderr[-3000:]
    assert trained(learner_metrics(f"{home}/exp1")) == trained(learner_metrics(run_dir=tmp_path / "local" / "exp1"))
    assert rows_of(f"{home}/exp1/buffer") == rows_of(str(tmp_path / "local" / "exp1" / "buffer"))

    assert legacy_run.returncode == 0, legacy_err[-3000:]
    assert f"writing to {legacy.url}/buffer/shard-0000" in legacy_err, legacy_err[-3000:]
    assert {key.split("/", 1)[0] for key in s3_server.keys(f"{legacy.url}/buffer")} == {"shard-0000"}
    assert json.loads(legacy.store.read("pacing.json"))["consumed"] == {"shard-0000": 4 * 16}
    assert trained(learner_metrics(legacy.url)) == trained(learner_metrics(f"{home}/exp1"))


def _kill_when(process: subprocess.Popen, run_url: str, steps: int, side: str) -> str:
    """Waits until the run at ``run_url`` has logged ``steps`` learner steps, kills -9 its
    ``side`` ("learn" or "collect") child, and returns what ``run`` printed."""
    home = run_url.rsplit("/", 1)[0]
    out = kill_when(process, lambda: len(learner_metrics(run_url)) >= steps, victims=lambda: run_child_pids(side, home),
                    poll_s=0.1)
    assert process.returncode != 0, out[-3000:]
    return out


# each cloud's kill test: the sides killed in turn, each once the run has logged this many more
# learner steps; the steps each start asks for; the steps the last, uninterrupted start adds. A step
# at a URL costs about a second, paid twice (the killed run and the plain one): the learner is killed
# once step 3 is logged, past its first checkpoint (step 2, learner.checkpoint_every=2) and a version
# published beyond it, which is all its kill needs, and each later start adds 2 steps
KILLS = {"s3": ((("learn", 3), ("collect", 2)), 60, 2), "az": ((("learn", 3),), 40, 2)}


@pytest.mark.slow
@pytest.mark.parametrize("server", ["s3", "azure"], indirect=True)
def test_processes_killed_at_a_url_resume_exactly(server, env, tmp_path):
    """kill -9 of the learner (and on S3 then of the collector, in the resumed run); the same
    command resumes each time, and the run trains exactly as an uninterrupted one with the same
    steps: the same rows (tokens, rewards) and the same losses and rewards step by step. One
    collector: which of several collectors' rows a batch holds first is timing, so only one is
    deterministic.

    Only counts may differ after the learner's kill (``LABELS``): the buffer holds the rows its
    collector wrote ahead before the kill. The versions it published past its checkpoint are
    published again under the same numbers, so the rows sampled with them and the collector's next
    rounds have the uninterrupted run's versions (tests/integration/test_resume_at_every_distance.py
    kills at every distance from the checkpoint)."""
    home = server.url("runs")
    run_url = f"{home}/crash"
    base = command(home, "crash")
    victims, steps, extra = KILLS[home.split("://")[0]]
    logged = 0
    for side, after in victims:
        started = subprocess.Popen([*base, "--steps", str(steps)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        out = _kill_when(started, run_url, logged + after, side)
        if logged:  # a start after a kill
            assert f"[learner] resuming from {run_url}/checkpoints/step_" in out, out[-3000:]
        assert ("the learner failed" if side == "learn" else "the collector exited early") in out, out[-3000:]
        logged = len(learner_metrics(run_url))
    keys = set(server.keys(run_url))
    for key in ("settings.json", "pipeline.py", f"buffer/{SHARD0}/zarr.json"):
        assert key in keys, sorted(keys)
    total = learner_metrics(run_url)[-1]["step"] + extra

    resumed = subprocess.run([*base, "--steps", str(total)], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"[learner] resuming from {run_url}/checkpoints/step_" in resumed.stderr, resumed.stderr[-3000:]
    assert "run.lock" not in set(server.keys(run_url))  # let go
    with open_store(f"{run_url}/buffer/{SHARD0}", mode="r") as shard:
        ids = shard.read(torch.arange(len(shard)), fields=("trajectory_id", "group_id"))
    # every round exactly once: the ids the collector handed out, in order, without a gap
    rows = len(ids["trajectory_id"])
    assert ids["trajectory_id"].tolist() == list(range(rows))
    assert ids["group_id"].tolist() == [i // 4 for i in range(rows)]

    plain = subprocess.run([*command(home, "plain"), "--steps", str(total)], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=600)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert_trained_as_uninterrupted(run_url, f"{home}/plain", total)
    a, b = rows_of(f"{run_url}/buffer"), rows_of(f"{home}/plain/buffer")
    trained_rows = total * 16  # the rows the learner took in (how far the collector ran ahead at the end is timing)
    assert min(len(a["tokens"]), len(b["tokens"])) >= trained_rows
    assert {key: v[:trained_rows] for key, v in a.items()} == {key: v[:trained_rows] for key, v in b.items()}
    assert list(tmp_path.iterdir()) == [tmp_path / "cache"]  # no s3: or az: directory beside the command


def test_a_run_at_a_url_on_ray_keeps_its_state_there(s3_server, env, tmp_path):
    """``--ray`` (a local Ray cluster started for the run): the actors open the run by its URL."""
    pytest.importorskip("ray", reason="the Ray tests need the ray extra: pip install -e '.[ray]'")
    home = s3_server.url("runs")
    done = subprocess.run([*command(home, "on-ray"), "--ray", "--steps", "3"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"[run] run directory {home}/on-ray on Ray" in done.stderr, done.stderr[-3000:]
    assert [r["step"] for r in learner_metrics(f"{home}/on-ray")] == [1, 2, 3]
    keys = set(s3_server.keys(f"{home}/on-ray"))
    assert {"checkpoints/step_00000003.pt", "pacing.json"} <= keys, sorted(keys)
    assert any(key.startswith("collector/shard-0000.history/row_") for key in keys), sorted(keys)
    assert list(tmp_path.iterdir()) == [tmp_path / "cache"]


def test_a_run_whose_lease_was_taken_over_stops_its_processes(s3_server, env, tmp_path):
    """Another command took ``run.lock`` over (as it does once a holder's lease runs out unrenewed):
    ``run`` learns it at its next renewal, stops its collector and learner (they checkpoint), and
    says so; it does not delete the other holder's lock."""
    home = s3_server.url("runs")
    run_url = f"{home}/taken"
    first = subprocess.Popen([*command(home, "taken"), "--steps", "500"], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and first.poll() is None and len(learner_metrics(run_url)) < 2:
            time.sleep(0.5)
        store = ObjectRunStore(run_url)
        store.write("run.lock", b'{"command": "run", "pid": 1, "host": "elsewhere", "lease_s": 30}', fence=False)
        out, _ = first.communicate(timeout=120)  # the holder renews every 10 s
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 2, out[-3000:]
    assert f"{run_url} was taken over by another command" in out, out[-3000:]
    assert "[learner] stopped at step" in out, out[-3000:]
    assert b'"host": "elsewhere"' in store.read("run.lock")


def test_a_run_at_a_url_with_a_memmap_buffer_is_refused_before_anything_is_written(s3_server, env, tmp_path):
    home = s3_server.url("runs")
    refused = subprocess.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--home", home,
                              "--steps", "1"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2, refused.stderr[-3000:]
    errors = [line for line in refused.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "needs a Zarr buffer" in errors[0] and "--set buffer_backend=zarr" in errors[0]
    assert s3_server.keys(f"{home}/default") == []  # not even the lock: it was let go
    assert not (tmp_path / "s3:").exists()


def test_a_run_at_a_url_whose_pipeline_makes_memmap_shards_is_refused_in_one_line(s3_server, env, tmp_path):
    """pipelines/tool_use.py's buffer is memmap by default (buffer_backend, a run setting of every
    pipeline): refused as the default pipeline's is, before any row or local directory is made."""
    tool_use = str(Path(DEFAULT).with_name("tool_use.py"))
    refused = subprocess.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", tool_use, "--home",
                              s3_server.url("runs"), "--steps", "1"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2, refused.stderr[-3000:]
    errors = [line for line in refused.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "needs a Zarr buffer" in errors[0] and "--set buffer_backend=zarr" in errors[0], \
        refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr
    assert not (tmp_path / "s3:").exists()


def test_a_collector_and_a_learner_started_apart_meet_at_the_url(s3_server, env, tmp_path):
    """``collect`` and ``learn`` as separate commands (as on two machines: each with its own
    cache directory and working directory), meeting only at the run's URL."""
    home = s3_server.url("runs")
    base = [sys.executable, "-m", "rlhf_pipeline.cli.main"]
    args = [DEFAULT, "--home", home, "--run-name", "apart", *SMALL, *ZARR]
    machines = {}
    for side in ("collector", "learner"):
        (tmp_path / side).mkdir()
        machines[side] = {**env, "XDG_CACHE_HOME": str(tmp_path / side / "cache")}
    collector = subprocess.Popen([*base, "collect", *args], cwd=tmp_path / "collector", env=machines["collector"],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        learner = subprocess.run([*base, "learn", *args, "--steps", "3"], cwd=tmp_path / "learner",
                                 env=machines["learner"], capture_output=True, text=True, timeout=600)
        out, _ = collector.communicate(timeout=120)  # ends by itself: the learner wrote STOP
    finally:
        if collector.poll() is None:
            collector.kill()
    assert learner.returncode == 0, learner.stderr[-3000:]
    assert collector.returncode == 0 and "[collector] stopped after" in out, out[-3000:]
    assert [r["step"] for r in learner_metrics(f"{home}/apart")] == [1, 2, 3]
    assert int(max(rows_of(f"{home}/apart/buffer")["versions"])) >= 1  # the collector took the learner's weights
    for side in ("collector", "learner"):
        assert [p.name for p in (tmp_path / side).iterdir()] == ["cache"]
