"""A run directory given as a URL is refused in one line, never taken for a local path.

``Path("s3://bucket/exp1")`` is ``s3:/bucket/exp1``: before this check, ``run --home s3://...``
trained happily into a directory named ``s3:`` beside the current directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_pipeline.files.run_paths import HOME_ENV_VAR, RunLocationError, default_home, run_dir

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = str(ROOT / "pipelines" / "default.py")


def test_run_dir_refuses_urls_and_names_the_field(monkeypatch, tmp_path):
    with pytest.raises(RunLocationError, match="--home 's3://runs/team' is a URL.*buffer_url"):
        run_dir("exp1", "s3://runs/team")
    with pytest.raises(RunLocationError, match="--run-name"):
        run_dir("gs://bucket/exp1", tmp_path)
    monkeypatch.setenv(HOME_ENV_VAR, "s3://runs/team")
    with pytest.raises(RunLocationError, match=r"\$RLHF_PIPELINE_HOME"):
        default_home()
    monkeypatch.setenv(HOME_ENV_VAR, str(tmp_path))
    assert run_dir("exp1") == tmp_path.resolve() / "exp1"


@pytest.mark.parametrize("argv, env", [
    (["run", DEFAULT, "--home", "s3://runs/team", "--steps", "1"], {}),
    (["run", DEFAULT, "--steps", "1"], {HOME_ENV_VAR: "s3://runs/team"}),
    (["replay", DEFAULT, "--buffer", "recorded", "--home", "s3://runs/team"], {}),
    (["export-model", "s3://runs/team/exp1", "out", "--list-versions"], {}),
    (["plot", "s3://runs/team/exp1", "--out", "charts"], {}),
], ids=["run-home", "run-env-home", "replay-home", "export-model-run", "plot-run"])
def test_commands_refuse_a_run_at_a_url_and_create_nothing(tmp_path, argv, env):
    result = subprocess.run([sys.executable, "-m", "rlhf_pipeline.cli.main", *argv], cwd=tmp_path,
                            env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "is a URL" in errors[0], result.stderr
    assert list(tmp_path.iterdir()) == []  # no s3: directory, no run, no charts
