from __future__ import annotations

import math

import pytest
import torch

from rlhf_pipeline.collect.rewards import (
    EpisodeFailureRateError,
    RewardError,
    RewardModelReward,
    WeightedReward,
    as_rewards,
    exact_match,
    extract_number,
    get_reward,
    non_finite_reason,
    numeric_match,
    score,
)
from rlhf_pipeline.collect import Collector, CollectorConfig, PromptSource, SamplingConfig, SingleTurn
from rlhf_pipeline.collect.toy_task import toy_prompts
from rlhf_pipeline.models import tiny_reward_model
from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage import create_store, make_replay_buffer
from rlhf_pipeline.transforms import GroupAdvantage
from helpers import into


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

    for fn, match in [(short, "'short' returned 1 values for 2"),
                      (text, "'text' for completion 0: expected a real number, got 'a'")]:
        with pytest.raises(RewardError, match=match):
            score([WeightedReward(fn.__name__, fn)], ["p", "q"], ["a", "b"])
    # not an error: the collector drops the group (below)
    total, parts = score([WeightedReward("nan", nan)], ["p", "q"], ["a", "b"])
    assert total[0] == 0.0 and math.isnan(total[1]) and math.isnan(parts["nan"][1])
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


# ====================================================================== the checks a collector runs them through
def test_a_reward_given_as_text_is_refused_by_the_agents_check():
    """``'1.0'`` was stored as 1.0 by the single-turn path while ``StepResult(reward='1.0')`` was refused."""
    def text_reward(prompts, completions, **_):
        return ["1.0"] * len(completions)

    with pytest.raises(RewardError, match=r"^reward 'text_reward' for completion 0: expected a real number, got "
                                          r"'1.0' \(str\); numbers are not parsed from text"):
        score(as_rewards(text_reward), ["p"], ["a"])
    for refused in (True, None, b"1", [1.0]):
        with pytest.raises(RewardError, match="expected a real number"):
            score(as_rewards({"r": lambda p, c, **_: [refused]}), ["p"], ["a"])
    with pytest.raises(RewardError, match="must return a list of numbers, got float"):
        score(as_rewards({"r": lambda p, c, **_: 1.0}), ["p"], ["a"])
    import numpy as np

    total, _ = score(as_rewards({"r": lambda p, c, **_: [1, np.float32(0.5), torch.tensor(0.25)]}), ["p"] * 3,
                     ["a"] * 3)
    assert total.tolist() == [1.0, 0.5, 0.25]


def _collector(tiny, reward, sink, **config_fields):
    model, tok = tiny
    config = CollectorConfig(tasks_per_round=3, group_size=4,
                             sampling=SamplingConfig(max_new_tokens=5, temperature=1.5), **config_fields)
    source = PromptSource(toy_prompts(10, seed=1), seed=0, required_fields=("answer",))
    return Collector(model, tok, source, SingleTurn({"r": reward}), sink, config)


def test_a_collector_whose_reward_returns_text_stops_before_writing(tiny):
    sunk = []
    collector = _collector(tiny, lambda prompts, completions, **_: ["1.0"] * len(completions), sunk.append)
    with pytest.raises(RewardError, match="expected a real number, got '1.0'"):
        collector.collect()
    assert sunk == [] and collector.groups_emitted == 0


class NaNOnMultiplesOfThree:
    """NaN for every completion of a prompt whose answer is a multiple of 3 (so, deterministically, for
    the same groups on every run), the completion's length otherwise; remembers each group's answer."""

    def __init__(self):
        self.answers: list[str] = []  # one per group scored, in order

    def __call__(self, prompts, completions, *, answer, **_):
        self.answers += answer[::4]
        return [math.nan if int(a) % 3 == 0 else float(len(c)) for a, c in zip(answer, completions)]


