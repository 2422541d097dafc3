"""Token-exact episodes: sampled ids kept, masks exact, limits and reasons, rows that rebuild exactly."""

from __future__ import annotations

import pytest
import torch
from agent_scripts import ScriptedModel

from rlhf_pipeline.agents.environment import StepResult
from rlhf_pipeline.agents.episode import Episode, EpisodeLimits, episodes_to_batch, rebuild_trajectory
from rlhf_pipeline.agents.tools import ToolBox, parse_hermes
from rlhf_pipeline.schema import StoreSchema, TerminationReason, TrajectoryBatch, validate_batch


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


QUESTION = [{"role": "user", "content": "what is 12 times 34?"}]
CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 34}}</tool_call>'
SCRIPT = ["let me use the calculator tool " + CALL, "the result of the tool is 408", "so the final answer is 408"]


class Calculator:
    """Answers tool calls with the tool box, a plain message with a nudge; done on '408' in turn >= 2."""

    def __init__(self, box):
        self.box = box

    def reset(self, task):
        return list(QUESTION)

    def step(self, turn):
        if turn.tool_calls:
            return StepResult(self.box.run(turn.tool_calls), reward=0.1)
        if turn.index >= 2 and "408" in turn.text:
            return StepResult(reward=1.0, done=True)
        return StepResult([{"role": "user", "content": "go on"}])


@pytest.fixture
def box():
    box = ToolBox([multiply])
    yield box
    box.close()


def play(tokenizer, env, script=SCRIPT, *, limits=EpisodeLimits(), stop=True, **options):
    model = ScriptedModel(tokenizer, script, stop=stop)
    episode = Episode(tokenizer, env.reset({}), limits=limits, tools=env.box.schemas, parser=parse_hermes, **options)
    sampled = []
    while not episode.done:
        ids, log_probs = model.sample(len(episode.turns), episode.max_new_tokens())
        sampled.append((ids, log_probs))
        episode.add_environment(env.step(episode.add_turn(ids, log_probs)))
    return episode, sampled


def test_sampled_ids_stay_verbatim_where_re_encoding_would_change_them(bpe_tokenizer, box):
    episode, sampled = play(bpe_tokenizer, Calculator(box))
    assert episode.reason is TerminationReason.ENV_DONE and len(episode.turns) == 3
    got = [s for s in episode.segments if s.sampled]
    assert [list(s.ids) for s in got] == [ids for ids, _ in sampled]  # verbatim
    assert [list(s.log_probs) for s in got] == [pytest.approx(lp) for _, lp in sampled]
    # decode-then-re-encode gives other ids for every turn, and for the whole trajectory
    for ids, _ in sampled:
        assert bpe_tokenizer.encode(bpe_tokenizer.decode(ids), add_special_tokens=False) != ids
    rendered = episode.render(episode.messages, add_generation_prompt=False)
    assert bpe_tokenizer.encode(rendered, add_special_tokens=False)[:len(episode.token_ids)] != episode.token_ids
    assert episode.metrics["retokenization_drift"] == 2  # counted at both environment turns
    assert episode.metrics["template_mismatch"] == 0
    # the tool was called and answered
    assert episode.turns[0].tool_calls[0].name == "multiply"
    assert {"role": "tool", "name": "multiply", "content": "408"} in episode.messages


def test_the_token_list_is_the_rendered_conversation_and_the_mask_only_the_samples(bpe_tokenizer, box):
    episode, sampled = play(bpe_tokenizer, Calculator(box))
    ids, mask = episode.token_ids, episode.loss_mask
    assert len(mask) == len(ids)
    # as text, the token list is exactly what the template renders for the conversation
    # (up to the end of the last sampled turn)
    text = "".join(s.text for s in episode.segments)
    full = episode.render(episode.messages, add_generation_prompt=False)
    assert full.startswith(text) and full[len(text):] == "\n"  # only the template's closing of the last turn
    # mask == 1 exactly on the sampled positions
    expected = []
    for segment in episode.segments:
        expected += [int(segment.sampled)] * len(segment.ids)
    assert mask == expected and sum(mask) == sum(len(s) for s, _ in sampled)
    # template and environment tokens are never trained
    tokens = bpe_tokenizer.convert_ids_to_tokens(ids)
    im_start = bpe_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert all(m == 0 for i, m in zip(ids, mask) if i == im_start)
    trained_text = [bpe_tokenizer.decode(list(s.ids)) for s in episode.segments if s.sampled]
    assert trained_text == [t + "<|im_end|>" for t in SCRIPT]
    environment = [s.text for s in episode.segments if not s.sampled]
    assert environment[1].startswith("\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n")
    assert environment[2] == "\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"
    assert tokens[len(episode.segments[0].ids) - 1] != "<|im_end|>"  # the opening prompt ends in the generation prompt


