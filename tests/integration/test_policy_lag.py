"""``max_lag`` end to end: real runs, the learner's own record of what each step trained on.

With 0 every trained row was sampled with the weights its step started from (on-policy, as TRL); with
1 none is more than one version behind. The agent pipeline's rounds write as many rows as their
episodes took turns, so a round crosses from one batch into the next: its tail is passed over, not
trained one version too old.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import preloaded

from rlhf_pipeline.learn.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
PIPELINES = REPO / "pipelines"
STEPS = 5
SETTINGS = {
    "default.py": ["warm_start_steps=0", "prompts_per_round=4", "group_size=4", "learner.batch_size=16",
                   "learner.new_rows_per_step=16", "learner.sample_window=32"],
    "tool_use.py": ["warm_start_steps=20", "warm_start_more_stages=0", "warm_start_check_tasks=0", "tasks_per_round=2",
                    "group_size=4", "learner.batch_size=12", "learner.new_rows_per_step=12", "learner.sample_window=24",
                    "log_rounds_every=0"],
}


def trained(tmp_path: Path, pipeline: str, max_lag: int) -> list[dict]:
    """Each learner step's metrics, from a run of ``pipeline`` with ``max_lag``."""
    name = f"lag{max_lag}"
    settings = [arg for item in [*SETTINGS[pipeline], f"max_lag={max_lag}", "learner.log_every=1"]
                for arg in ("--set", item)]
    result = preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", str(PIPELINES / pipeline),
                             "--steps", str(STEPS), "--home", str(tmp_path), "--run-name", name, *settings],
                           cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = read_metrics(tmp_path / name / "metrics.jsonl")
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    return steps


@pytest.mark.parametrize("pipeline", ["default.py", "tool_use.py"])
def test_on_policy_every_trained_row_was_sampled_with_the_weights_its_step_starts_from(tmp_path, pipeline):
    for step in trained(tmp_path, pipeline, max_lag=0):
        # step k starts from version k-1 (the initial policy is 0; every step publishes)
        assert step["charts/row_version_min"] == step["charts/row_version_max"] == step["step"] - 1, step
        assert step["charts/staleness_max"] == 0


@pytest.mark.parametrize("pipeline", ["default.py", "tool_use.py"])
def test_with_one_step_of_overlap_no_trained_row_is_more_than_one_version_behind(tmp_path, pipeline):
    steps = trained(tmp_path, pipeline, max_lag=1)
    assert all(step["charts/staleness_max"] <= 1 for step in steps), [s["charts/staleness_max"] for s in steps]
    assert any(step["charts/staleness_max"] == 1 for step in steps)  # the overlap happened
    if pipeline == "default.py":  # a round is a batch: nothing generated is passed over
        assert steps[-1]["charts/rows_dropped_stale_total"] == 0
