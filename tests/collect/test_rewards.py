from __future__ import annotations

import math

import pytest
import torch

from rlhf_pipeline.collect.rewards import (
    RewardError,
    RewardModelReward,
    WeightedReward,
    as_rewards,
    exact_match,
    extract_number,
    get_reward,
    numeric_match,
    score,
)
from rlhf_pipeline.models import tiny_reward_model


@pytest.mark.parametrize("text, value", [
    ("The answer is 42.", 42.0),
    ("3 apples and 5 pears: 8", 8.0),
    ("so \\boxed{17} and later 3", 17.0),
    ("work 12 + 30\n#### 42\nthanks 7", 42.0),
    ("total 1,234 dollars", 1234.0),
    ("-3.5 degrees", -3.5),
    ("no digits", None),
])
def test_extract_number(text, value):
    assert extract_number(text) == value


def test_verifiable_rewards():
    completions = [" 42 ", "41", "it is \\boxed{42}", "x"]
    answers = ["42"] * 4
    assert exact_match([], completions, answer=answers) == [1.0, 0.0, 0.0, 0.0]
    assert numeric_match([], completions, answer=answers) == [1.0, 0.0, 1.0, 0.0]
    fmt = get_reward("format", pattern=r"\d+")
    assert fmt([], completions) == [1.0, 1.0, 0.0, 0.0]
    penalty = get_reward("length_penalty", max_chars=4)
    assert penalty([], ["abcd", "abcdef", "abcdefgh"]) == [0.0, -0.5, -1.0]


def test_weighted_sum_and_components():
    rewards = as_rewards({"exact": (exact_match, 2.0), "short": get_reward("length_penalty", max_chars=2)})
    total, parts = score(rewards, ["p"] * 2, ["42", "4242"], {"answer": ["42", "42"]})
    assert parts["exact"].tolist() == [1.0, 0.0] and parts["short"].tolist() == [0.0, -1.0]
    assert total.tolist() == [2.0, -1.0]


def test_user_callable_receives_prompt_fields():
    seen = {}

    def my_reward(prompts, completions, *, difficulty, **_):
        seen["difficulty"] = difficulty
        return [float(d) * len(c) for c, d in zip(completions, difficulty)]

    total, _ = score(as_rewards(my_reward), ["a", "b"], ["xy", "z"], {"difficulty": [1, 3], "answer": ["", ""]})
    assert seen["difficulty"] == [1, 3] and total.tolist() == [2.0, 3.0]


def test_bad_rewards_are_named():
    def short(prompts, completions, **_):
        return [1.0]

    def nan(prompts, completions, **_):
        return [0.0, math.nan]

    def text(prompts, completions, **_):
        return ["a", "b"]

    for fn, match in [(short, "'short' returned 1 values for 2"), (nan, "'nan' returned a non-finite"),
                      (text, "'text' must return a list of numbers")]:
        with pytest.raises(RewardError, match=match):
            score([WeightedReward(fn.__name__, fn)], ["p", "q"], ["a", "b"])
    with pytest.raises(RewardError, match="needs an 'answer' field"):
        score(as_rewards({"exact": exact_match}), ["p"], ["a"], {})
    with pytest.raises(RewardError, match="unknown reward 'nope'"):
        get_reward("nope")


def test_reward_model_scores_with_a_tiny_classifier(tiny):
    _, tok = tiny
    rm = tiny_reward_model(len(tok), pad_token_id=tok.pad_token_id)
    reward = RewardModelReward(rm, tok, batch_size=2)
    prompts = ["<|user|>1+1=<|assistant|>"] * 3
    completions = ["2<|end|>", "3<|end|>", "a much longer completion<|end|>"]
    values = reward(prompts, completions)
    assert len(values) == 3 and all(math.isfinite(v) for v in values)
    # batching and padding do not change a row's score
    alone = [reward([p], [c])[0] for p, c in zip(prompts, completions)]
    torch.testing.assert_close(torch.tensor(values), torch.tensor(alone), atol=1e-5, rtol=0)
    assert len(set(values)) == 3
    total, parts = score(as_rewards({"rm": reward}), prompts, completions)
    assert torch.equal(total, parts["rm"])
