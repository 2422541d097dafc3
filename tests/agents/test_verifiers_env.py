"""The verifiers 0.1 adapter (``agents/verifiers_env.py``) on real verifiers 0.1.10 environments.

Real ``vf.ToolEnv`` (a real tool), ``vf.Rubric`` (real reward functions, weights) and a
``vf.MultiTurnEnv`` subclass, built in-process on in-memory datasets, driven through our
``rollout`` by the scripted model of ``agent_scripts.py``. Parity with verifiers itself: the same
script goes through verifiers' own ``run_rollout`` (its loop, its scoring), its model an
OpenAI-compatible server that answers from the script on an in-memory ``httpx`` transport (the
only thing scripted is the model, as our sampler is), and the rewards and completions agree.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from agent_scripts import ScriptedModel, scripted_sampler

vf = pytest.importorskip("verifiers", reason="the verifiers adapter's tests need the verifiers extra: "
                                             "pip install -e '.[verifiers]'")
if not hasattr(vf, "MultiTurnEnv"):  # CI installs verifiers 0.4: test_verifiers_v1.py tests its adapter
    pytest.skip(f"verifiers {vf.__version__} has no MultiTurnEnv (0.4 removed it); these tests need "
                "pip install 'verifiers==0.1.10'", allow_module_level=True)
from datasets import Dataset  # noqa: E402  (verifiers depends on datasets)
from verifiers.utils.save_utils import state_to_output  # noqa: E402

from rlhf_pipeline.agents.calculator import multiply  # noqa: E402
from rlhf_pipeline.agents.episode import EpisodeLimits  # noqa: E402
from rlhf_pipeline.agents.rollout import RolloutConfig, rollout  # noqa: E402
from rlhf_pipeline.agents.tools import parse_hermes  # noqa: E402
from rlhf_pipeline.agents.verifiers_env import VerifiersEnvironment, verifiers_tasks  # noqa: E402
from rlhf_pipeline.schema import TerminationReason  # noqa: E402

CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 34}}</tool_call>'
TASKS = [{"question": "What is 12 * 34?", "answer": "408"}, {"question": "What is 12 * 35?", "answer": "420"}]


def correct_answer(completion, answer) -> float:
    """1 when the last assistant message ends with the answer."""
    last = [m for m in completion if m["role"] == "assistant"][-1]["content"]
    return float(last.strip().endswith(answer))


def used_tool(completion) -> float:
    return float(any(m["role"] == "tool" for m in completion))


def tool_env(**kwargs):
    kwargs.setdefault("max_turns", 4)
    return vf.ToolEnv(tools=[multiply], dataset=Dataset.from_list(TASKS), system_prompt="Use the tool.",
                      rubric=vf.Rubric(funcs=[correct_answer, used_tool], weights=[1.0, 0.5]),
                      error_formatter=lambda e: f"Error: {type(e).__name__}: {e}", **kwargs)


def run(env, tokenizer, script, *, group_size=1, limits=EpisodeLimits(), tasks=None):
    """Our rollout of ``env``'s dataset; returns it and the adapters (one per episode, task order)."""
    adapters = []

    def make_env():
        adapters.append(VerifiersEnvironment(env))
        return adapters[-1]

    result = rollout(tasks or verifiers_tasks(env), make_env, scripted_sampler(tokenizer, script), tokenizer,
                     RolloutConfig(group_size=group_size, limits=limits), parser=parse_hermes)
    return result, adapters


def verifiers_own_rollout(env, task, script):
    """verifiers' own ``run_rollout`` (its loop and its scoring) on ``task``, its model answering turn
    k with ``script[k]``, tool calls as an OpenAI-compatible server returns them."""
    import httpx
    import openai

    turns = iter(range(len(script)))

    def answer(request: httpx.Request) -> httpx.Response:
        k = next(turns)
        text = script[k]
        message = {"role": "assistant", "content": text}
        calls = parse_hermes(text)
        if calls:
            message["tool_calls"] = [{"id": f"call_{k}_{j}", "type": "function",
                                      "function": {"name": c.name, "arguments": json.dumps(dict(c.arguments))}}
                                     for j, c in enumerate(calls)]
        return httpx.Response(200, json={
            "id": f"scripted-{k}", "object": "chat.completion", "created": 0, "model": "scripted",
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if calls else "stop"}]})

    async def go():
        client = openai.AsyncOpenAI(api_key="none", base_url="http://scripted.invalid/v1",
                                    http_client=httpx.AsyncClient(transport=httpx.MockTransport(answer)))
        try:
            rollout_input = {k: task[k] for k in ("prompt", "answer", "example_id", "task")}
            return await env.run_rollout(rollout_input, client, "scripted", {})
        finally:
            await client.close()

    return asyncio.run(go())


