"""The calculator environment's digit credit, the tool tokenizer's template, the warm start's
demonstrations (real episodes, the model's turns, and only those, in their loss mask) and the
greedy check of what a warm start reached."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from rlhf_pipeline.agents.calculator import (
    CalculatorEnv,
    demonstration,
    digit_credit,
    digit_token_ids,
    evaluate_tool_use,
    multiply,
    product_tasks,
    question_factors,
    warm_start,
    warm_start_demonstrations,
    warm_start_until_copying,
)
from rlhf_pipeline.agents.environment import ModelTurn
from rlhf_pipeline.agents.tools import ToolBox, parse_hermes
from rlhf_pipeline.models import char_tool_tokenizer, tiny_causal_lm
from rlhf_pipeline.models.supervised import warmup_then_cosine
from rlhf_pipeline.pipeline import load_pipeline_module, make_settings
from rlhf_pipeline.schema import TerminationReason

REPO = Path(__file__).resolve().parents[2]


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
    later = warm_start(model, tokenizer, 30, batch_size=8, seed=1, lr=1e-2)
    assert later["loss"] < first["loss"] / 2 and not model.training
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_copy_weight_weighs_the_digits_in_the_loss():
    tokenizer = char_tool_tokenizer()
    assert tokenizer.convert_ids_to_tokens(digit_token_ids(tokenizer)) == list("0123456789")
    losses = []
    for copy_weight in (1.0, 5.0):
        model = tiny_causal_lm(len(tokenizer), hidden_size=32, num_layers=1, num_heads=4, max_position_embeddings=256,
                               pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        losses.append(warm_start(model, tokenizer, 1, batch_size=8, seed=1, copy_weight=copy_weight)["loss"])
    # one step from the same weights on the same demonstrations: only the weighting differs
    assert losses[0] != losses[1] and all(torch.isfinite(torch.tensor(losses)))


def test_a_later_stage_trains_on_demonstrations_of_its_own():
    tokenizer = char_tool_tokenizer()
    losses = []
    for first_step in (0, 0, 5):
        model = tiny_causal_lm(len(tokenizer), hidden_size=32, num_layers=1, num_heads=4, max_position_embeddings=256,
                               pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        losses.append(warm_start(model, tokenizer, 1, batch_size=8, seed=1, first_step=first_step)["loss"])
    # the same weights: the same step gives the same loss, another step's demonstrations another
    assert losses[0] == losses[1] and losses[2] != losses[0]


def test_the_warm_start_never_demonstrates_a_held_out_product():
    # tool_use's own held-out set and warm-start draws: held-out products are drawn, none is in a
    # demonstration's text, and every other demonstration is the one drawn without the set
    module = load_pipeline_module(REPO / "pipelines/tool_use.py")
    settings = make_settings(module)
    held_out = {t["question"] for t in module.held_out_tasks(settings)}
    tokenizer = char_tool_tokenizer()

    def texts(held_out: set[str]) -> list[str]:
        return [tokenizer.decode(e.token_ids, skip_special_tokens=False)
                for _, episodes in warm_start_demonstrations(
                    tokenizer, 40, tool_fraction=settings.warm_start_tool_fraction, seed=settings.seed,
                    low=settings.low, high=settings.high, held_out=held_out)
                for e in episodes]

    every, kept = texts(set()), texts(held_out)
    drawn_held_out = [re.search(r"What is \d+ \* \d+\?", t).group() in held_out for t in every]
    assert sum(drawn_held_out) >= 3  # the draws hit the set: leaving it out is tested
    assert kept == [t for t, held in zip(every, drawn_held_out, strict=True) if not held]
    assert not [q for q in held_out if any(q in t for t in kept)]


def test_a_warm_start_whose_every_task_is_held_out_trains_nothing():
    # a 2 x 2 range: with every product held out no weight moves; with one left they move (so the
    # first is not a warm start that trains on nothing anyway)
    tokenizer = char_tool_tokenizer()
    every_task = {f"What is {a} * {b}?" for a in (2, 3) for b in (2, 3)}
    for held_out, moves in ((every_task, False), (every_task - {"What is 2 * 3?"}, True)):
        model = tiny_causal_lm(len(tokenizer), hidden_size=32, num_layers=1, num_heads=4, max_position_embeddings=256,
                               pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        warm_start(model, tokenizer, 3, batch_size=4, seed=1, low=2, high=3, held_out=held_out)
        moved = any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert moved == moves, held_out


def test_stages_are_added_while_the_check_is_below_the_target():
    tokenizer = char_tool_tokenizer()

    def run(reached_after_each_stage: list[float], more_stages: int):
        model = tiny_causal_lm(len(tokenizer), hidden_size=32, num_layers=1, num_heads=4, max_position_embeddings=256,
                               pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        checks = iter(reached_after_each_stage)
        stage_steps, announced = [], []

        def on_stage(stage, _, next_steps):
            stage_steps.append(int(stage["steps"]))
            announced.append(next_steps)

        result, reached = warm_start_until_copying(
            model, tokenizer, 4, check=lambda m: {"right_factors": next(checks)}, target=0.9, more_stages=more_stages,
            on_stage=on_stage, batch_size=4, seed=1)
        assert announced == stage_steps[1:] + [0]  # each stage says the steps of the one that follows
        return result, reached, stage_steps

    result, reached, stages = run([0.2, 0.5, 0.95], more_stages=2)  # reaches the target in the third stage
    assert stages == [4, 2, 2] and result["steps"] == 8 and reached["right_factors"] == 0.95
    result, reached, stages = run([0.95], more_stages=2)  # at the target after the first: no more
    assert stages == [4] and result["steps"] == 4
    result, reached, stages = run([0.1, 0.3], more_stages=1)  # stages run out below the target
    assert stages == [4, 2] and reached["right_factors"] == 0.3


def test_the_warm_start_schedule_warms_up_then_decays_to_its_floor():
    multiplier = warmup_then_cosine(100, warmup=10, floor=0.1)
    assert multiplier(0) == 0.1 and multiplier(9) == 1.0
    values = [multiplier(s) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))  # never rises after the warm-up
    assert abs(values[-1] - 0.1) < 1e-12 and abs(multiplier(54.5) - 0.55) < 1e-9  # halfway: half-way down


class ScriptedPolicy(torch.nn.Module):
    """A stand-in for a warm-started model whose greedy turns are known: it calls ``multiply`` with
    the question's factors when ``a`` is even and with ``b + 1`` when odd, then answers the tool's
    number, plus 1 when ``b`` is a multiple of 3."""

    def __init__(self, tokenizer):
        super().__init__()
        self.tokenizer, self.weight = tokenizer, torch.nn.Parameter(torch.zeros(1))
        self.assistant = tokenizer.convert_tokens_to_ids("<|assistant|>")

    def turn(self, before: str) -> str:
        a, b = question_factors(before[before.rindex("What is "):].split("<|")[0])
        if "<|tool|>" in before:
            said = int(before[before.rindex("<|tool|>"):].removeprefix("<|tool|>").split("<|")[0])
            return str(said + 1 if b % 3 == 0 else said)
        return f'<tool_call>{{"name":"multiply","arguments":{{"a":{a},"b":{b if a % 2 == 0 else b + 1}}}}}</tool_call>'

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        logits = torch.zeros((*input_ids.shape, len(self.tokenizer)))  # (N, L, V)
        for i, row in enumerate(input_ids.tolist()):
            ids = [t for t, m in zip(row, attention_mask[i].tolist(), strict=True) if m]
            start = len(ids) - ids[::-1].index(self.assistant)  # this turn's first sampled token
            text = self.tokenizer.decode(ids[:start], skip_special_tokens=False)
            script = self.tokenizer.encode(self.turn(text), add_special_tokens=False) + [self.tokenizer.eos_token_id]
            logits[i, -1, script[min(len(ids) - start, len(script) - 1)]] = 1.0
        return type("Output", (), {"logits": logits})()


def test_the_greedy_check_counts_right_factors_and_exact_answers():
    tokenizer = char_tool_tokenizer()
    tasks = product_tasks(24, seed=3)
    reached = evaluate_tool_use(ScriptedPolicy(tokenizer), tokenizer, tasks)
    factors = [question_factors(t["question"]) for t in tasks]
    right = [a % 2 == 0 for a, _ in factors]
    exact = [r and b % 3 != 0 for r, (_, b) in zip(right, factors, strict=True)]
    assert 0 < sum(exact) < sum(right) < len(tasks)  # the tasks tell the three apart
    assert reached == {"tool_calls": 1.0, "right_factors": sum(right) / 24, "exact": sum(exact) / 24}