def test_a_template_that_is_not_append_only_is_counted_and_the_samples_stay_exact(trimming_tokenizer, box):
    script = ["the answer is   ", "the answer is 408"]  # trailing spaces the template trims away
    episode, sampled = play(trimming_tokenizer, Calculator(box), script=script, limits=EpisodeLimits(max_turns=2))
    assert episode.metrics["template_mismatch"] == 1 and episode.reason is TerminationReason.MAX_TURNS
    assert [list(s.ids) for s in episode.segments if s.sampled] == [ids for ids, _ in sampled]
    # the environment's text carries the closing and the new message once, not the conversation again
    assert episode.segments[2].text == "\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_strips_earlier_thinking_keeps_the_turns_the_model_saw(thinking_tokenizer, box):
    script = ["<think>let me see</think>the answer is 40", "<think>hmm</think>so the final answer is 408",
              "<think>sure</think>the answer is 408"]
    episode, sampled = play(thinking_tokenizer, Calculator(box), script=script)
    assert episode.reason is TerminationReason.ENV_DONE and len(episode.turns) == 3
    assert episode.metrics["template_mismatch"] == 2  # at both environment turns
    assert [list(s.ids) for s in episode.segments if s.sampled] == [ids for ids, _ in sampled]
    # the thinking the model sampled stays trained, in the turns it was sampled in
    assert [thinking_tokenizer.decode(list(s.ids)) for s in episode.segments if s.sampled] == [t + "<|im_end|>" for t in script]
    # each environment turn is its own messages only: no earlier turn is tokenized again
    go_on = "\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"
    assert [s.text for s in episode.segments if not s.sampled][1:] == [go_on, go_on]
    # re-rendering the conversation (what a re-templating system trains on) loses the thinking
    rendered = episode.render(episode.messages, add_generation_prompt=False)
    assert "let me see" not in rendered and "let me see" in "".join(s.text for s in episode.segments)


# ---------------------------------------------------------------------------- limits and reasons
def test_max_turns(bpe_tokenizer, box):
    class Never(Calculator):
        def step(self, turn):
            return StepResult([{"role": "user", "content": "again"}], reward=0.5)

    episode, _ = play(bpe_tokenizer, Never(box), limits=EpisodeLimits(max_turns=4))
    assert episode.reason is TerminationReason.MAX_TURNS and len(episode.turns) == 4
    assert episode.rewards == [0.5] * 4
    with pytest.raises(RuntimeError, match="ended"):
        episode.add_turn([1, 2], [-0.1, -0.1])


def test_a_turn_cut_at_max_new_tokens_ends_with_generation_length(bpe_tokenizer, box):
    episode, sampled = play(bpe_tokenizer, Calculator(box), script=[CALL], limits=EpisodeLimits(max_new_tokens=20))
    assert episode.reason is TerminationReason.GENERATION_LENGTH and episode.reason.truncated
    assert len(sampled) == 1 and len(sampled[0][0]) == 20 and not episode.turns[0].finished
    assert episode.turns[0].tool_calls[0].error is not None  # the cut call is malformed, not run


def test_a_cut_turn_may_go_on_and_the_template_closes_it(bpe_tokenizer, box):
    limits = EpisodeLimits(max_new_tokens=12, max_turns=2, end_on_cut_turn=False)
    episode, _ = play(bpe_tokenizer, Calculator(box), script=["the answer is 408"], limits=limits, stop=False)
    assert episode.reason is TerminationReason.MAX_TURNS
    closing = episode.segments[2]
    assert not closing.sampled and closing.text.startswith("<|im_end|>\n<|im_start|>user")  # not trained
    assert episode.metrics["template_mismatch"] == 0


def test_token_budget_shrinks_the_turn_and_ends_the_episode(bpe_tokenizer, box):
    opening = Episode(bpe_tokenizer, QUESTION, tools=box.schemas).token_ids
    budget = len(opening) + 60
    episode, sampled = play(bpe_tokenizer, Calculator(box), limits=EpisodeLimits(token_budget=budget))
    assert episode.reason is TerminationReason.TOKEN_BUDGET
    assert len(episode.token_ids) <= budget
    # the environment's answer did not fit with room for a turn: it is not in the token list
    assert len(sampled) == 1 and len(episode.segments) == 2

    tight = EpisodeLimits(token_budget=len(opening) + 20)
    episode, sampled = play(bpe_tokenizer, Calculator(box), limits=tight)
    assert len(sampled[0][0]) == 20 and episode.reason is TerminationReason.TOKEN_BUDGET  # cut by the budget