# ------------------------------------------------------------------ a ToolEnv, tool answers, rewards
def test_a_tool_env_runs_its_tool_and_rewards_as_its_rubric_scores(bpe_tokenizer):
    env = tool_env()
    script = [CALL, "the answer is 408"]
    result, adapters = run(env, bpe_tokenizer, script, group_size=2)

    assert [e.reason for e in result.episodes] == [TerminationReason.ENV_DONE] * 4
    assert [a.state["stop_condition"] for a in adapters] == ["no_tools_called"] * 4
    episode = result.episodes[0]
    assert [m["role"] for m in episode.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert episode.messages[3] == {"role": "tool", "content": "408", "tool_call_id": "call_0_0"}  # the tool ran
    text = bpe_tokenizer.decode(episode.token_ids)
    assert '"description": "Multiplies two integers."' in text  # verifiers' oai_tools, listed by the template
    assert "<|im_start|>tool\n408<|im_end|>" in text
    assert [e.tool_calls for e in result.episodes] == [[1, 0]] * 4
    # rubric: 1.0 x correct + 0.5 x used the tool; turn rewards are the score's changes
    assert [e.rewards for e in result.episodes] == [[0.0, 1.5]] * 2 + [[0.0, 0.5]] * 2

    for task, adapter, episode in zip(verifiers_tasks(env), adapters[::2], result.episodes[::2]):
        own = verifiers_own_rollout(env, task, script)
        assert own["stop_condition"] == "no_tools_called" and own["error"] is None
        assert sum(episode.rewards) == own["reward"] == adapter.state["reward"]
        assert own["metrics"] == adapter.state["metrics"]  # correct_answer, used_tool, num_turns, tool calls
        assert own["completion"] == state_to_output(adapter.state, [])["completion"]  # serialized alike


def test_rows_of_a_tool_env_episode_keep_the_sampled_ids_and_the_tool_answer(bpe_tokenizer):
    env = tool_env()
    result, _ = run(env, bpe_tokenizer, [CALL, "the answer is 408"], tasks=verifiers_tasks(env)[:1])
    rows = result.to_batch(first_group_id=0, first_trajectory_id=0, policy_version=0)
    model = ScriptedModel(bpe_tokenizer, [CALL, "the answer is 408"])
    assert rows["response_tokens"].row(0).tolist() == model.ids(CALL)  # one character per token, as sampled
    assert rows["prompt_text"][1] == "\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"
    assert rows["reward"].tolist() == [0.0, 1.5] and rows["done"].tolist() == [False, True]


# ------------------------------------------------------------------ the model's mistakes
def test_malformed_and_unknown_calls_get_verifiers_error_messages_and_the_episode_goes_on(bpe_tokenizer):
    unclosed = '<tool_call>{"name": "multiply", "arguments": {"a": 12,</tool_call>'
    no_name = '<tool_call>{"arguments": {"a": 12, "b": 34}}</tool_call>'
    unknown = '<tool_call>{"name": "divide", "arguments": {"a": 12, "b": 34}}</tool_call>'
    bad_args = '<tool_call>{"name": "multiply", "arguments": {"x": 1}}</tool_call>'
    env = tool_env(max_turns=6)
    result, adapters = run(env, bpe_tokenizer, [unclosed + no_name, unknown, bad_args, CALL, "the answer is 408"],
                           tasks=verifiers_tasks(env)[:1])
    episode = result.episodes[0]
    assert episode.reason is TerminationReason.ENV_DONE and len(episode.turns) == 5
    tool_answers = [m["content"] for m in episode.messages if m["role"] == "tool"]
    assert tool_answers[0].startswith("Error: JSONDecodeError: ")  # verifiers' json.loads of the raw call
    assert tool_answers[1].startswith("Error: JSONDecodeError: ")  # valid JSON without a name: never run
    assert tool_answers[2] == "Error: KeyError: 'divide'"  # verifiers' tool_map lookup
    assert tool_answers[3].startswith("Error: TypeError: ") and "'x'" in tool_answers[3]
    assert tool_answers[4] == "408"
    assert sum(episode.rewards) == adapters[0].state["reward"] == 1.5


def test_a_stop_error_ends_the_episode_with_tool_error(bpe_tokenizer):
    env = tool_env(stop_errors=[json.JSONDecodeError])
    unclosed = '<tool_call>{"name": "multiply", "arguments": {"a": 12,</tool_call>'
    result, adapters = run(env, bpe_tokenizer, [unclosed, "the answer is 408"], tasks=verifiers_tasks(env)[:1])
    episode = result.episodes[0]
    assert episode.reason is TerminationReason.TOOL_ERROR and len(episode.turns) == 1
    assert adapters[0].state["stop_condition"] == "has_error"
    assert isinstance(adapters[0].state["error"], vf.ToolParseError)
    assert episode.rewards == [0.0]


# ------------------------------------------------------------------ max turns: verifiers' and ours
def test_verifiers_max_turns_ends_with_max_turns_and_the_same_reward_as_verifiers(bpe_tokenizer):
    env = tool_env(max_turns=2)
    result, adapters = run(env, bpe_tokenizer, [CALL], tasks=verifiers_tasks(env)[:1])
    episode = result.episodes[0]
    assert episode.reason is TerminationReason.MAX_TURNS and len(episode.turns) == 2
    assert adapters[0].state["stop_condition"] == "max_turns_reached"
    own = verifiers_own_rollout(env, verifiers_tasks(env)[0], [CALL, CALL])
    assert own["stop_condition"] == "max_turns_reached"
    assert sum(episode.rewards) == own["reward"] == 0.5  # used the tool, no answer


def test_our_max_turns_ends_first_and_the_rewards_still_sum_to_the_rubric_score(bpe_tokenizer):
    env = tool_env(max_turns=10)
    result, adapters = run(env, bpe_tokenizer, [CALL, CALL, "the answer is 408"],
                           limits=EpisodeLimits(max_turns=2), tasks=verifiers_tasks(env)[:1])
    episode = result.episodes[0]
    assert episode.reason is TerminationReason.MAX_TURNS and len(episode.turns) == 2
    assert not adapters[0].state["is_completed"]  # verifiers had not stopped it
    # what verifiers' rubric gives the same conversation (its own rollout, cut at 2 turns)
    own = verifiers_own_rollout(tool_env(max_turns=2), verifiers_tasks(env)[0], [CALL, CALL])
    assert episode.rewards == [0.0, 0.5] and sum(episode.rewards) == own["reward"]


# ------------------------------------------------------------------ a MultiTurnEnv of one's own
class GuessingGame(vf.MultiTurnEnv):
    """Guess the number: "Higher."/"Lower." until right; the last answer ends it (final_env_response).
    Each well-formed guess earns 0.25 on its own step (verifiers' hook for intermediate rewards)."""

    async def env_response(self, messages, state, **kwargs):
        guess, target = int(messages[-1]["content"]), int(state["answer"])
        if guess == target:
            state["final_env_response"] = [{"role": "user", "content": "Correct!"}]
            return state["final_env_response"]
        return [{"role": "user", "content": "Higher." if guess < target else "Lower."}]

    async def add_trajectory_step(self, state, trajectory_step):
        trajectory_step["reward"] = 0.25 if trajectory_step["completion"][-1]["content"].isdigit() else 0.0
        await super().add_trajectory_step(state, trajectory_step)


def solved(completion) -> float:
    return float(completion[-1] == {"role": "user", "content": "Correct!"})


def fewer_guesses(state) -> float:
    return -0.1 * len(state["trajectory"])


def test_a_multiturn_env_of_ones_own_with_its_final_response_and_step_rewards(bpe_tokenizer):
    env = GuessingGame(dataset=Dataset.from_list([{"question": "Guess my number (1-9).", "answer": "7"}]),
                       rubric=vf.Rubric(funcs=[solved, fewer_guesses]), max_turns=5)
    result, adapters = run(env, bpe_tokenizer, ["5", "9", "7"])
    episode = result.episodes[0]
    assert episode.reason is TerminationReason.ENV_DONE
    assert adapters[0].state["stop_condition"] == "has_final_env_response"
    assert [m["content"] for m in episode.messages if m["role"] == "user"] == ["Guess my number (1-9).", "Higher.",
                                                                             "Lower."]
    # rubric scores after each turn: -0.1, -0.2, 1 - 0.3 ("Correct!" is the final env response);
    # their changes, plus 0.25 per step from the environment's own add_trajectory_step
    assert episode.rewards == pytest.approx([0.15, 0.15, 1.15])
    assert adapters[0].state["reward"] == pytest.approx(0.7)
    own = verifiers_own_rollout(env, verifiers_tasks(env)[0], ["5", "9", "7"])
    assert own["reward"] == pytest.approx(adapters[0].state["reward"])
    assert [step["reward"] for step in adapters[0].state["trajectory"]] == [0.25] * 3


# ------------------------------------------------------------------ what does not fit is refused
def test_what_does_not_fit_is_refused_with_the_reason_and_the_fix():
    def group_reward(completions) -> list:
        return [1.0] * len(completions)

    dataset = Dataset.from_list(TASKS)
    with pytest.raises(ValueError, match="group reward functions \\['group_reward'\\]"):
        VerifiersEnvironment(vf.ToolEnv(tools=[multiply], dataset=dataset, rubric=vf.Rubric(funcs=[group_reward])))
    with pytest.raises(ValueError, match="no reward function with a nonzero weight"):
        VerifiersEnvironment(vf.ToolEnv(tools=[multiply], dataset=dataset))
    sampled = tool_env(sampling_args={"temperature": 0.3})
    with pytest.raises(ValueError, match="sampling_args sets {'temperature': 0.3}.*ignore_sampling_args=True"):
        VerifiersEnvironment(sampled)
    VerifiersEnvironment(sampled, ignore_sampling_args=True)
    unscored = tool_env()
    unscored.set_score_rollouts(False)
    with pytest.raises(ValueError, match="score_rollouts is False"):
        VerifiersEnvironment(unscored)
    with pytest.raises(TypeError, match="not a verifiers MultiTurnEnv"):
        VerifiersEnvironment(vf.EnvGroup(envs=[tool_env(), tool_env()], env_names=["a", "b"]))
    with pytest.raises(ValueError, match="a task needs 'prompt' \\(chat messages\\) or 'question'.*\\['answer'\\]"):
        asyncio.run(VerifiersEnvironment(tool_env()).reset({"answer": "408"}))
    adapter = VerifiersEnvironment(tool_env())
    asyncio.run(adapter.reset(TASKS[0]))
    with pytest.raises(RuntimeError, match="runs one episode; make_env must build a new one"):
        asyncio.run(adapter.reset(TASKS[1]))


def test_a_raw_row_gets_the_system_prompt_and_few_shot_as_verifiers_formats_them():
    few_shot = [{"role": "user", "content": "What is 2 * 3?"}, {"role": "assistant", "content": "6"}]
    env = vf.ToolEnv(tools=[multiply], dataset=Dataset.from_list(TASKS), system_prompt="Use the tool.",
                     few_shot=few_shot, rubric=vf.Rubric(funcs=[correct_answer]))
    opening = asyncio.run(VerifiersEnvironment(env).reset(TASKS[0]))
    assert opening == verifiers_tasks(env)[0]["prompt"] == [{"role": "system", "content": "Use the tool."},
                                                            *few_shot, {"role": "user", "content": "What is 12 * 34?"}]


def test_a_conversation_that_does_not_extend_the_last_turn_is_refused_and_drops_its_group(bpe_tokenizer):
    class Forgetful(GuessingGame):
        async def get_prompt_messages(self, state):
            if not state["trajectory"]:
                return state["prompt"]
            return [*state["prompt"], {"role": "user", "content": "Forget that; guess again."}]

    env = Forgetful(dataset=Dataset.from_list([{"question": "Guess (1-9).", "answer": "7"}]),
                    rubric=vf.Rubric(funcs=[solved]), max_turns=3)
    result, _ = run(env, bpe_tokenizer, ["5", "7"])
    (failure,) = result.failures
    assert failure.reason == "step_failed" and "does not extend the previous turn's" in failure.message
    assert result.episodes == [] and result.to_batch(first_group_id=0, first_trajectory_id=0, policy_version=0) is None


def test_without_verifiers_the_error_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "verifiers", None)  # as if it were not installed
    with pytest.raises(ImportError, match=r"pip install -e '\.\[verifiers\]'"):
        VerifiersEnvironment(object())


