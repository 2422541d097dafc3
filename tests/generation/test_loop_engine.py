"""The loop engine: the engine contract over our sampling loop, a request alone giving exactly
generate()'s rows from a generator seeded with its seed."""

from __future__ import annotations

import pytest
import torch

from rlhf_pipeline.collect import Collector, CollectorConfig, PromptSource, SamplingConfig, SingleTurn, make_prompt
from rlhf_pipeline.generation import LoopEngine, SampleRequest, UnsupportedCapability, draw_seed, generate
from rlhf_pipeline.generation.engine import EngineFailed, GenerationEngine
from rlhf_pipeline.models import tiny_model_and_tokenizer
from engine_contract import (
    check_a_request_gives_the_same_tokens_alone_and_beside_others,
    check_eos_ends_a_completion_and_the_limit_truncates,
    check_seeds_give_the_same_rows_twice,
)

PROMPTS = ["1+2=", "13+4=", "hello there, add 40+2="]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model_and_tokenizer(hidden_size=32, num_layers=2, num_heads=4)


def _ids(tokenizer):
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for p in PROMPTS]


def test_a_request_alone_gives_generate_rows_from_a_generator_seeded_with_its_seed(tiny):
    model, tok = tiny
    config = SamplingConfig(max_new_tokens=8, temperature=1.5)
    engine = LoopEngine(model, pad_token_id=0, eos_token_id=1, policy_version=4)
    for prompt, seed in zip(_ids(tok), [5, 6, 7]):
        want = generate(model, [prompt], config, pad_token_id=0, eos_token_id=1, num_samples=3,
                        generator=torch.Generator().manual_seed(seed))
        (group,) = engine.sample([SampleRequest(prompt, n=3)], [seed], config)
        assert (group.index, group.policy_version, group.seed) == (0, 4, seed)
        assert [c.token_ids for c in group.completions] == [t.tolist() for t in want.response_tokens.to_list()]
        assert [c.log_probs for c in group.completions] == [t.tolist() for t in want.response_log_probs.to_list()]
        assert [c.terminated for c in group.completions] == want.terminated.tolist()
        assert all(c.truncated == (not c.terminated) for c in group.completions)
    engine.close()


def test_each_request_is_cut_at_its_own_limit_keeping_a_stop_token_inside_it(tiny):
    model, tok = tiny
    config = SamplingConfig(max_new_tokens=9, temperature=3.0)  # hot: EOS comes early in some rows
    prompts = _ids(tok) * 4
    limits = [9, 2, 5] * 4
    engine = LoopEngine(model, pad_token_id=0, eos_token_id=[7, 1])
    groups = engine.sample([SampleRequest(p, max_new_tokens=k) for p, k in zip(prompts, limits)],
                           list(range(36, 36 + len(prompts))), config)  # seeds where one row stops on 1 or 7
    assert engine.stop_token_ids == [1, 7]
    for seed, (group, prompt, limit) in enumerate(zip(groups, prompts, limits), start=36):
        full = generate(model, [prompt], config, pad_token_id=0, eos_token_id=[1, 7],
                        generator=torch.Generator().manual_seed(seed))
        (completion,) = group.completions
        assert completion.token_ids == full.response_tokens.to_list()[0].tolist()[:limit]
        assert completion.terminated == (completion.token_ids[-1] in (1, 7))
    assert any(g.completions[0].terminated for g in groups) and any(g.completions[0].truncated for g in groups)
    engine.close()


def test_the_loop_engine_keeps_the_engine_contract(tiny):
    model, tok = tiny
    engine = LoopEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    check_eos_ends_a_completion_and_the_limit_truncates(engine, tok)
    check_seeds_give_the_same_rows_twice(engine, tok)
    check_a_request_gives_the_same_tokens_alone_and_beside_others(engine, tok)
    engine.close()


def test_what_is_submitted_between_two_flushes_is_one_batch_whatever_the_timing(tiny):
    """The loop decodes what is queued once its caller flushes: the same submissions between the same
    flushes give the same bits, however the decoding thread is scheduled; a closed engine fails what
    it never decoded."""
    model, tok = tiny
    config = SamplingConfig(max_new_tokens=6, temperature=1.5)
    requests = [SampleRequest(p, n=2) for p in _ids(tok)]
    runs = []
    for _ in range(3):
        engine = LoopEngine(model, pad_token_id=0, eos_token_id=1)
        futures = []
        for seed, request in enumerate(requests):
            futures.append(engine.submit(request, seed, config))
            assert not futures[0].done()  # nothing starts before the flush
        engine.flush()
        runs.append([(c.token_ids, c.log_probs) for f in futures for c in f.result(timeout=600).completions])
        left = engine.submit(requests[0], 0, config)
        engine.close()
        with pytest.raises(EngineFailed, match="closed before this request was decoded"):
            left.result(timeout=600)
        with pytest.raises(EngineFailed, match="closed"):
            engine.submit(requests[0], 0, config)
    assert runs[0] == runs[1] == runs[2]


