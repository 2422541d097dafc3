"""What an engine answers is checked before it is a row (``engine.checked_completions``): the check
itself, and a real collector writing a real buffer through ``VLLMURLEngine`` at a server that answers
badly (``misbehaving_vllm_server.py``, a stand-in for a broken vLLM server on 127.0.0.1)."""

from __future__ import annotations

import numpy as np
import pytest
from misbehaving_vllm_server import FAULTS, MisbehavingVLLMServer

from rlhf_pipeline.collect import Collector, CollectorConfig, PromptSource, SamplingConfig, SingleTurn
from rlhf_pipeline.collect.toy_task import toy_prompts, toy_reward
from rlhf_pipeline.generation.engine import BadAnswer, Completion, checked_completions
from rlhf_pipeline.generation.vllm_http import Retries
from rlhf_pipeline.generation.vllm_url import VLLMURLEngine
from rlhf_pipeline.models import tiny_model_and_tokenizer
from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage import create_store, make_replay_buffer

VOCAB, EOS = 102, 1
RULES = dict(n=1, limit=4, vocab_size=VOCAB, stop_token_ids=[EOS])
TRIES = 3
QUICK = Retries(retries=TRIES - 1, backoff_s=0.01, timeout_s=120.0)


# ---------------------------------------------------------------------------------------------- the check
def test_a_good_answer_becomes_completions_whatever_its_integer_and_float_types():
    # a near-certain token's log-prob may round a few ulps over 0, as the store accepts it
    (completion,) = checked_completions([(np.array([7, 101, EOS]).tolist(), [-0.5, 0, 3.8e-6])], **RULES)
    assert completion == Completion([7, 101, EOS], [-0.5, 0.0, 3.8e-6], terminated=True)
    (numpy_typed,) = checked_completions([([np.int64(7), np.int32(9)], [np.float32(-1.0), -3])], **RULES)
    assert numpy_typed == Completion([7, 9], [-1.0, -3.0], terminated=False)
    assert all(type(t) is int for t in numpy_typed.token_ids) and all(type(p) is float for p in numpy_typed.log_probs)


@pytest.mark.parametrize("ids, log_probs, fault", [
    ([7, 10**6], [-1.0, -1.0], "choice 0 token 1 is 1000000, outside the model's vocabulary of 102 tokens"),
    ([VOCAB], [-1.0], "token 0 is 102, outside the model's vocabulary of 102 tokens"),
    ([-5], [-1.0], "token 0 is -5, outside"),
    ([7.7], [-1.0], "token 0 is 7.7, not an integer id"),
    ([7.0], [-1.0], "token 0 is 7.0, not an integer id"),
    (["5"], [-1.0], "token 0 is '5', not an integer id"),
    ([True], [-1.0], "token 0 is True, not an integer id"),
    ([7], [None], "token 0 has log-prob None, not a number"),
    ([7], ["-1"], "token 0 has log-prob '-1', not a number"),
    ([7], [0.25], "token 0 has log-prob 0.25, not a finite number <= 0"),
    ([7], [float("-inf")], "token 0 has log-prob -inf, not a finite number <= 0"),
    ([7], [float("nan")], "token 0 has log-prob nan"),
    ([7, 8], [-1.0], "choice 0 has 1 log-probs for 2 tokens (one per token)"),
    ([7] * 5, [-1.0] * 5, "choice 0 has 5 tokens, over the request's max_new_tokens 4"),
    ([], [], "choice 0 has token ids [], not a list of at least one id"),
    ("57", [-1.0, -1.0], "choice 0 has token ids '57', not a list"),
    ([7], None, "choice 0 has log-probs None, not a list"),
    ([EOS, 7], [-1.0, -1.0], "token 0 is the stop token 1, with 1 tokens after it"),
])
def test_an_answer_that_cannot_be_a_row_is_refused_naming_the_choice_token_and_fault(ids, log_probs, fault):
    with pytest.raises(BadAnswer) as caught:
        checked_completions([(ids, log_probs)], **RULES)
    assert fault in str(caught.value) and "\n" not in str(caught.value)


def test_an_answer_with_another_number_of_completions_is_refused():
    with pytest.raises(BadAnswer, match=r"^1 completions for a request of n=2$"):
        checked_completions([([7], [-1.0])], **{**RULES, "n": 2})


# ------------------------------------------------------------------------------------- through a collector
@pytest.fixture(scope="module")
def served():
    model, tok = tiny_model_and_tokenizer(seed=0, hidden_size=32, num_layers=2, num_heads=4)
    server = MisbehavingVLLMServer(model, stop_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    yield server, model, tok
    server.stop()


def _collector(engine, tok, sink) -> Collector:
    config = CollectorConfig(tasks_per_round=2, group_size=4,
                             sampling=SamplingConfig(max_new_tokens=6, temperature=1.0))
    source = PromptSource(toy_prompts(10, seed=1), seed=0, required_fields=("answer",))
    return Collector(engine, tok, source, SingleTurn({"toy": toy_reward}), sink, config)


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_bad_answer_is_asked_again_then_stops_the_collector_in_one_line_and_writes_no_row(served, fault, tmp_path):
    server, model, tok = served
    server.fault = None  # honest while the engine checks the server at its start
    engine = VLLMURLEngine(server.url, model, stop_token_ids=[tok.eos_token_id], weight_updates=False, retries=QUICK)
    store = create_store(tmp_path / "buffer", "memmap", schema=StoreSchema())
    collector = _collector(engine, tok, make_replay_buffer(store, batch_size=4).extend)  # the commit path: rows with the state
    try:
        server.fault = fault
        asked_before = server.completions
        with pytest.raises(BadAnswer) as caught:
            collector.collect()
        message = str(caught.value)
        assert "\n" not in message and server.url in message and FAULTS[fault][1] in message, message
        assert f"the last of {TRIES} tries" in message and "did not answer" not in message
        assert server.completions - asked_before >= TRIES  # asked again before giving up
        assert len(store) == 0 and store.next_row == 0
        server.fault = None  # an honest server behind the same URL: the collector goes on
        batch = collector.collect()
        assert len(store) == 8 and int(batch["response_tokens"].values.max()) < model.config.vocab_size
    finally:
        server.fault = None
        collector.close()
        store.close()
