"""The loop engine: the engine contract over our sampling loop, with exactly generate()'s rows."""

from __future__ import annotations

import pytest
import torch

from rlhf_pipeline.collect import Collector, CollectorConfig, PromptSource, SamplingConfig, make_prompt
from rlhf_pipeline.generation import LoopEngine, SampleRequest, UnsupportedCapability, draw_seed, generate
from rlhf_pipeline.generation.engine import EngineFailed, GenerationEngine
from rlhf_pipeline.models import tiny_model_and_tokenizer
from engine_contract import check_streamed_groups_are_the_sampled_ones_short_first

PROMPTS = ["1+2=", "13+4=", "hello there, add 40+2="]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model_and_tokenizer(hidden_size=32, num_layers=2, num_heads=4)


def _ids(tokenizer):
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for p in PROMPTS]


def test_groups_are_generate_rows_in_the_same_random_stream(tiny):
    model, tok = tiny
    config = SamplingConfig(max_new_tokens=8, temperature=1.5)
    want = generate(model, _ids(tok), config, pad_token_id=0, eos_token_id=1, num_samples=3,
                    generator=torch.Generator().manual_seed(5))
    engine = LoopEngine(model, pad_token_id=0, eos_token_id=1, policy_version=4)
    groups = engine.sample([SampleRequest(p, n=3) for p in _ids(tok)], config, torch.Generator().manual_seed(5))
    assert [g.index for g in groups] == [0, 1, 2] and {g.policy_version for g in groups} == {4}
    rows = [c for g in groups for c in g.completions]
    assert [c.token_ids for c in rows] == [t.tolist() for t in want.response_tokens.to_list()]
    assert [c.log_probs for c in rows] == [t.tolist() for t in want.response_log_probs.to_list()]  # verbatim
    assert [c.terminated for c in rows] == want.terminated.tolist()
    assert all(c.truncated == (not c.terminated) for c in rows)


def test_each_request_is_cut_at_its_own_limit_keeping_a_stop_token_inside_it(tiny):
    model, tok = tiny
    config = SamplingConfig(max_new_tokens=9, temperature=3.0)  # hot: EOS comes early in some rows
    prompts = _ids(tok) * 4
    limits = [9, 2, 5] * 4
    full = generate(model, prompts, config, pad_token_id=0, eos_token_id=[1, 7], generator=torch.Generator().manual_seed(2))
    engine = LoopEngine(model, pad_token_id=0, eos_token_id=[7, 1])
    groups = engine.sample([SampleRequest(p, max_new_tokens=k) for p, k in zip(prompts, limits)], config,
                           torch.Generator().manual_seed(2))
    assert engine.stop_token_ids == [1, 7]
    for group, ids, limit in zip(groups, full.response_tokens.to_list(), limits):
        (completion,) = group.completions
        assert completion.token_ids == ids.tolist()[:limit]
        assert completion.terminated == (completion.token_ids[-1] in (1, 7))
    assert any(g.completions[0].terminated for g in groups) and any(g.completions[0].truncated for g in groups)


def test_weights_move_forward_with_their_time_recorded_and_scoring_is_teacher_forced(tiny):
    _, tok = tiny
    model, _ = tiny_model_and_tokenizer(hidden_size=32, num_layers=2, num_heads=4, seed=0)
    other, _ = tiny_model_and_tokenizer(hidden_size=32, num_layers=2, num_heads=4, seed=1)
    engine = LoopEngine(model, pad_token_id=0, eos_token_id=1)
    assert isinstance(engine, GenerationEngine) and engine.supports_scoring and engine.supports_weight_updates
    assert engine.supports_streaming  # yields each group once its last row stopped
    engine.update_weights(other.state_dict(), 3)
    assert engine.policy_version == 3 and engine.stats.weight_updates == 1 and engine.stats.last_update_s > 0
    assert engine.stats.update_metrics()["weight_update_s"] > 0
    assert engine.stats.update_metrics() == {"weight_update_s": 0.0, "weight_updates": 1.0}  # nothing since
    with pytest.raises(ValueError, match="older than the current 3"):
        engine.update_weights(other.state_dict(), 2)
    config = SamplingConfig(max_new_tokens=6)
    (group,) = engine.sample([SampleRequest(_ids(tok)[0], n=2)], config, torch.Generator().manual_seed(0))
    scored = engine.score([_ids(tok)[0]] * 2, [c.token_ids for c in group.completions], config)
    for completion, log_probs in zip(group.completions, scored):
        torch.testing.assert_close(torch.tensor(log_probs), torch.tensor(completion.log_probs), atol=1e-4, rtol=0)