def test_weights_move_forward_with_their_time_recorded_and_scoring_is_teacher_forced(tiny):
    _, tok = tiny
    model, _ = tiny_model_and_tokenizer(hidden_size=32, num_layers=2, num_heads=4, seed=0)
    other, _ = tiny_model_and_tokenizer(hidden_size=32, num_layers=2, num_heads=4, seed=1)
    engine = LoopEngine(model, pad_token_id=0, eos_token_id=1)
    assert isinstance(engine, GenerationEngine) and engine.supports_scoring and engine.supports_weight_updates
    engine.load_weights(other.state_dict(), 3)
    assert engine.policy_version == 3 and engine.stats.weight_updates == 1 and engine.stats.last_update_s > 0
    assert engine.stats.update_metrics()["weight_update_s"] > 0
    assert engine.stats.update_metrics() == {"weight_update_s": 0.0, "weight_updates": 1.0}  # nothing since
    with pytest.raises(ValueError, match="older than the current 3"):
        engine.load_weights(other.state_dict(), 2)
    config = SamplingConfig(max_new_tokens=6)
    (group,) = engine.sample([SampleRequest(_ids(tok)[0], n=2)], [0], config)
    scored = engine.score([_ids(tok)[0]] * 2, [c.token_ids for c in group.completions], config)
    for completion, log_probs in zip(group.completions, scored):
        torch.testing.assert_close(torch.tensor(log_probs), torch.tensor(completion.log_probs), atol=1e-4, rtol=0)


def test_a_rounds_metrics_count_what_grew_since_the_last_report():
    """The prefix cache's figures of an engine that reports them, as the weight loads' seconds above:
    each round's, not the totals."""
    from rlhf_pipeline.generation.engine import EngineStats

    stats = EngineStats(counts_cached=True)
    stats.prompt_tokens, stats.cached_tokens = 10, 4
    assert stats.update_metrics() == {"weight_update_s": 0.0, "weight_updates": 0.0, "prompt_tokens": 10.0,
                                      "prefix_cached_tokens": 4.0}
    stats.prompt_tokens, stats.cached_tokens, stats.update_s_total = 25, 13, 0.5
    assert stats.update_metrics() == {"weight_update_s": 0.5, "weight_updates": 0.0, "prompt_tokens": 15.0,
                                      "prefix_cached_tokens": 9.0}


def test_seeds_come_from_the_generator_and_a_request_needs_a_completion(tiny):
    first, second = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    assert [draw_seed(first) for _ in range(3)] == [draw_seed(second) for _ in range(3)]
    with pytest.raises(ValueError, match="n must be >= 1"):
        SampleRequest([1, 2], n=0)


class _NoScoring(LoopEngine):
    @property
    def supports_scoring(self) -> bool:
        return False

    def score(self, prompts, responses, sampling=None):
        return GenerationEngine.score(self, prompts, responses, sampling)


def test_a_collector_given_an_engine_uses_it_and_closes_it(tiny):
    model, tok = tiny
    closed = []

    class Recording(_NoScoring):
        def close(self):
            closed.append(True)

    engine = Recording(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, policy_version=7)
    with pytest.raises(UnsupportedCapability, match="does not score"):
        engine.score([[1]], [[2]])
    records = [make_prompt({"prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(4)]
    collector = Collector(engine, tok, PromptSource(records), SingleTurn({"zero": lambda p, c, **_: [0.0] * len(c)}), sink=None,
                          config=CollectorConfig(tasks_per_round=2, group_size=2,
                                                 sampling=SamplingConfig(max_new_tokens=3)))
    batch = collector.collect()
    assert collector.engine is engine and bool((batch["policy_version"] == 7).all())
    assert collector.last_metrics["weight_updates"] == 0.0
    collector.set_policy_state(model.state_dict(), 8)
    assert bool((collector.collect()["policy_version"] == 8).all()) and collector.last_metrics["weight_update_s"] > 0
    collector.close()
    assert closed == [True]


def test_generate_refuses_no_prompts_and_an_empty_prompt_before_sampling(tiny):
    model, tok = tiny
    args = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    for prompts in ([], [[5, 6], []]):
        with pytest.raises(ValueError, match="needs at least one prompt and every prompt needs at least one token"):
            generate(model, prompts, SamplingConfig(max_new_tokens=2), num_samples=2, **args)


def test_weights_that_overflow_the_logits_are_an_engine_failure_in_one_line(tiny):
    """A learning rate far too large gives weights that are finite but make the logits overflow: the
    draw fails as an engine failure naming the cause (the collector stops in one line), not with torch's
    'probability tensor contains either inf, nan' traceback."""
    model, tok = tiny
    engine = LoopEngine(model, pad_token_id=0, eos_token_id=1)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.mul_(1e20)  # finite, but q.k and the logits overflow float32
        assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
        with pytest.raises(EngineFailed, match="next-token probabilities are not finite") as raised:
            engine.sample([SampleRequest(p, n=2) for p in _ids(tok)], [0, 1, 2], SamplingConfig(max_new_tokens=4))
        assert "\n" not in str(raised.value) and "learner.lr" in str(raised.value)
    finally:
        model.load_state_dict(saved)
