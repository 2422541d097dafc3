"""Tasksets written for ``verifiers.v1`` (verifiers 0.4) as our :class:`~.environment.Environment`.

Our rollout takes the place of verifiers' ``null`` harness: :class:`VerifiersV1Environment`
rebuilds each task, runs its setup, commits each model turn to the task's ``vf.Trace``, answers
tool calls over MCP as ``null`` does and checks ``max_turns`` and the task's ``@vf.stop``
conditions. A turn's reward is the change of ``trace.reward``. Endings: ``agent_completed`` and
``@vf.stop`` -> ``ENV_DONE``, ``max_turns`` -> ``MAX_TURNS``. What does not fit (containers, hooks on
requests, remote toolsets, ...) is refused by name (docs/agents.md). ``verifiers`` is imported when
an adapter is built. Design: docs/architecture.md#episodes-are-token-lists.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import weakref
from collections.abc import Mapping
from typing import Any

from rlhf_pipeline.agents.environment import Message, ModelTurn, StepResult
from rlhf_pipeline.agents.verifiers_env import import_verifiers, plain_message, unparseable
from rlhf_pipeline.schema.termination import TerminationReason

TESTED_VERSIONS = ("0.4.0",)
"""The verifiers releases this adapter is tested on (tests/agents/test_verifiers_v1.py): it uses
verifiers' trace commit, rollout session and harness helpers, which are not its stable surface."""

MODEL_NAME = "policy"
"""The model name the trace records for our sampler's turns."""

HARNESS_ID = "null"
"""The verifiers harness whose chat loop this adapter plays."""


def import_verifiers_v1():
    """``verifiers.v1``, or an error that says which verifiers this adapter needs."""
    vf = import_verifiers()
    version = getattr(vf, "__version__", "?")
    try:
        import verifiers.v1 as v1
        from verifiers.v1 import graph  # noqa: F401  (the trace's turn commit)
    except ImportError as exc:
        raise ImportError(f"VerifiersV1Environment needs verifiers 0.4 (verifiers.v1); verifiers {version} is "
                          f"installed: pip install 'verifiers=={TESTED_VERSIONS[-1]}'. Environments for verifiers "
                          "0.1 (MultiTurnEnv, ToolEnv) run through VerifiersEnvironment") from exc
    if version not in TESTED_VERSIONS:
        raise ImportError(f"VerifiersV1Environment is tested on verifiers {', '.join(TESTED_VERSIONS)}; verifiers "
                          f"{version} is installed, whose verifiers.v1 may differ: pip install "
                          f"'verifiers=={TESTED_VERSIONS[-1]}'")
    return v1


def verifiers_v1_tasks(taskset, n: int | None = None) -> list[dict[str, Any]]:
    """The first ``n`` tasks of a ``vf.Taskset`` (all of a finite one) as records for ``rollout``
    or ``TaskSource``: each task's data as verifiers ships it to its env server
    (``task.data.model_dump(mode="json")``, the prompt, system prompt and the task's own fields)."""
    vf = import_verifiers_v1()
    check_taskset(vf, taskset)
    if n is None and not taskset.bounded:
        raise ValueError(f"{type(taskset).__name__} is infinite: pass n, the number of tasks to take")
    return [task.data.model_dump(mode="json") for task in itertools.islice(taskset, n)]


def check_taskset(vf, taskset) -> None:
    """Refuses what is not a taskset, saying what to pass instead."""
    if isinstance(taskset, vf.Env):
        raise TypeError(f"{type(taskset).__name__} is a verifiers Env: pass its taskset (env.taskset). Our rollout "
                        "is the one agent of a single-agent Env; a multi-agent Env's run() cannot be stepped "
                        "as one conversation")
    if not isinstance(taskset, vf.Taskset):
        raise TypeError(f"{type(taskset).__name__} is not a verifiers.v1 Taskset (a verifiers 0.1.10 MultiTurnEnv or "
                        "ToolEnv runs through VerifiersEnvironment)")


