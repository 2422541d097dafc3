"""Rebuilding a run's pipeline from its settings.json: the saved settings come back as they were."""

from __future__ import annotations

from pathlib import Path

import pytest
from dataio_setup import DEFAULT_PIPELINE, REPO

from rlhf_pipeline.dataio.run_pipeline import find_run, settings_from_json
from rlhf_pipeline.pipeline import PipelineError, load_pipeline_module, make_settings, settings_to_json


@pytest.mark.parametrize("pipeline, overrides", [
    (DEFAULT_PIPELINE, ["arch=llama", "learner.loss.clip_eps_high=0.28", "max_lag=none"]),
    (REPO / "pipelines" / "qwen_math.py", ["model_path=/models/q", "learner.loss.aggregation=sequence_mean"]),
])
def test_settings_come_back_from_their_json(pipeline, overrides):
    module = load_pipeline_module(pipeline)
    settings = make_settings(module, overrides)
    again = settings_from_json(module, settings_to_json(settings))
    assert again == settings
    if "model_path=/models/q" in overrides:
        assert isinstance(again.model_path, Path)


def test_settings_json_the_pipeline_no_longer_fits(capsys):
    module = load_pipeline_module(DEFAULT_PIPELINE)
    data = settings_to_json(make_settings(module, ["group_size=4"]))
    data["removed_setting"] = 1  # a setting dropped from the pipeline file since: noted, ignored
    assert settings_from_json(module, data).group_size == 4
    assert "removed_setting" in capsys.readouterr().err
    data["learner"]["loss"]["aggregation"] = "bogus"
    with pytest.raises(PipelineError, match="settings.json does not fit"):
        settings_from_json(module, data)


def test_run_root_is_found_from_the_run_its_buffer_or_a_shard(tiny_run, tmp_path):
    for path in (tiny_run, tiny_run / "buffer", tiny_run / "buffer" / "shard-0000", tiny_run / "buffer" / "shard-9000"):
        assert find_run(path).root == tiny_run.resolve()
    assert find_run(tiny_run / "weights") is None
    assert find_run(tmp_path / "store") is None
