"""What an environment is, and how one is stepped: sync ones in a thread pool, async ones awaited.

A pipeline file writes an environment as a small class, one instance per episode::

    class Countdown:
        def reset(self, task):                      # a dataset row -> the opening messages
            self.target = task["answer"]
            return [{"role": "user", "content": task["question"]}]

        def step(self, turn):                       # the model's turn -> the environment's answer
            if turn.text.strip() == self.target:
                return StepResult(reward=1.0, done=True)
            return StepResult([{"role": "user", "content": "Try again."}])

Either method may be ``async def``. ``turn`` is a :class:`ModelTurn`: the model's message text (the
end-of-turn token stripped), the tool calls parsed from it, whether the model ended its message
or was cut at its ``max_new_tokens``. Tools live in :mod:`.tools`; an environment that offers
them runs ``turn.tool_calls`` through its ``ToolBox`` and answers with the tool messages.

:class:`EnvironmentRunner` runs ``reset`` and ``step`` under a per-call timeout: a synchronous
method in a thread pool (so many episodes step at once while one waits on I/O), a coroutine on
the running event loop. A step that runs out of time ends the episode with
``TerminationReason.TIMEOUT`` (a truncation). A Python thread cannot be stopped, so a timed-out
synchronous step keeps its thread until it returns; its answer is dropped. An exception raised
by the environment's own code is a bug in the pipeline file and propagates: only the model's
mistakes (bad tool calls) are turned into data.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
from collections import Counter
from collections.abc import Awaitable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rlhf_pipeline.schema.termination import TerminationReason

Message = dict[str, Any]
"""A chat message as ``transformers`` chat templates take it: ``{"role": ..., "content": ...}``
(plus ``"name"`` / ``"tool_call_id"`` on tool answers where a template reads them)."""


@dataclass(frozen=True)
class ToolCall:
    """One tool call parsed from the model's text. ``error`` is set when the call could not be
    parsed (bad JSON, no name); such a call is answered with that error, never run."""

    name: str
    arguments: Mapping[str, Any]
    raw: str
    error: str | None = None


@dataclass(frozen=True)
class ModelTurn:
    """What the model said in one turn, as an environment sees it."""

    index: int
    """0 for the model's first turn."""
    text: str
    """The message as decoded from the sampled ids, the end-of-turn token stripped."""
    tool_calls: tuple[ToolCall, ...] = ()
    finished: bool = True
    """False when the turn was cut at its ``max_new_tokens`` before the model ended it."""


@dataclass
class StepResult:
    """The environment's answer to one model turn."""

    messages: list[Message] = field(default_factory=list)
    """Messages appended to the conversation (tool answers, a user's reply). Ignored when the
    episode ends: no model turn follows them."""
    reward: float = 0.0
    """This turn's reward, stored on the turn's row."""
    done: bool = False
    reason: TerminationReason | None = None
    """Why the episode ended when ``done``; ``ENV_DONE`` when not given."""
    info: dict[str, Any] = field(default_factory=dict)
    """Anything to count or log (not stored)."""

    def __post_init__(self) -> None:
        if self.reason is not None and self.reason is TerminationReason.NOT_ENDED:
            raise ValueError("StepResult.reason NOT_ENDED is not a reason to end; leave reason None")
        if self.reason is not None and not self.done:
            raise ValueError(f"StepResult has a reason ({self.reason.name}) but done=False")
        if self.done and self.reason is None:
            self.reason = TerminationReason.ENV_DONE


@runtime_checkable
class Environment(Protocol):
    """One episode's environment. Either method may be ``async def``."""

    def reset(self, task: Mapping[str, Any]) -> Sequence[Message] | Awaitable[Sequence[Message]]:
        """The opening messages of an episode on ``task`` (a dataset row)."""
        ...

    def step(self, turn: ModelTurn) -> StepResult | Awaitable[StepResult]:
        """The environment's answer to the model's turn."""
        ...


TURN_TOOL_OUTCOMES: contextvars.ContextVar[Counter[str] | None] = contextvars.ContextVar(
    "turn_tool_outcomes", default=None)
"""The tool outcomes of the turn being stepped (``calls``, ``ok``, ``malformed``, ...:
``ToolBox.METRICS``), or None outside a step. :meth:`EnvironmentRunner.step_counting_tools` sets
it and every ``ToolBox`` adds to it, so each stored turn knows its own failed calls even when
many episodes share one ``ToolBox`` and step at once, and the environment reports nothing
itself."""


class StepTimeout(Exception):
    """``reset`` ran past its timeout (a step's timeout ends its episode instead)."""


class EnvironmentRunner:
    """Runs environments' ``reset``/``step`` concurrently: sync methods in a thread pool of
    ``max_workers``, coroutines on the event loop, each call under ``step_timeout_s``."""

    def __init__(self, *, max_workers: int = 16, step_timeout_s: float | None = 60.0):
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        if step_timeout_s is not None and step_timeout_s <= 0:
            raise ValueError(f"step_timeout_s must be > 0 or None, got {step_timeout_s}")
        self.step_timeout_s = step_timeout_s
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="environment")
        self.timeouts = 0

    async def reset(self, env: Environment, task: Mapping[str, Any]) -> list[Message]:
        try:
            messages = await self._call(env.reset, task)
        except TimeoutError:
            self.timeouts += 1
            raise StepTimeout(f"{type(env).__name__}.reset took longer than {self.step_timeout_s}s") from None
        return [dict(m) for m in messages]

    async def step(self, env: Environment, turn: ModelTurn) -> StepResult:
        try:
            result = await self._call(env.step, turn)
        except TimeoutError:
            self.timeouts += 1
            return StepResult(done=True, reason=TerminationReason.TIMEOUT,
                              info={"timeout": f"step took longer than {self.step_timeout_s}s"})
        if not isinstance(result, StepResult):
            raise TypeError(f"{type(env).__name__}.step returned {type(result).__name__}, not a StepResult")
        return result

    async def step_counting_tools(self, env: Environment, turn: ModelTurn) -> tuple[StepResult, Counter[str]]:
        """:meth:`step`, and the outcomes of the tool calls this step ran (``TURN_TOOL_OUTCOMES``).

        Each call of this coroutine under ``asyncio.gather`` runs in its own task, hence its own
        copy of the context: concurrent steps never count into each other's turn."""
        outcomes: Counter[str] = Counter()
        token = TURN_TOOL_OUTCOMES.set(outcomes)
        try:
            return await self.step(env, turn), outcomes
        finally:
            TURN_TOOL_OUTCOMES.reset(token)

    async def _call(self, method, argument):
        if inspect.iscoroutinefunction(method):
            return await asyncio.wait_for(method(argument), self.step_timeout_s)
        loop = asyncio.get_running_loop()
        # run_in_executor does not carry the context to the thread; the step's tool counts need it
        context = contextvars.copy_context()
        result = await asyncio.wait_for(loop.run_in_executor(self._pool, context.run, method, argument),
                                        self.step_timeout_s)
        if inspect.isawaitable(result):  # a sync method that hands back a coroutine
            result = await asyncio.wait_for(result, self.step_timeout_s)
        return result

    def close(self) -> None:
        """Stops taking work; threads of timed-out steps finish on their own."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> EnvironmentRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