# ------------------------------------------------------------------ through the collector into a buffer
class Again(vf.MultiTurnEnv):
    """Says "Again." after every turn; verifiers' max_turns ends it."""

    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "Again."}]


def code_points_mod_3(completion) -> float:
    return float(sum(map(ord, completion[-1]["content"])) % 3)


def test_the_agent_collector_writes_verifiers_episodes_with_the_rubrics_rewards(tmp_path):
    import torch

    from rlhf_pipeline.agents.episode import AGENT_ROW_FIELDS, rebuild_trajectory
    from rlhf_pipeline.collect import Collector, CollectorConfig, Environments, SamplingConfig, TaskSource
    from rlhf_pipeline.models import char_tool_tokenizer, tiny_causal_lm
    from rlhf_pipeline.schema import StoreSchema
    from rlhf_pipeline.storage import create_store, make_replay_buffer
    from rlhf_pipeline.transforms.group_advantage import GroupAdvantage

    tokenizer = char_tool_tokenizer()
    model = tiny_causal_lm(len(tokenizer), hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=512,
                           pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, seed=3)
    env = Again(dataset=Dataset.from_list([{"question": f"Say something, {k}.", "answer": ""} for k in range(3)]),
                rubric=vf.Rubric(funcs=[code_points_mod_3]), max_turns=2)
    store = create_store(tmp_path / "buffer", "memmap",
                         schema=StoreSchema(optional=("advantage", "termination_reason", *AGENT_ROW_FIELDS)))
    buffer = make_replay_buffer(store, batch_size=4, transforms=[GroupAdvantage(3)])
    config = CollectorConfig(tasks_per_round=2, group_size=3, sampling=SamplingConfig(temperature=1.5), seed=11)
    episodes = Environments(lambda: VerifiersEnvironment(env), parser=parse_hermes,
                            limits=EpisodeLimits(max_turns=4, max_new_tokens=6, end_on_cut_turn=False))
    collector = Collector(model, tokenizer, TaskSource(verifiers_tasks(env), seed=5), episodes, buffer.extend, config)
    collector.collect()
    rows = store.read(torch.arange(len(store)))
    store.close()

    ids = rows["trajectory_id"].tolist()
    assert len(rows) == 2 * 3 * 2 and sorted(set(ids)) == list(range(6))  # 6 trajectories of 2 turns
    returns = []
    for t in range(6):
        idx = torch.tensor([i for i, u in enumerate(ids) if u == t])
        trajectory = rows.select(idx)
        assert trajectory["step"].tolist() == [0, 1] and trajectory["done"].tolist() == [False, True]
        assert int(trajectory["termination_reason"][1]) == TerminationReason.MAX_TURNS  # verifiers' max_turns
        rebuilt = rebuild_trajectory(trajectory)
        assert "Again." in tokenizer.decode(rebuilt.token_ids[~rebuilt.loss_mask])
        # the rubric reads the last turn as sampled (a turn cut at max_new_tokens keeps every id)
        last = trajectory["response_tokens"].row(1).tolist()
        text = tokenizer.decode(last[:-1] if last[-1] == tokenizer.eos_token_id else last, skip_special_tokens=False)
        assert float(trajectory["reward"].sum()) == pytest.approx(sum(map(ord, text)) % 3)
        returns.append(float(trajectory["reward"].sum()))
        assert len(set(trajectory["advantage"].tolist())) == 1  # one advantage per trajectory
    assert len(set(returns)) > 1  # the sampled text made the rubric's rewards differ
