"""What every generation engine promises, checked the same way for each (our loop, the vLLM engine
the collector owns, a vLLM server at a URL): EOS and ``max_new_tokens`` conventions, a request's seed
giving the same rows again, and a request's tokens the same alone and beside others."""

from __future__ import annotations

import torch

from rlhf_pipeline.generation import SampleRequest, SamplingConfig, draw_seed
from rlhf_pipeline.generation.loop import teacher_forced_log_probs
from rlhf_pipeline.schema.ragged import RaggedTensor

SAMPLING_CONFIGS = [
    SamplingConfig(max_new_tokens=10),
    SamplingConfig(max_new_tokens=10, temperature=0.7, top_k=7),
    SamplingConfig(max_new_tokens=10, temperature=1.3, top_p=0.9),
]
"""Temperatures, top-k and top-p the stored log-probs are checked at (each engine's log-prob test)."""


def seeds(seed: int, count: int) -> list[int]:
    """``count`` request seeds drawn from a generator seeded with ``seed``, as a collector draws them."""
    generator = torch.Generator().manual_seed(seed)
    return [draw_seed(generator) for _ in range(count)]


def chat_prompts(tok, count: int = 6) -> list[list[int]]:
    """``count`` toy-task prompts as the default pipeline's chat template renders them."""
    return [tok.apply_chat_template([{"role": "user", "content": f"{3 * i + 1}+{i * i}="}], add_generation_prompt=True,
                                    tokenize=True, return_dict=False) for i in range(count)]


def max_log_prob_difference(model, groups, requests, config: SamplingConfig | None) -> float:
    """Largest gap between the engine's stored log-probs and ``model``'s teacher-forced ones under
    ``config``'s sampling distribution (None: the raw one)."""
    prompts = [list(requests[g.index].prompt_ids) for g in groups for _ in g.completions]
    responses = [c.token_ids for g in groups for c in g.completions]
    with torch.no_grad():
        again = teacher_forced_log_probs(model, RaggedTensor.from_sequences(prompts, dtype=torch.int64),
                                         RaggedTensor.from_sequences(responses, dtype=torch.int64), config)
    stored = torch.tensor([p for g in groups for c in g.completions for p in c.log_probs])
    return float((again.values - stored).abs().max())


def check_eos_ends_a_completion_and_the_limit_truncates(engine, tok) -> None:
    eos = tok.eos_token_id
    config = SamplingConfig(max_new_tokens=7, temperature=2.0)  # hot: some stop early, some run out
    requests = [SampleRequest(p, n=8, max_new_tokens=limit) for p, limit in zip(chat_prompts(tok), [7, 3, 7, 5, 7, 2])]
    completions = []
    for base in range(0, 240, 40):  # seed sets until one row stops on EOS (rare for an untrained model)
        groups = engine.sample(requests, list(range(base, base + len(requests))), config)
        completions += [(c, requests[g.index].max_new_tokens) for g in groups for c in g.completions]
        if any(c.terminated for c, _ in completions):
            break
    for completion, limit in completions:
        assert len(completion.token_ids) == len(completion.log_probs) <= limit
        assert eos not in completion.token_ids[:-1]  # nothing after EOS
        if completion.terminated:
            assert completion.token_ids[-1] == eos and not completion.truncated
        else:
            assert len(completion.token_ids) == limit and completion.truncated
    assert any(c.terminated for c, _ in completions) and any(c.truncated for c, _ in completions)


def check_seeds_give_the_same_rows_twice(engine, tok) -> None:
    config = SamplingConfig(max_new_tokens=8, temperature=1.2)
    requests = [SampleRequest(p, n=3) for p in chat_prompts(tok, 4)]
    seeds = [7, 8, 9, 10]
    first = engine.sample(requests, seeds, config)
    again = engine.sample(requests, seeds, config)
    other = engine.sample(requests, [s + 100 for s in seeds], config)

    def rows(groups):
        return [(c.token_ids, c.log_probs) for g in groups for c in g.completions]

    assert rows(first) == rows(again) and rows(first) != rows(other)
    assert [g.seed for g in first] == seeds and [g.index for g in first] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in first[0].completions}) > 1  # the n completions differ


def check_a_request_gives_the_same_tokens_alone_and_beside_others(engine, tok) -> None:
    """What else is in flight does not change a request's tokens: its draws come from its seed alone
    (log-probs may move in their last bits with the batch a request shares)."""
    config = SamplingConfig(max_new_tokens=10, temperature=1.5)
    prompts = chat_prompts(tok, 5)
    mine = SampleRequest(prompts[2], n=3)
    (alone,) = engine.sample([mine], [42], config)
    others = [SampleRequest(p, n=2, max_new_tokens=k) for p, k in zip(prompts, [10, 3, 7, 1, 10])]
    beside = engine.sample(others[:2] + [mine] + others[2:], [1, 2, 42, 3, 4, 5], config)[2]
    assert [c.token_ids for c in beside.completions] == [c.token_ids for c in alone.completions]
    for a, b in zip(alone.completions, beside.completions):
        torch.testing.assert_close(torch.tensor(a.log_probs), torch.tensor(b.log_probs), atol=1e-5, rtol=0)
    futures = [engine.submit(request, seed, config) for request, seed in zip([mine, *others], [42, 5, 6, 7, 8, 9])]
    engine.flush()
    assert [c.token_ids for c in futures[0].result(timeout=600).completions] == [c.token_ids for c in alone.completions]
    assert all(f.result(timeout=600).seed == s for f, s in zip(futures, [42, 5, 6, 7, 8, 9]))
