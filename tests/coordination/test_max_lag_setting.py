"""``max_lag``, the one pacing setting: the old ones refused by name, the learner's bound derived from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_pipeline.learn.settings import LearnerSettings
from rlhf_pipeline.pipeline import PipelineError, load_pipeline_module, make_settings
from rlhf_pipeline.run_settings import max_staleness

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"


@pytest.mark.parametrize("pipeline", ["default.py", "tool_use.py", "qwen_math.py"])
@pytest.mark.parametrize("old", ["rounds_ahead", "rounds_per_version"])
def test_the_pacing_settings_that_became_max_lag_are_refused_in_one_line_naming_it(pipeline, old):
    module = load_pipeline_module(PIPELINES / pipeline)
    with pytest.raises(PipelineError, match=rf"^setting '{old}' is now 'max_lag': --set max_lag=\.\.\.$"):
        make_settings(module, [f"{old}=0"])


def test_the_learners_staleness_bound_is_set_from_max_lag_only():
    module = load_pipeline_module(PIPELINES / "default.py")
    with pytest.raises(PipelineError, match=r"^setting 'learner.max_staleness' is set from 'max_lag' by the run"):
        make_settings(module, ["learner.max_staleness=3"])
    assert make_settings(module, []).max_lag == 1
    assert make_settings(module, ["max_lag=0"]).learner_settings().max_staleness == 0
    assert make_settings(module, ["max_lag=none"]).learner_settings().max_staleness is None
    with pytest.raises(PipelineError, match="'max_lag' must be >= 0"):
        make_settings(module, ["max_lag=-1"])


@pytest.mark.parametrize(("learner", "lag", "bound"), [
    (LearnerSettings(sampler="exact", uses_per_row=1), 0, 0),
    (LearnerSettings(sampler="exact", uses_per_row=1), 1, 1),
    (LearnerSettings(sampler="exact", uses_per_row=3), 1, 3),  # each use one version older
    (LearnerSettings(sampler="window", batch_size=128, sample_window=256, new_rows_per_step=128), 1, 2),
    (LearnerSettings(sampler="window", new_rows_per_step=0), 2, 2),  # reuses without end: max_lag bounds them
    (LearnerSettings(sampler="prioritized"), 4, 4),
    (LearnerSettings(sampler="epoch"), 1, None),  # a replay of recorded rows
    (LearnerSettings(sampler="exact"), None, None),  # unpaced
])
def test_the_bound_leaves_room_for_the_samplers_reuses(learner, lag, bound):
    assert max_staleness(lag, learner) == bound
