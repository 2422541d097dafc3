"""The calculator environment's digit credit, the tool tokenizer's template and the warm start's
demonstrations: real episodes, the model's turns (and only those) in their loss mask."""

from __future__ import annotations

import torch

from rlhf_pipeline.agents.calculator import (
    CalculatorEnv,
    demonstration,
    digit_credit,
    multiply,
    product_tasks,
    warm_start,
)
from rlhf_pipeline.agents.environment import ModelTurn
from rlhf_pipeline.agents.tools import ToolBox, parse_hermes
from rlhf_pipeline.models import char_tool_tokenizer, tiny_causal_lm
from rlhf_pipeline.schema import TerminationReason


def test_digit_credit_ranks_near_misses_and_exact_answers():
    assert digit_credit("it is 2146", "2146") == 1.0
    assert digit_credit("2140", "2146") == 0.5 * 3 / 4
    assert digit_credit("2146 or 5", "2146") == 0.0  # the answer is the last number written
    # containing the product is not answering it: digits around it make another number
    assert digit_credit("772146", "2146") == 0.5 * 4 / 6 and digit_credit("21467", "2146") < 0.5
    assert digit_credit("12 then 9999", "2146") == 0.0 and digit_credit("no number", "2146") == 0.0
    env = CalculatorEnv(partial_credit=True)
    env.reset({"question": "What is 37 * 58?", "answer": "2146"})
    assert env.step(ModelTurn(0, "2140", (), True)).reward == 0.375
    strict = CalculatorEnv()
    strict.reset({"question": "What is 37 * 58?", "answer": "2146"})
    assert strict.step(ModelTurn(0, "2140", (), True)).reward == 0.0
    for text, paid in (("772146", 0.0), ("the product is 2146.", 1.0)):
        strict.reset({"question": "What is 37 * 58?", "answer": "2146"})
        assert strict.step(ModelTurn(0, text, (), True)).reward == paid, text


def test_demonstrations_are_episodes_with_the_model_turns_masked_in():
    tokenizer, box = char_tool_tokenizer(), ToolBox([multiply])
    task = product_tasks(1, seed=4)[0]
    with_tool = demonstration(tokenizer, task, use_tool=True, guess=0, toolbox=box)
    guessed = demonstration(tokenizer, task, use_tool=False, guess=1234, toolbox=box)
    assert with_tool.reason is guessed.reason is TerminationReason.ENV_DONE
    assert with_tool.rewards == [0.0, 1.0] and guessed.rewards == [float("1234" == task["answer"])]
    assert with_tool.turns[0].tool_calls == tuple(parse_hermes(with_tool.turns[0].text))
    text = tokenizer.decode(with_tool.token_ids, skip_special_tokens=False)
    assert text.startswith("<|system|>Tools: multiply(a, b)<|user|>" + task["question"] + "<|assistant|><tool_call>")
    assert f"<|tool|>{task['answer']}<|assistant|>{task['answer']}<|end|>" in text
    sampled = [t for t, m in zip(with_tool.token_ids, with_tool.loss_mask, strict=True) if m]
    assert tokenizer.decode(sampled, skip_special_tokens=False).endswith(f"</tool_call><|end|>{task['answer']}<|end|>")
    assert with_tool.metrics["template_mismatch"] == 0  # the tool template is append-only
    box.close()


def test_a_few_warm_start_steps_lower_the_loss_on_the_model_turns():
    tokenizer = char_tool_tokenizer()
    model = tiny_causal_lm(len(tokenizer), hidden_size=32, num_layers=1, num_heads=4, max_position_embeddings=256,
                           pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    first = warm_start(model, tokenizer, 1, batch_size=8, seed=1)
    later = warm_start(model, tokenizer, 15, batch_size=8, seed=1, lr=1e-2)
    assert later["loss"] < first["loss"] / 2 and not model.training
    assert all(torch.isfinite(p).all() for p in model.parameters())
