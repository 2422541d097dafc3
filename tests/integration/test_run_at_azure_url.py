"""``run --home az://...``: every piece of run state in an Azure Blob Storage container (Azurite on
loopback), the account from ``AZURE_STORAGE_CONNECTION_STRING`` as a user's shell gives it. The
same program as on S3 (``test_run_at_url.py``), so one test: a learner killed with ``kill -9``
resumes from the URL and the run trains exactly as an uninterrupted one.
"""

from __future__ import annotations

import subprocess

import pytest
from integration.test_run_at_url import (
    LABELS,
    _kill_when,
    command,
    learner_metrics,
    rows_of,
    trained,
)


@pytest.fixture()
def env(azure_server, tmp_path, monkeypatch):
    """The Azure account for the children and this process (reading the results); the cache of
    runs at a URL under tmp_path."""
    environment = {**azure_server.env(), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    for key in ("AZURE_STORAGE_CONNECTION_STRING", "XDG_CACHE_HOME"):
        monkeypatch.setenv(key, environment[key])
    return environment


@pytest.mark.slow
def test_a_learner_killed_at_an_az_url_resumes_exactly(azure_server, env, tmp_path):
    home = azure_server.url("runs")
    run_url = f"{home}/crash"
    base = command(home, "crash")
    first = subprocess.Popen([*base, "--steps", "40"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    out = _kill_when(first, run_url, 3, "learn")
    assert "the learner failed" in out, out[-3000:]
    keys = set(azure_server.keys(run_url))
    for key in ("settings.json", "pipeline.py", "collector/shard-0000.pt", "buffer/shard-0000/zarr.json"):
        assert key in keys, sorted(keys)
    total = learner_metrics(run_url)[-1]["step"] + 2

    resumed = subprocess.run([*base, "--steps", str(total)], check=False, cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"[learner] resuming from {run_url}/checkpoints/step_" in resumed.stderr, resumed.stderr[-3000:]
    assert "run.lock" not in set(azure_server.keys(run_url))  # let go

    plain = subprocess.run([*command(home, "plain"), "--steps", str(total)], check=False, cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=600)
    assert plain.returncode == 0, plain.stderr[-3000:]
    crashed = trained(learner_metrics(run_url), LABELS)
    assert [r["step"] for r in crashed] == list(range(1, total + 1))  # every step once, in order
    for step, (a, b) in enumerate(zip(crashed, trained(learner_metrics(f"{home}/plain"), LABELS), strict=True),
                                  start=1):
        assert a == b, f"step {step}: {sorted(set(a.items()) ^ set(b.items()))}"
    a, b = rows_of(f"{run_url}/buffer"), rows_of(f"{home}/plain/buffer")
    del a["versions"], b["versions"]
    trained_rows = total * 16  # the rows the learner took in (how far the collector ran ahead is timing)
    assert {key: v[:trained_rows] for key, v in a.items()} == {key: v[:trained_rows] for key, v in b.items()}
    assert list(tmp_path.iterdir()) == [tmp_path / "cache"]  # no az: directory beside the command
