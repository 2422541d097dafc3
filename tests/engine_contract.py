"""What every generation engine promises, checked the same way for each (the vLLM engine the
collector owns, a vLLM server at a URL): EOS and ``max_new_tokens`` conventions, and seeds drawn
from the collector's generator giving the same rows again."""

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
    groups = engine.sample(requests, config, torch.Generator().manual_seed(1))
    completions = [(c, requests[g.index].max_new_tokens) for g in groups for c in g.completions]
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
    first = engine.sample(requests, config, torch.Generator().manual_seed(7))
    again = engine.sample(requests, config, torch.Generator().manual_seed(7))
    other = engine.sample(requests, config, torch.Generator().manual_seed(8))

    def rows(groups):
        return [(c.token_ids, c.log_probs) for g in groups for c in g.completions]

    assert rows(first) == rows(again) and rows(first) != rows(other)
    generator = torch.Generator().manual_seed(7)  # one seed per request, drawn in submission order
    assert [g.seed for g in first] == [draw_seed(generator) for _ in requests]
    assert len({tuple(c.token_ids) for c in first[0].completions}) > 1  # completion i is seeded seed + i


def check_streamed_groups_are_the_sampled_ones_short_first(engine, tok, *, short_first: bool = True) -> None:
    """An engine that streams: ``stream`` gives ``sample``'s groups for the same generator state (ids and
    log-probs equal), all seeds drawn before the first group, (``short_first``) a one-token request's
    group yielded before the groups that took 10 steps or more, in an earlier batch (an engine whose requests race
    one another, one HTTP request each, gives no such order); a stream left
    early does not disturb the next call."""
    assert engine.supports_streaming
    config = SamplingConfig(max_new_tokens=120)  # long enough that a server's reply of one step comes first
    prompts = chat_prompts(tok, 5)
    # the one-token request first: a server at a URL gets one HTTP request per prompt, and one sent last may
    # arrive after a short group of the others ended
    requests = [SampleRequest(prompts[0], n=2, max_new_tokens=1)] + [SampleRequest(p, n=2) for p in prompts[1:]]
    sampled_with, streamed_with = torch.Generator().manual_seed(21), torch.Generator().manual_seed(21)
    sampled = engine.sample(requests, config, sampled_with)
    stream = engine.stream(requests, config, streamed_with)
    first = next(stream)
    if sampled[0].seed is not None:  # an engine that seeds requests drew every seed before yielding
        assert torch.equal(streamed_with.get_state(), sampled_with.get_state())
    streamed = [first, *stream]
    assert torch.equal(streamed_with.get_state(), sampled_with.get_state())
    order = [g.index for g in streamed]
    assert sorted(order) == list(range(len(requests)))
    by_index = {g.index: g for g in streamed}
    for group in sampled:
        mine = by_index[group.index]
        assert [c.token_ids for c in mine.completions] == [c.token_ids for c in group.completions]
        assert [c.log_probs for c in mine.completions] == [c.log_probs for c in group.completions]
        assert (mine.seed, mine.policy_version) == (group.seed, group.policy_version)
    # the short group did not wait for the long ones (a margin of 10 steps: a server's requests arrive a
    # little apart, as its client's threads are scheduled)
    steps = {g.index: max(len(c.token_ids) for c in g.completions) for g in streamed}
    longer = [k for k in order if steps[k] >= 10]
    assert longer
    if short_first:
        assert all(order.index(0) < order.index(k) for k in longer)
    batches = [[g.index for g in together] for together in
               engine.stream_batches(requests, config, torch.Generator().manual_seed(21))]
    short_in = next(b for b, indices in enumerate(batches) if 0 in indices)
    if short_first:
        assert all(short_in < b for b, indices in enumerate(batches) for k in indices if k in longer), (batches, steps)
    # a consumer that stops after one group: the next call gets its own answer, not the rest of that stream
    abandoned = engine.stream(requests, config, torch.Generator().manual_seed(21))
    next(abandoned)
    abandoned.close()
    again = engine.sample(requests, config, torch.Generator().manual_seed(21))
    assert [c.token_ids for g in again for c in g.completions] == [c.token_ids for g in sampled for c in g.completions]
