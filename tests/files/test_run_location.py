"""A run's location: a directory, or an ``s3://`` or ``az://`` URL whose state lives there (a local cache
only here); any other URL is refused in one line, never taken for a local path.

``Path("s3://bucket/exp1")`` is ``s3:/bucket/exp1``: before these checks, ``run --home s3://...``
trained happily into a directory named ``s3:`` beside the current directory."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import preloaded

from rlhf_pipeline.files.run_paths import HOME_ENV_VAR, RunLocationError, default_home, run_dir, run_paths

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = str(ROOT / "pipelines" / "default.py")


def test_run_dir_refuses_urls_and_names_the_field(monkeypatch, tmp_path):
    with pytest.raises(RunLocationError, match="--home 's3://runs/team' is a URL"):
        run_dir("exp1", "s3://runs/team")
    with pytest.raises(RunLocationError, match="--run-name"):
        run_dir("gs://bucket/exp1", tmp_path)
    monkeypatch.setenv(HOME_ENV_VAR, str(tmp_path))
    assert run_dir("exp1") == tmp_path.resolve() / "exp1"


def test_a_run_at_an_s3_url_keeps_its_state_there_and_its_cache_here(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    paths = run_paths("exp1", "s3://runs/team/")
    assert paths.url == "s3://runs/team/exp1" and paths.buffer_location == "s3://runs/team/exp1/buffer"
    assert paths.root == (tmp_path / "cache" / "rlhf_pipeline" / "runs" / "s3" / "runs" / "team" / "exp1").resolve()
    assert paths.key(paths.collector_state(1)) == "collector/shard-0001.pt"
    assert (paths.home, paths.name) == ("s3://runs/team", "exp1")
    monkeypatch.setenv(HOME_ENV_VAR, "s3://runs/team")
    assert run_paths("exp2").url == "s3://runs/team/exp2"


def test_urls_a_run_cannot_live_at_are_refused_naming_the_field(monkeypatch):
    with pytest.raises(RunLocationError, match="--home 'gs://runs/team' is a URL with a scheme a run cannot live at"):
        run_paths("exp1", "gs://runs/team")
    with pytest.raises(RunLocationError, match="names no bucket"):
        run_paths("exp1", "s3://")
    with pytest.raises(RunLocationError, match="--run-name"):
        run_paths("gs://bucket/exp1", "s3://runs/team")
    monkeypatch.setenv(HOME_ENV_VAR, "gs://runs/team")
    with pytest.raises(RunLocationError, match=r"\$RLHF_PIPELINE_HOME"):
        default_home()


def test_a_run_at_an_az_url_keeps_its_state_in_the_container(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    paths = run_paths("exp1", "az://runs/team")
    assert paths.url == "az://runs/team/exp1" and paths.buffer_location == "az://runs/team/exp1/buffer"
    assert paths.root == (tmp_path / "cache" / "rlhf_pipeline" / "runs" / "az" / "runs" / "team" / "exp1").resolve()
    with pytest.raises(RunLocationError, match="names no bucket or container"):
        run_paths("exp1", "az://")


@pytest.mark.parametrize("name", ["../elsewhere", "/tmp/elsewhere", "team/exp1", ".", ".."])
def test_a_run_name_that_is_not_one_directory_under_the_home_is_refused(monkeypatch, tmp_path, name):
    """``--run-name ../x`` trained into a directory beside the home, where no command that takes a
    run's name looks for it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for home in (tmp_path / "home", "s3://runs/team"):
        with pytest.raises(RunLocationError, match=r"--run-name .* is not a plain name.*--home"):
            run_paths(name, home)
        monkeypatch.setenv(HOME_ENV_VAR, str(home))  # the home from the environment is no different
        with pytest.raises(RunLocationError, match="is not a plain name"):
            run_paths(name)
    assert not (tmp_path / "home").exists() and not (tmp_path / "elsewhere").exists()


CANNOT_LIVE_AT = "is a URL with a scheme a run cannot live at"


@pytest.mark.parametrize("argv, env, message", [
    (["run", DEFAULT, "--home", "gs://runs/team", "--steps", "1"], {}, CANNOT_LIVE_AT),
    (["run", DEFAULT, "--steps", "1"], {HOME_ENV_VAR: "gs://runs/team"}, CANNOT_LIVE_AT),
    (["replay", DEFAULT, "--buffer", "recorded", "--home", "gs://runs/team"], {}, CANNOT_LIVE_AT),
    (["export-model", "gs://runs/team/exp1", "out", "--list-versions"], {}, CANNOT_LIVE_AT),
    (["plot", "gs://runs/team/exp1", "--out", "charts"], {}, CANNOT_LIVE_AT),
    (["run", DEFAULT, "--run-name", "../exp1", "--steps", "1"], {HOME_ENV_VAR: "home"}, "is not a plain name"),
], ids=["run-home", "run-env-home", "replay-home", "export-model-run", "plot-run", "run-name-outside-home"])
def test_commands_refuse_a_run_at_a_url_they_cannot_use_and_create_nothing(tmp_path, argv, env, message):
    result = preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", *argv], cwd=tmp_path,
                           env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert list(tmp_path.iterdir()) == []  # no gs: or s3: directory, no run, no charts
