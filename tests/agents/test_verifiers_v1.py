"""The verifiers 0.4 adapter (``agents/verifiers_v1.py``) on real ``verifiers.v1`` tasksets.

Real ``vf.Taskset`` / ``vf.Task`` classes with ``@vf.reward``, ``@vf.metric`` and ``@vf.stop``
methods and a real ``vf.Toolset`` (``verifiers_v1_tasks.py``), driven through our ``rollout`` by
the scripted model of ``agent_scripts.py``. Parity with verifiers itself: the same scripts go
through verifiers' own rollout (``vf.Agent.run`` with its ``null`` harness: its chat program in a
subprocess, its interception server, the toolset served over MCP by its own subprocess), its
model an OpenAI-compatible server on a local port that answers from the script (the only thing
scripted is the model, as our sampler is), and the traces agree: messages, rewards, metrics,
stop condition.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import sys
from pathlib import Path

import pytest
from agent_scripts import ScriptedModel, scripted_sampler

vf = pytest.importorskip("verifiers", reason="the verifiers adapter's tests need the verifiers extra: "
                                             "pip install -e '.[verifiers]'")
try:
    import verifiers.v1
except ImportError:
    pass
if not hasattr(getattr(vf, "v1", None), "Taskset"):
    pytest.skip(f"verifiers {vf.__version__} has no verifiers.v1 Taskset: its environments run through "
                "VerifiersEnvironment (test_verifiers_env.py)", allow_module_level=True)

from verifiers_v1_tasks import GuessTaskset, MathTaskset, ToolsConfig  # noqa: E402

from rlhf_pipeline.agents.episode import EpisodeLimits  # noqa: E402
from rlhf_pipeline.agents.rollout import RolloutConfig, rollout  # noqa: E402
from rlhf_pipeline.agents.tools import parse_hermes  # noqa: E402
from rlhf_pipeline.agents.verifiers_v1 import VerifiersV1Environment, verifiers_v1_tasks  # noqa: E402
from rlhf_pipeline.schema import TerminationReason  # noqa: E402

CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 34}}</tool_call>'


def guess(n: int) -> str:
    return f'<tool_call>{{"name": "guess", "arguments": {{"n": {n}}}}}</tool_call>'


# what verifiers' own rollouts are compared on: (taskset, task index, script, its max_turns)
OWN_RUNS = {
    "answers": (MathTaskset, 0, [CALL, "the answer is 408"], 4),
    "cut": (MathTaskset, 0, [CALL, CALL], 2),
    "guesses": (GuessTaskset, 0, [guess(5), guess(9), guess(7), guess(7)], 6),
}


def run(taskset, tokenizer, script, *, max_turns=None, group_size=1, limits=EpisodeLimits(), tasks=None):
    """Our rollout of ``taskset``'s tasks; returns it and the adapters (one per episode, task order)."""
    adapters = []

    def make_env():
        adapters.append(VerifiersV1Environment(taskset, max_turns=max_turns))
        return adapters[-1]

    result = rollout(tasks or verifiers_v1_tasks(taskset), make_env, scripted_sampler(tokenizer, script), tokenizer,
                     RolloutConfig(group_size=group_size, limits=limits), parser=parse_hermes)
    return result, adapters


# ------------------------------------------------------------------ verifiers' own rollouts
def completion(script: list[str], k: int) -> dict:
    """Turn ``k`` of ``script`` as an OpenAI chat.completion, tool calls as a server parses them."""
    message = {"role": "assistant", "content": script[k]}
    calls = parse_hermes(script[k])
    if calls:
        message["tool_calls"] = [{"id": f"call_{k}_{j}", "type": "function",
                                  "function": {"name": c.name, "arguments": json.dumps(dict(c.arguments))}}
                                 for j, c in enumerate(calls)]
    return {"id": f"scripted-{k}", "object": "chat.completion", "created": 0, "model": "scripted",
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if calls else "stop"}]}