def test_streaming_falls_back_to_sample_and_seeds_come_from_the_generator(tiny):
    model, tok = tiny
    engine = LoopEngine(model, pad_token_id=0, eos_token_id=1)
    config = SamplingConfig(max_new_tokens=4)
    streamed = list(engine.stream([SampleRequest(p) for p in _ids(tok)], config, torch.Generator().manual_seed(1)))
    sampled = engine.sample([SampleRequest(p) for p in _ids(tok)], config, torch.Generator().manual_seed(1))
    assert [g.completions[0].token_ids for g in streamed] == [g.completions[0].token_ids for g in sampled]
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
    collector = Collector(engine, tok, PromptSource(records), {"zero": lambda p, c, **_: [0.0] * len(c)}, sink=None,
                          config=CollectorConfig(prompts_per_batch=2, num_generations=2,
                                                 sampling=SamplingConfig(max_new_tokens=3)))
    batch = collector.collect()
    assert collector.engine is engine and bool((batch["policy_version"] == 7).all())
    assert collector.last_metrics["weight_updates"] == 0.0
    collector.set_policy_state(model.state_dict(), 8)
    assert bool((collector.collect()["policy_version"] == 8).all()) and collector.last_metrics["weight_update_s"] > 0
    collector.close()
    assert closed == [True]


def test_streamed_groups_are_the_sampled_rows_yielded_as_each_group_stops(tiny):
    """stream() makes the draws sample() makes (rows bit-equal, the generator left in the same state),
    yielding a short request's group at the step its last row stops, before a longer one's."""
    model, tok = tiny
    config = SamplingConfig(max_new_tokens=12, temperature=3.0)  # hot: EOS (7 here) comes early in some rows
    requests = [SampleRequest(p, n=3, max_new_tokens=k) for p, k in zip(_ids(tok) * 3, [12, 3, 7, 12, 1, 9, 5, 12, 2])]
    engine = LoopEngine(model, pad_token_id=0, eos_token_id=[1, 7])
    sampled_with, streamed_with = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    sampled = engine.sample(requests, config, sampled_with)
    order, steps = [], []
    for group in engine.stream(requests, config, streamed_with):
        order.append(group.index)
        steps.append(max(len(c.token_ids) for c in group.completions))  # the step its last row stopped at
    streamed = {g.index: g for g in engine.stream(requests, config, torch.Generator().manual_seed(11))}
    assert sorted(order) == list(range(len(requests))) and order != sorted(order)
    assert steps == sorted(steps)  # yielded as they stop, not in request order
    assert order.index(4) == 0  # the one-token request first, while the others still decode
    for group in sampled:
        mine = streamed[group.index]
        assert [c.token_ids for c in mine.completions] == [c.token_ids for c in group.completions]
        assert [c.log_probs for c in mine.completions] == [c.log_probs for c in group.completions]  # bit-equal
        assert [c.terminated for c in mine.completions] == [c.terminated for c in group.completions]
    assert torch.equal(sampled_with.get_state(), streamed_with.get_state())
    assert any(c.terminated for g in sampled for c in g.completions)


def test_the_loop_engine_streams_as_the_engine_contract_says(tiny):
    model, tok = tiny
    engine = LoopEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    check_streamed_groups_are_the_sampled_ones_short_first(engine, tok)


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
            engine.sample([SampleRequest(p, n=2) for p in _ids(tok)], SamplingConfig(max_new_tokens=4),
                          torch.Generator().manual_seed(0))
        assert "\n" not in str(raised.value) and "learner.lr" in str(raised.value)
    finally:
        model.load_state_dict(saved)