def test_a_nan_reward_drops_its_group_counts_it_and_resumes_to_the_same_rows(tiny, tmp_path, capsys):
    """A NaN reward stopped the whole run (and again on resume); now its group is dropped as the agent
    collector drops one: the other groups are written through the write path, the dropped one counted."""
    store = create_store(tmp_path / "buf", "memmap", schema=StoreSchema(optional=("advantage",)))
    buffer = make_replay_buffer(store, transforms=[GroupAdvantage(4)])
    reward = NaNOnMultiplesOfThree()
    straight = _collector(tiny, reward, buffer.extend, max_failed_group_fraction=None)
    rounds, dropped = [], []
    for _ in range(3):
        seen = len(reward.answers)
        rounds.append(straight.collect())
        dropped.append(sum(int(a) % 3 == 0 for a in reward.answers[seen:]))
        assert straight.last_metrics["groups_dropped"] == dropped[-1]
        assert straight.last_metrics.get("dropped/non_finite_reward", 0) == dropped[-1]
        assert len(rounds[-1]) == 4 * (3 - dropped[-1]) and not torch.isnan(rounds[-1]["reward"]).any()
    assert sum(dropped) and sum(dropped) < 9  # some groups dropped, some written
    err = capsys.readouterr().err
    assert err.count("dropped group") == sum(dropped)
    assert "(non_finite_reward): reward 'r' gave nan for completion" in err
    stored = store.read(torch.arange(len(store)))
    assert len(stored) == sum(len(r) for r in rounds) and not torch.isnan(stored["advantage"]).any()
    # a dropped group's ids stay unused: the ids still follow the prompts
    assert straight.groups_emitted == 9 and straight.trajectories_emitted == 36
    store.close()

    # resumed after the first round: the same groups are dropped, the same rows written
    first = _collector(tiny, NaNOnMultiplesOfThree(), None, max_failed_group_fraction=None)
    first.collect()
    resumed = _collector(tiny, NaNOnMultiplesOfThree(), None, max_failed_group_fraction=None)
    resumed.load_state_dict(first.state_dict())
    for expected in rounds[1:]:
        got = resumed.collect()
        for name in ("group_id", "trajectory_id", "reward"):
            assert torch.equal(got[name], expected[name]), name
        assert torch.equal(got["response_tokens"].values, expected["response_tokens"].values)
        assert torch.equal(got["response_tokens"].offsets, expected["response_tokens"].offsets)


def test_a_round_whose_every_group_is_dropped_writes_nothing_and_reports_no_nan(tiny):
    sunk = []
    collector = _collector(tiny, lambda prompts, completions, **_: [math.inf] * len(completions),
                           lambda batch, writer_state: sunk.append((batch, writer_state["batches_emitted"])),
                           max_failed_group_fraction=None)
    assert collector.collect() is None and sunk == [(None, 1)]  # no rows: the state after the round alone
    metrics = collector.last_metrics
    assert metrics["groups_dropped"] == 3 and metrics["dropped/non_finite_reward"] == 3
    assert all(math.isfinite(v) for v in metrics.values())
    assert collector.collect() is None and collector.groups_emitted == 6  # the prompts move on


def test_a_reward_that_is_never_finite_stops_the_collector_past_the_failure_rate(tiny):
    """Dropping groups must not become a run that burns its compute on nothing: past
    max_failed_group_fraction of the groups (taken over failure_rate_min_groups), collect() raises
    after its round, as the agent collector does, and the count survives a resume."""
    sunk = []
    always_nan = lambda prompts, completions, **_: [math.nan] * len(completions)  # noqa: E731
    collector = _collector(tiny, always_nan, into(sunk), max_failed_group_fraction=0.5,
                           failure_rate_min_groups=8)
    collector.collect()  # 3 of 3 dropped: 3 <= 0.5 * max(3, 8)
    resumed = _collector(tiny, always_nan, into(sunk), max_failed_group_fraction=0.5,
                         failure_rate_min_groups=8)
    resumed.load_state_dict(collector.state_dict())
    assert resumed.groups_dropped == 3
    with pytest.raises(EpisodeFailureRateError) as raised:
        resumed.collect()  # 6 of 6 dropped: past 0.5 * 8
    message = str(raised.value)
    assert "\n" not in message and message.startswith("6 of 6 groups were dropped over non-finite rewards")
    assert "CollectorConfig.max_failed_group_fraction" in message and "reward 'r' gave nan" in message
    assert resumed.last_metrics["groups_dropped_total"] == 6 and resumed.batches_emitted == 2
    with pytest.raises(ValueError, match="'CollectorConfig.max_failed_group_fraction' must be a finite number or none"):
        CollectorConfig(max_failed_group_fraction=float("nan"))


def test_a_reward_beyond_float32s_range_is_named_as_such_when_its_group_is_dropped():
    """1e300 is a finite Python float, stored as float32 it is infinite: the group is dropped as a
    non-finite reward's is, and the reason no longer says the reward gave "inf"."""
    rewards = as_rewards({"huge": (lambda prompts, completions, **_: [1e300, 1.0], 1.0)})
    total, parts = score(rewards, ["p"] * 2, ["a", "b"], {})
    assert math.isinf(float(total[0])) and float(total[1]) == 1.0
    assert non_finite_reason(parts, 0, "a") == (
        "reward 'huge' gave inf (or a value beyond ±3.4e38, float32's range, in which rewards are stored) "
        "for completion 'a'")
    parts["huge"][0] = float("nan")
    assert non_finite_reason(parts, 0, "a") == "reward 'huge' gave nan for completion 'a'"