async def scripted_server(stack: contextlib.AsyncExitStack) -> str:
    """An OpenAI-compatible endpoint answering each rollout from its script: the script is the
    request's model name, the turn the number of assistant messages in its conversation."""
    from aiohttp import web

    async def answer(request):
        body = await request.json()
        script = OWN_RUNS[body["model"]][2]
        raw = completion(script, sum(m["role"] == "assistant" for m in body["messages"]))
        if not body.get("stream"):
            return web.json_response(raw)
        message = dict(raw["choices"][0]["message"])
        if "tool_calls" in message:
            message["tool_calls"] = [{**call, "index": j} for j, call in enumerate(message["tool_calls"])]
        chunk = {**raw, "object": "chat.completion.chunk",
                 "choices": [{"index": 0, "delta": message, "finish_reason": raw["choices"][0]["finish_reason"]}]}
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1"


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    """verifiers' own rollouts of OWN_RUNS (run at once, one shared tool server): their traces."""
    from verifiers.v1.harnesses.null import NullHarnessConfig
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.mcp import serve_shared
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    scripts = tmp_path_factory.mktemp("verifiers-scripts")
    with pytest.MonkeyPatch.context() as patch:
        # verifiers prepares the null harness's chat program with `uv sync` (network); its
        # dependencies (openai, mcp, httpx, tenacity) are verifiers' own, installed here, so this
        # interpreter runs it: the program is verifiers' unchanged, only its interpreter is ours
        patch.setattr(SubprocessRuntime, "scripts_dir", str(scripts))
        key = f"{scripts}/{hashlib.sha256(CHAT_PROGRAM_SOURCE.encode()).hexdigest()}.py"  # where it would be
        Path(key).write_text(CHAT_PROGRAM_SOURCE)
        patch.setitem(SubprocessRuntime._interpreters, key, sys.executable)
        # the tool server runs `python -m verifiers_v1_tasks`
        patch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))

        async def go():
            async with contextlib.AsyncExitStack() as stack:
                base_url = await scripted_server(stack)
                shared = await stack.enter_async_context(serve_shared(MathTaskset.toolsets(ToolsConfig())))

                async def one(name):
                    taskset_cls, index, _, max_turns = OWN_RUNS[name]
                    agent = vf.v1.Agent(vf.v1.AgentConfig(
                        harness=NullHarnessConfig(id="null"), runtime=vf.v1.SubprocessConfig(), model=name,
                        client=vf.v1.EvalClientConfig(base_url=base_url, api_key_var="VERIFIERS_TEST_NO_KEY"),
                        max_turns=max_turns))
                    task = list(taskset_cls(ToolsConfig()))[index]
                    return name, await agent.run(task, tools=shared)

                return dict(await asyncio.gather(*map(one, OWN_RUNS)))

        traces = asyncio.run(go())
    for name, trace in traces.items():
        assert trace.ok, f"verifiers' own rollout {name} failed: {trace.errors}"
    return traces


def same_trace(ours, theirs):
    """The two traces hold the same conversation, rewards, metrics and ending."""
    assert ours.messages == theirs.messages
    assert ours.rewards == theirs.rewards and ours.metrics == theirs.metrics
    assert ours.stop_condition == theirs.stop_condition and ours.reward == theirs.reward