class VerifiersV1Environment:
    """One episode of a task of a ``vf.Taskset`` (shared between episodes; the trace is ours)."""

    def __init__(self, taskset, *, max_turns: int | None = None):
        vf = import_verifiers_v1()
        check_taskset(vf, taskset)
        self.taskset = taskset
        self.max_turns = max_turns
        self.task_cls = type(taskset).task_type()
        self.data_cls = self.task_cls.data_type()
        excluded = [name for name, spec in self.data_cls.model_fields.items() if spec.exclude]
        if excluded:  # verifiers' env server refuses these too: a task record would lose them
            raise ValueError(f"{self.data_cls.__name__} excludes {excluded} from serialization, so a task record "
                             "cannot carry them: drop exclude=True")
        self.task = None
        """The episode's ``vf.Task``, rebuilt from its record at reset."""
        self.trace = None
        """The episode's ``vf.Trace``: its messages, ``stop_condition``, ``rewards``, ``metrics``."""
        self.score = 0.0
        """``trace.reward`` after the last turn (the sum of the rewards so far)."""
        self.tool_schemas: list[dict[str, Any]] | None = None
        """The tools the chat template lists (OpenAI function schemas), known after reset."""
        self._conversation: list[dict[str, Any]] = []  # the messages as the harness holds them
        self._tools: dict[str, tuple[Any, str]] = {}  # advertised name -> (MCP server, the toolset's tool name)
        self._session = self._runtime = None

    async def reset(self, task: Mapping[str, Any]) -> list[Message]:
        vf = import_verifiers_v1()
        from verifiers.v1.dialects.chat import message_to_wire
        from verifiers.v1.harnesses.null import NullHarness, NullHarnessConfig
        from verifiers.v1.utils.compile import resolve_runtime_config, validate_pairing

        if self.trace is not None:
            raise RuntimeError("a VerifiersV1Environment runs one episode; make_env must build a new one each time")
        self.task = task = self.task_cls(self.data_cls.model_validate(dict(task)), self.taskset.config.task)
        shared = shared_toolsets(self.taskset)
        toolsets = [*shared, *task.toolsets(task.config)]
        stops = self._check_task(vf, task, toolsets)
        harness = NullHarness(NullHarnessConfig(id=HARNESS_ID))
        runtime_config = resolve_runtime_config(vf.SubprocessConfig(), task)  # refuses an image, a network policy
        validate_pairing(harness, type(task), runtime_config, tools=toolsets)  # refuses NEEDS_CONTAINER
        await self._open(vf, task, runtime_config, stops)
        self.tool_schemas = await self._serve_tools(task, toolsets, shared) or None
        system, prompt = harness.resolve_prompt(task.data)  # null emits the system prompt as its own message
        self._conversation = ([{"role": "system", "content": system}] if system else []) + (
            [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [message_to_wire(m) for m in prompt])
        if await self._session.refused():
            raise RuntimeError(f"{type(task).__name__} stopped before the model's first turn "
                               f"(stop condition {self.trace.stop_condition})")
        return [plain_message(m) for m in self._conversation]

    async def step(self, turn: ModelTurn) -> StepResult:
        from verifiers.v1 import graph
        from verifiers.v1.dialects.chat import parse_message, parse_tools
        from verifiers.v1.trace import ModelCall, TimeSpan
        from verifiers.v1.types import Response

        trace = self.trace
        if trace is None or trace.is_completed:
            raise RuntimeError("step before reset, or after the episode ended")
        started = time.time()
        message = assistant_message(turn)
        prompt = [parse_message(m) for m in self._conversation]
        finish = "tool_calls" if turn.tool_calls else ("stop" if turn.finished else "length")
        response = Response(id=f"turn-{turn.index}", created=int(started), model=MODEL_NAME,
                            message=parse_message(message), finish_reason=finish)
        node = graph.prepare_turn(trace, prompt, parse_tools(self.tool_schemas)).commit(response)
        trace.calls.append(ModelCall(node=node, model=MODEL_NAME, finish_reason=finish,
                                     time=TimeSpan(start=started, end=time.time())))
        self._conversation.append(message)
        if not turn.tool_calls:  # null's chat loop returns; the harness exited cleanly
            trace.stop("agent_completed")
            return await self._finish()
        answers = [await self._answer(call) for call in message["tool_calls"]]
        self._conversation.extend(answers)
        if await self._session.refused():  # what verifiers checks before serving the next model call
            return await self._finish()
        return StepResult([plain_message(m) for m in answers], reward=await self._turn_reward(),
                          info={"verifiers_score": self.score})

    # ------------------------------------------------------------------ helpers
    def _check_task(self, vf, task, toolsets) -> list:
        """The task's ``Trace`` stops; refuses what this adapter cannot run as verifiers would."""
        from verifiers.v1.session import hook_boundary
        from verifiers.v1.utils.decorators import discover_decorated

        name = type(task).__name__
        if task.data.prompt is None:
            raise ValueError(f"{name} has no prompt: the user opens its conversation (agent.interaction), and "
                             "our rollout has no user; give its data a prompt")
        if intercepts := [fn.__name__ for fn in discover_decorated(task, "intercept")]:
            raise ValueError(f"{name} has @vf.intercept hooks {intercepts}: they rewrite requests and responses "
                             "at verifiers' interception server, which our rollout does not go through")
        stops, unfit = [], []
        for fn in task.hooks("stop"):
            (stops if hook_boundary(fn, allow_trace=True) is vf.Trace else unfit).append(fn)
        if unfit:
            raise ValueError(f"{name} has @vf.stop conditions on a Request or Response {[f.__name__ for f in unfit]}: "
                             "only stops that read the Trace are checked here; write them on the trace")
        weighted = [fn for fn in task.hooks("reward") if getattr(fn, "_vf_weight", 1.0) != 0]
        if not weighted and not any(judge.weight != 0 for judge in task.config.judges):
            raise ValueError(f"{name} has no @vf.reward with a nonzero weight and no judge: every reward "
                             "would be 0; give the task a reward")
        for toolset in toolsets:
            config, kind = toolset.config, type(toolset).__name__
            if getattr(config, "url", None):
                raise ValueError(f"toolset {kind} is served elsewhere ({config.url}); its tools run in-process "
                                 "here: leave its url unset")
            if not isinstance(config.runtime, vf.SubprocessConfig) or getattr(config, "colocated", False):
                raise ValueError(f"toolset {kind} runs in a {config.runtime.type} runtime; its tools run in-process "
                                 "here: give it the subprocess runtime")
            if state_class(toolset) is not vf.State:
                raise ValueError(f"toolset {kind} keeps its own State, shared with the trace over verifiers' state "
                                 "channel, which needs its interception server: not supported")
        return stops

    async def _open(self, vf, task, runtime_config, stops) -> None:
        """The trace, the session that checks limits and stops, the runtime, ``task.setup``: what
        verifiers' ``Rollout`` builds before the harness starts."""
        from verifiers.v1.errors import TaskError, boundary
        from verifiers.v1.harnesses.null import NullHarnessConfig
        from verifiers.v1.runtimes import make_runtime
        from verifiers.v1.session import RolloutLimits, RolloutSession
        from verifiers.v1.state import state_cls
        from verifiers.v1.trace import AgentInfo, TraceTask
        from verifiers.v1.utils.decorators import invoke

        agent = vf.AgentConfig(harness=NullHarnessConfig(id=HARNESS_ID), runtime=runtime_config, model=MODEL_NAME,
                               max_turns=self.max_turns)
        self.trace = trace = vf.Trace(
            task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            state=state_cls(type(task))(), agent=AgentInfo(config=agent))
        self._session = RolloutSession(ctx=vf.ModelContext(model=MODEL_NAME, client=vf.EvalClientConfig()),
                                       trace=trace, trace_stops=stops, limits=RolloutLimits(max_turns=self.max_turns))
        self._runtime = runtime = make_runtime(runtime_config, name=trace.id)
        weakref.finalize(self, runtime.cleanup)  # an episode our limits end is never finished here
        runtime.env = dict(task.runtime_env())
        await runtime.start()
        await runtime.prepare_setup()
        async with boundary(TaskError, "task setup"):
            await invoke(task.setup, {"trace": trace, "runtime": runtime})

    async def _serve_tools(self, task, toolsets, shared) -> list[dict[str, Any]]:
        """The tools as ``null`` lists them, each mapped to its toolset's MCP server (in-process)."""
        from mcp import Client
        from verifiers.v1.errors import ToolsetError, boundary

        schemas, names = [], set()
        for toolset in toolsets:
            prefix = toolset.server_name
            if prefix in names:  # verifiers refuses the same (mcp/launch.py serve_tools)
                raise ValueError(f"tool server name {prefix!r} is declared twice: give one toolset a distinct "
                                 "TOOL_PREFIX")
            names.add(prefix)
            server = await ready_server(toolset, task, shared=toolset in shared)
            async with boundary(ToolsetError, f"listing the tools of {type(toolset).__name__}"), \
                    Client(server) as client:
                listed = (await client.list_tools()).tools
            for tool in listed:
                full = f"{prefix}_{tool.name}" if prefix else tool.name
                if full in self._tools:
                    raise ValueError(f"duplicate tool name {full!r}; keep MCP tool names qualified")
                self._tools[full] = (server, tool.name)
                schemas.append({"type": "function", "function": {"name": full, "description": tool.description or "",
                                                                 "parameters": tool.input_schema}})
        return schemas

    async def _answer(self, call: Mapping[str, Any]) -> dict[str, Any]:
        """A tool call answered as ``null``'s chat loop answers it (harnesses/utils/core.py)."""
        from mcp import Client
        from verifiers.v1.harnesses.utils.compaction import bound_tool_message
        from verifiers.v1.harnesses.utils.mcp import mcp_content_to_chat_content

        name = call["function"]["name"]
        try:
            arguments = json.loads(call["function"]["arguments"] or "{}")
        except json.JSONDecodeError as exc:
            content = f"error: invalid JSON in tool arguments ({exc}); resend the call with valid JSON"
        else:
            if not isinstance(arguments, dict):
                content = (f"error: tool arguments must be a JSON object, got {type(arguments).__name__}; "
                           "resend as an object")
            elif name in self._tools:
                server, raw_name = self._tools[name]
                async with Client(server) as client:
                    content = mcp_content_to_chat_content((await client.call_tool(raw_name, arguments)).content)
            else:
                content = f"error: unknown tool {name!r}"
        return bound_tool_message({"role": "tool", "tool_call_id": call["id"], "content": content, "name": name})

    async def _turn_reward(self) -> float:
        """The change of ``trace.reward`` since the last turn, the task's rewards scoring the trace as
        it stands (its committed turns; tool answers join it with the next turn, as in verifiers)."""
        from verifiers.v1.errors import TaskError, boundary

        async with boundary(TaskError, "scoring"):
            await self.task.score(self.trace, self._runtime)
        score = float(self.trace.reward)
        reward, self.score = score - self.score, score
        return reward

    async def _finish(self) -> StepResult:
        """verifiers' own ending: ``task.finalize``, scoring, the runtime's teardown."""
        from verifiers.v1.errors import TaskError, boundary
        from verifiers.v1.utils.decorators import invoke

        trace = self.trace
        try:
            async with boundary(TaskError, "task finalize"):
                await invoke(self.task.finalize, {"trace": trace, "runtime": self._runtime})
            reward = await self._turn_reward()
        finally:
            await self._runtime.stop()
        trace.is_completed = trace.ok = True
        condition = trace.stop_condition
        return StepResult(done=True, reason=REASONS.get(condition, TerminationReason.ENV_DONE), reward=reward,
                          info={"verifiers_score": self.score, "stop_condition": condition,
                                "metrics": dict(trace.metrics)})


REASONS = {"max_turns": TerminationReason.MAX_TURNS}
"""verifiers' stop conditions that are not ``ENV_DONE`` (``agent_completed``, a task's ``@vf.stop``)."""


def assistant_message(turn: ModelTurn) -> dict[str, Any]:
    """The model's turn as the chat completion ``null`` receives: ``content`` is the text as
    sampled, ``tool_calls`` in OpenAI's format (arguments a JSON string). A call our parser could
    not read keeps its raw text as arguments, so it is answered with ``null``'s JSON error."""
    message: dict[str, Any] = {"role": "assistant", "content": turn.text}
    if turn.tool_calls:
        message["tool_calls"] = [
            {"id": f"call_{turn.index}_{k}", "type": "function",
             "function": {"name": call.name, "arguments": json.dumps(dict(call.arguments)) if call.error is None
                          else unparseable(call.raw, call.error)}}
            for k, call in enumerate(turn.tool_calls)]
    return message


def state_class(toolset) -> type:
    from verifiers.v1.state import state_cls

    return state_cls(type(toolset))


_SHARED_TOOLSETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SHARED_SERVERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def shared_toolsets(taskset) -> list:
    """The taskset's toolsets (``Taskset.toolsets``), built once per taskset and shared by its
    episodes, as verifiers shares them between a worker's rollouts."""
    if taskset not in _SHARED_TOOLSETS:
        _SHARED_TOOLSETS[taskset] = list(type(taskset).toolsets(taskset.config))
    return _SHARED_TOOLSETS[taskset]


async def ready_server(toolset, task, *, shared: bool):
    """The toolset's MCP server, in-process. A shared one is set up once (its setup shared by the
    episodes that reset at once; a finished setup serves later rollouts' event loops too); a
    task's own is set up per episode, ``setup_task`` included, as verifiers starts it per rollout."""
    if not shared:
        return await build_server(toolset, task)
    pending = _SHARED_SERVERS.get(toolset)
    if pending is None or (pending.done() and (pending.cancelled() or pending.exception() is not None)):
        pending = _SHARED_SERVERS[toolset] = asyncio.ensure_future(build_server(toolset, None))
    return await pending


async def build_server(toolset, task):
    from mcp.server.mcpserver import MCPServer
    from verifiers.v1.errors import ToolsetError, boundary

    async with boundary(ToolsetError, f"{type(toolset).__name__} setup"):
        await toolset.setup()
        if task is not None:
            await toolset.setup_task(task)
    server = MCPServer(toolset.server_name or type(toolset).__name__)
    toolset.register(server)
    return server
