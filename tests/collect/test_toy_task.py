from __future__ import annotations

import torch

from rlhf_pipeline.collect.toy_task import toy_prompts, toy_reward, warm_start
from rlhf_pipeline.generation import SamplingConfig, generate
from rlhf_pipeline.models import tiny_model_and_tokenizer


def sampled_on_held_out_sums(model, tok, n: int = 64, seed: int = 12345) -> dict[str, float]:
    """Mean toy reward and share of completions that stopped, one sample of each of ``n`` sums."""
    records = toy_prompts(n, seed)
    gen = generate(model, [r.render(tok) for r in records], SamplingConfig(max_new_tokens=8),
                   pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                   generator=torch.Generator().manual_seed(seed))
    completions = tok.batch_decode(gen.response_tokens.to_list(), skip_special_tokens=True)
    rewards = toy_reward([], completions, answer=[r.fields["answer"] for r in records])
    return {"reward_mean": sum(rewards) / n, "terminated_frac": float(gen.terminated.float().mean())}


def test_prompts_are_deterministic_and_answers_right():
    a, b = toy_prompts(20, seed=4), toy_prompts(20, seed=4)
    assert a == b and a != toy_prompts(20, seed=5)
    for r in a:
        x, y = r.messages[0]["content"].rstrip("=").split("+")
        assert int(r.fields["answer"]) == int(x) + int(y) and int(x) < 20 and int(y) < 20


def test_reward_gives_partial_credit():
    completions = ["37", "38", "27", "3", "abc", "", "337", " 37 "]
    assert toy_reward([], completions, answer=["37"] * 8) == [1.0, 0.25, 0.25, 0.0, 0.0, 0.0, 0.5 * 2 / 3, 1.0]


def test_short_warm_start_teaches_the_format():
    torch.manual_seed(0)
    model, tok = tiny_model_and_tokenizer(hidden_size=32, num_layers=1, num_heads=4)
    before = sampled_on_held_out_sums(model, tok)
    result = warm_start(model, tok, steps=40, batch_size=32, lr=1e-2)
    after = sampled_on_held_out_sums(model, tok)
    assert result["loss"] < 2.0
    assert not model.training
    # the random model rarely stops and never answers; after 40 steps it writes digits and stops
    assert after["terminated_frac"] > 0.9 > before["terminated_frac"]
    assert after["reward_mean"] > before["reward_mean"] + 0.05


def test_warm_start_never_trains_on_a_held_out_sum():
    # every sum of a 3 x 3 range held out: nothing is left to train on, so no weight moves; with one
    # sum left, the weights move (so the first is not a warm start that trains on nothing anyway)
    every_sum = {f"add-{a}-{b}" for a in range(3) for b in range(3)}
    for held_out, moves in ((every_sum, False), (every_sum - {"add-1-2"}, True)):
        torch.manual_seed(0)
        model, tok = tiny_model_and_tokenizer(hidden_size=32, num_layers=1, num_heads=4)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        warm_start(model, tok, steps=3, batch_size=16, max_operand=3, held_out=held_out)
        moved = any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert moved == moves, held_out


def test_warm_start_batches_equal_the_chat_template_rendered_per_batch():
    # the encoder renders each distinct conversation once; its batches must be what rendering
    # every batch would give, on the tokenizer's padding side and on the other
    from rlhf_pipeline.collect.toy_task import _SftEncoder
    from rlhf_pipeline.models import char_tokenizer

    for side in ("left", "right"):
        tokenizer = char_tokenizer()
        tokenizer.padding_side = side
        encode = _SftEncoder(tokenizer)
        for seed in range(6):  # later batches reuse conversations rendered for earlier ones
            records = toy_prompts(16, seed, max_operand=5)
            conversations = [[*r.messages, {"role": "assistant", "content": r.fields["answer"]}] for r in records]
            expected = tokenizer.apply_chat_template(conversations, tokenize=True, return_dict=True,
                                                     return_assistant_tokens_mask=True, padding=True,
                                                     return_tensors="pt")
            ids, attention, loss_mask = encode(records)
            assert torch.equal(ids, expected["input_ids"])
            assert torch.equal(attention, expected["attention_mask"])
            assert torch.equal(loss_mask, expected["assistant_masks"].bool())
            assert loss_mask.any(dim=1).all()
        assert len(encode._encoded) <= 25  # max_operand ** 2 distinct problems