# ------------------------------------------------------------------ a taskset's tool, its rewards
@pytest.mark.slow  # `own`: verifiers' rollouts, a harness and a tool server per run in subprocesses
def test_a_taskset_with_a_toolset_runs_its_tool_and_rewards_as_the_task_scores(bpe_tokenizer, own):
    taskset = MathTaskset(ToolsConfig())
    result, adapters = run(taskset, bpe_tokenizer, [CALL, "the answer is 408"], max_turns=4, group_size=2)

    assert [e.reason for e in result.episodes] == [TerminationReason.ENV_DONE] * 4
    assert [a.trace.stop_condition for a in adapters] == ["agent_completed"] * 4
    episode = result.episodes[0]
    assert [m["role"] for m in episode.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert episode.messages[3] == {"role": "tool", "content": "408", "tool_call_id": "call_0_0", "name": "multiply"}
    text = bpe_tokenizer.decode(episode.token_ids)
    assert '"description": "Multiplies two integers."' in text  # the toolset's tools, listed by the template
    assert "<|im_start|>tool\n408<|im_end|>" in text
    assert [e.tool_calls for e in result.episodes] == [[1, 0]] * 4
    # 1.0 x correct + 0.5 x used the tool; turn rewards are the changes of trace.reward
    assert [e.rewards for e in result.episodes] == [[0.0, 1.5]] * 2 + [[0.0, 0.5]] * 2
    assert adapters[0].trace.metrics == {"calls": 1.0}
    same_trace(adapters[0].trace, own["answers"])
    assert sum(episode.rewards) == own["answers"].reward


def test_rows_keep_the_sampled_ids_and_the_tool_answer(bpe_tokenizer):
    taskset = MathTaskset(ToolsConfig())
    result, _ = run(taskset, bpe_tokenizer, [CALL, "the answer is 408"], tasks=verifiers_v1_tasks(taskset)[:1])
    rows = result.to_batch(first_group_id=0, first_trajectory_id=0, policy_version=0)
    model = ScriptedModel(bpe_tokenizer, [CALL, "the answer is 408"])
    assert rows["response_tokens"].row(0).tolist() == model.ids(CALL)
    assert rows["prompt_text"][1] == "\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"
    assert rows["reward"].tolist() == [0.0, 1.5] and rows["done"].tolist() == [False, True]


# ------------------------------------------------------------------ the model's mistakes
def test_malformed_and_unknown_calls_get_the_null_harness_errors_and_the_episode_goes_on(bpe_tokenizer):
    unclosed = '<tool_call>{"name": "multiply", "arguments": {"a": 12,</tool_call>'
    no_name = '<tool_call>{"arguments": {"a": 12, "b": 34}}</tool_call>'
    unknown = '<tool_call>{"name": "divide", "arguments": {"a": 12, "b": 34}}</tool_call>'
    bad_args = '<tool_call>{"name": "multiply", "arguments": {"x": 1}}</tool_call>'
    taskset = MathTaskset(ToolsConfig())
    result, adapters = run(taskset, bpe_tokenizer, [unclosed + no_name, unknown, bad_args, CALL, "the answer is 408"],
                           tasks=verifiers_v1_tasks(taskset)[:1])
    episode = result.episodes[0]
    assert episode.reason is TerminationReason.ENV_DONE and len(episode.turns) == 5
    answers = [m["content"] for m in episode.messages if m["role"] == "tool"]
    assert answers[0].startswith("error: invalid JSON in tool arguments (")  # never run
    assert answers[1].startswith("error: invalid JSON in tool arguments (")  # valid JSON without a name: never run
    assert answers[2] == "error: unknown tool 'divide'"
    assert "validation error" in answers[3] and "multiply" in answers[3]  # the MCP server's argument check
    assert answers[4] == "408"
    assert sum(episode.rewards) == adapters[0].trace.reward == 1.5


# ------------------------------------------------------------------ max turns: verifiers' and ours
@pytest.mark.slow  # `own`: verifiers' rollouts, a harness and a tool server per run in subprocesses
def test_verifiers_max_turns_ends_with_max_turns_and_the_reward_verifiers_gives(bpe_tokenizer, own):
    taskset = MathTaskset(ToolsConfig())
    result, adapters = run(taskset, bpe_tokenizer, [CALL], max_turns=2, tasks=verifiers_v1_tasks(taskset)[:1])
    episode = result.episodes[0]
    assert episode.reason is TerminationReason.MAX_TURNS and len(episode.turns) == 2
    same_trace(adapters[0].trace, own["cut"])
    assert sum(episode.rewards) == own["cut"].reward == 0.5  # used the tool (its first answer), no answer


@pytest.mark.slow  # `own`: verifiers' rollouts, a harness and a tool server per run in subprocesses
def test_our_max_turns_ends_first_and_the_rewards_still_sum_to_verifiers_reward(bpe_tokenizer, own):
    taskset = MathTaskset(ToolsConfig())
    result, adapters = run(taskset, bpe_tokenizer, [CALL, CALL, "the answer is 408"], max_turns=10,
                           limits=EpisodeLimits(max_turns=2), tasks=verifiers_v1_tasks(taskset)[:1])
    episode = result.episodes[0]
    assert episode.reason is TerminationReason.MAX_TURNS and len(episode.turns) == 2
    assert not adapters[0].trace.is_completed  # verifiers had not stopped it
    # what verifiers gives the same conversation (its own rollout, stopped at 2 turns)
    assert episode.rewards == [0.0, 0.5] and sum(episode.rewards) == own["cut"].reward


# ------------------------------------------------------------------ a task's own @vf.stop
@pytest.mark.slow  # `own`: verifiers' rollouts, a harness and a tool server per run in subprocesses
def test_a_tasks_stop_ends_the_episode_as_verifiers_stops_its_rollout(bpe_tokenizer, own):
    taskset = GuessTaskset(ToolsConfig())
    result, adapters = run(taskset, bpe_tokenizer, [guess(5), guess(9), guess(7), guess(7)], max_turns=6)
    episode = result.episodes[0]
    assert episode.reason is TerminationReason.ENV_DONE
    assert [m["content"] for m in episode.messages if m["role"] == "tool"] == ["Higher.", "Lower.", "Correct!"]
    # verifiers checks stops before each model call, on the turns committed so far: "Correct!"
    # joins the trace with the model's 4th turn, so the stop fires before the 5th
    assert adapters[0].trace.stop_condition == "solved" and len(episode.turns) == 4
    assert episode.rewards == pytest.approx([-0.1, -0.1, -0.1, 1 - 0.1])
    same_trace(adapters[0].trace, own["guesses"])


# ------------------------------------------------------------------ what does not fit is refused
class Plain(vf.v1.Task[vf.v1.TaskData]):
    @vf.v1.reward
    async def said_something(self, trace: vf.v1.Trace) -> float:
        return float(bool(trace.last_reply))


def taskset_of(task_cls, data=None, toolsets=()):
    """A one-task taskset of ``task_cls`` (its data ``data``), with the given toolset classes."""

    class OneTask(vf.v1.Taskset[task_cls, ToolsConfig]):
        def load(self):
            return [task_cls(data or vf.v1.TaskData(prompt="Say something."), self.config.task)]

        @classmethod
        def toolsets(cls, config):
            return [toolset(config.tools) for toolset in toolsets]

    return OneTask(ToolsConfig())


def reset(taskset):
    return asyncio.run(VerifiersV1Environment(taskset).reset(verifiers_v1_tasks(taskset)[0]))


def test_what_does_not_fit_is_refused_naming_it_and_the_fix():
    class Rewrites(Plain):
        @vf.v1.intercept
        async def shout(self, request: vf.v1.Request) -> vf.v1.Request | None:
            return None

    class StopsOnResponse(Plain):
        @vf.v1.stop
        async def long_reply(self, response: vf.v1.Response) -> bool:
            return len(response.message.content or "") > 100

    class Unscored(vf.v1.Task[vf.v1.TaskData]):
        @vf.v1.metric
        async def length(self, trace: vf.v1.Trace) -> float:
            return float(len(trace.last_reply))

    class Stateful(vf.v1.State):
        seen: int = 0

    class StatefulTools(vf.v1.Toolset[vf.v1.SharedToolsetConfig, Stateful]):
        @vf.v1.tool
        async def count(self) -> int:
            """Counts."""
            return self.state.seen

    class Elsewhere(vf.v1.Toolset[vf.v1.SharedToolsetConfig]):
        def __init__(self, config):
            super().__init__(config.model_copy(update={"url": "http://tools.invalid/mcp"}))

    with pytest.raises(TypeError, match="is a verifiers Env: pass its taskset"):
        VerifiersV1Environment(object.__new__(vf.v1.SingleAgentEnv))
    with pytest.raises(TypeError, match="not a verifiers.v1 Taskset.*VerifiersEnvironment"):
        VerifiersV1Environment(object())
    with pytest.raises(ValueError, match=r"@vf.intercept hooks \['shout'\]"):
        reset(taskset_of(Rewrites))
    with pytest.raises(ValueError, match=r"@vf.stop conditions on a Request or Response \['long_reply'\]"):
        reset(taskset_of(StopsOnResponse))
    with pytest.raises(ValueError, match="Unscored has no @vf.reward with a nonzero weight"):
        reset(taskset_of(Unscored))
    with pytest.raises(ValueError, match="Plain has no prompt: the user opens"):
        reset(taskset_of(Plain, vf.v1.TaskData()))
    with pytest.raises(ValueError, match="requires image 'python:3.12'.*subprocess runtime has no container"):
        reset(taskset_of(Plain, vf.v1.TaskData(prompt="Hi.", image="python:3.12")))
    with pytest.raises(ValueError, match="toolset StatefulTools keeps its own State"):
        reset(taskset_of(Plain, toolsets=[StatefulTools]))
    with pytest.raises(ValueError, match=r"toolset Elsewhere is served elsewhere \(http://tools.invalid/mcp\)"):
        reset(taskset_of(Plain, toolsets=[Elsewhere]))
    adapter = VerifiersV1Environment(taskset_of(Plain))
    asyncio.run(adapter.reset(verifiers_v1_tasks(adapter.taskset)[0]))
    with pytest.raises(RuntimeError, match="runs one episode; make_env must build a new one"):
        asyncio.run(adapter.reset(verifiers_v1_tasks(adapter.taskset)[0]))


def test_a_classic_adapter_given_verifiers_04_says_which_adapter_to_use():
    from rlhf_pipeline.agents.verifiers_env import VerifiersEnvironment, verifiers_tasks

    with pytest.raises(TypeError, match="verifiers.v1 Taskset.*VerifiersV1Environment"):
        VerifiersEnvironment(MathTaskset(ToolsConfig()))
    with pytest.raises(TypeError, match="verifiers.v1 Taskset.*verifiers_v1_tasks"):
        verifiers_tasks(MathTaskset(ToolsConfig()))


def test_without_verifiers_v1_or_on_an_untested_release_the_error_says_what_to_install(monkeypatch):
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "verifiers.v1", None)  # as on verifiers 0.1.x
        with pytest.raises(ImportError, match=r"needs verifiers 0.4.*pip install 'verifiers==0.4.0'.*VerifiersEnvironment"):
            VerifiersV1Environment(object())
    monkeypatch.setattr(vf, "__version__", "0.4.1")  # a release this adapter was not tested on
    with pytest.raises(ImportError, match=r"tested on verifiers 0.4.0; verifiers 0.4.1 is installed"):
        VerifiersV1Environment(MathTaskset(ToolsConfig()))