def test_context_length(bpe_tokenizer, box):
    opening = len(Episode(bpe_tokenizer, QUESTION, tools=box.schemas).token_ids)
    episode, sampled = play(bpe_tokenizer, Calculator(box), limits=EpisodeLimits(context_length=opening + 15))
    assert episode.reason is TerminationReason.CONTEXT_FULL and len(sampled[0][0]) == 15
    with pytest.raises(ValueError, match="no room"):
        Episode(bpe_tokenizer, QUESTION, tools=box.schemas, limits=EpisodeLimits(context_length=opening))


def test_the_environment_names_its_reason(bpe_tokenizer, box):
    class Strict(Calculator):
        def step(self, turn):
            return StepResult(reward=-1.0, done=True, reason=TerminationReason.TOOL_ERROR)

    episode, _ = play(bpe_tokenizer, Strict(box))
    assert episode.reason is TerminationReason.TOOL_ERROR and episode.reason.terminated
    (row,) = episode.rows(group_id=0, trajectory_id=0, policy_version=0)
    assert row["terminated"] and not row["truncated"] and row["termination_reason"] == 6


# ---------------------------------------------------------------------------- rows
def test_rows_rebuild_the_token_list_and_mask_byte_for_byte(bpe_tokenizer, box):
    episodes = [play(bpe_tokenizer, Calculator(box))[0],
                play(bpe_tokenizer, Calculator(box), limits=EpisodeLimits(max_turns=2))[0]]
    batch = episodes_to_batch(episodes, group_ids=[7, 7], trajectory_ids=[70, 71], policy_version=3)
    batch = validate_batch(batch, StoreSchema(optional=("termination_reason",)))  # the door accepts them
    assert batch["step"].tolist() == [0, 1, 2, 0, 1]
    assert batch["done"].tolist() == [False, False, True, False, True]
    assert batch["termination_reason"].tolist() == [0, 0, 1, 0, 2]
    assert batch["truncated"].tolist() == [False, False, False, False, True]
    for episode, trajectory in zip(episodes, (70, 71)):
        rows = batch.select(torch.nonzero(batch["trajectory_id"] == trajectory).flatten().flip(0))  # any order
        rebuilt = rebuild_trajectory(rows)
        assert rebuilt.token_ids.numpy().tobytes() == torch.tensor(episode.token_ids, dtype=torch.int32).numpy().tobytes()
        assert rebuilt.loss_mask.tolist() == [bool(m) for m in episode.loss_mask]
        sampled_lp = torch.tensor([p for s in episode.segments for p in (s.log_probs or [0.0] * len(s.ids))])
        assert torch.equal(rebuilt.log_probs, sampled_lp.to(torch.float32))
        assert rebuilt.turn_rewards.tolist() == pytest.approx(episode.rewards)
        assert rebuilt.termination_reason is episode.reason
    # each token is stored once: the rows' tokens add up to the token list
    stored = int(batch["prompt_tokens"].lengths().sum() + batch["response_tokens"].lengths().sum())
    assert stored == sum(len(e.token_ids) for e in episodes)


def test_rebuild_refuses_a_half_trajectory(bpe_tokenizer, box):
    episode, _ = play(bpe_tokenizer, Calculator(box))
    batch = TrajectoryBatch.from_rows(episode.rows(group_id=0, trajectory_id=1, policy_version=0))
    with pytest.raises(ValueError, match="missing"):
        rebuild_trajectory(batch.select([0, 2]))
    with pytest.raises(ValueError, match="last row"):
        rebuild_trajectory(batch.select([0, 1]))
    with pytest.raises(RuntimeError, match="still running"):
        Episode(bpe_tokenizer, QUESTION).rows(group_id=0, trajectory_id=0, policy_version=0)


def test_the_door_checks_termination_reasons(bpe_tokenizer, box):
    from rlhf_pipeline.schema import TrajectoryValidationError

    episode, _ = play(bpe_tokenizer, Calculator(box))
    batch = episodes_to_batch([episode], group_ids=[0], trajectory_ids=[0], policy_version=0)
    schema = StoreSchema(optional=("termination_reason",))
    for bad, says in (([0, 0, 99], "unknown code"), ([1, 0, 1], "not done"), ([0, 0, 2], "disagrees")):
        with pytest.raises(TrajectoryValidationError, match=says):
            validate_batch(batch.with_columns(termination_reason=torch.tensor(bad, dtype=torch.int32)), schema)