# ------------------------------------------------------------------ through the collector into a buffer
class Scored(vf.v1.Task[vf.v1.TaskData]):
    @vf.v1.reward
    async def code_points_mod_3(self, trace: vf.v1.Trace) -> float:
        return float(sum(map(ord, trace.assistant_messages[-1].content or "")) % 3)


class SayTaskset(vf.v1.Taskset[Scored, vf.v1.TasksetConfig]):
    def load(self):
        return [Scored(vf.v1.TaskData(prompt=f"Say something, {k}."), self.config.task) for k in range(3)]


def test_the_agent_collector_writes_v1_episodes_with_the_tasks_rewards(tmp_path):
    import torch

    from rlhf_pipeline.agents.episode import AGENT_ROW_FIELDS
    from rlhf_pipeline.collect import Collector, CollectorConfig, Environments, SamplingConfig, TaskSource
    from rlhf_pipeline.models import char_tool_tokenizer, tiny_causal_lm
    from rlhf_pipeline.schema import StoreSchema
    from rlhf_pipeline.storage import create_store, make_replay_buffer
    from rlhf_pipeline.transforms.group_advantage import GroupAdvantage

    tokenizer = char_tool_tokenizer()
    model = tiny_causal_lm(len(tokenizer), hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=512,
                           pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, seed=3)
    taskset = SayTaskset(vf.v1.TasksetConfig())
    store = create_store(tmp_path / "buffer", "memmap",
                         schema=StoreSchema(optional=("advantage", "termination_reason", *AGENT_ROW_FIELDS)))
    buffer = make_replay_buffer(store, batch_size=4, transforms=[GroupAdvantage(3)])
    config = CollectorConfig(tasks_per_round=2, group_size=3, sampling=SamplingConfig(temperature=1.5), seed=11)
    episodes = Environments(lambda: VerifiersV1Environment(taskset),
                            limits=EpisodeLimits(max_turns=2, max_new_tokens=6, end_on_cut_turn=False))
    collector = Collector(model, tokenizer, TaskSource(verifiers_v1_tasks(taskset), seed=5), episodes, buffer.extend,
                          config)
    collector.collect()
    rows = store.read(torch.arange(len(store)))
    store.close()

    assert len(rows) == 2 * 3 and sorted(rows["trajectory_id"].tolist()) == list(range(6))  # one turn each
    assert rows["done"].tolist() == [True] * 6
    assert set(rows["termination_reason"].tolist()) == {int(TerminationReason.ENV_DONE)}  # agent_completed
    rewards = []
    for k in range(6):
        ids = rows["response_tokens"].row(k).tolist()
        text = tokenizer.decode(ids[:-1] if ids[-1] == tokenizer.eos_token_id else ids, skip_special_tokens=False)
        assert float(rows["reward"][k]) == sum(map(ord, text)) % 3  # the task's reward of the text as sampled
        rewards.append(float(rows["reward"][k]))
    assert len(set(rewards)) > 1
