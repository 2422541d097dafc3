"""What an environment is (``reset`` and ``step``, sync or async), and :class:`EnvironmentRunner`.

The runner steps sync methods in a thread pool and awaits async ones, under a per-call timeout
(a timed-out episode ends with ``TerminationReason.TIMEOUT``). How to write one: docs/agents.md;
design: docs/architecture.md#episodes-are-token-lists.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import numbers
import threading
from collections import Counter
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rlhf_pipeline.agents.workers import WorkerPool
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
        self.reward = reward_value(self.reward)
        if self.reason is not None and self.reason is TerminationReason.NOT_ENDED:
            raise ValueError("StepResult.reason NOT_ENDED is not a reason to end; leave reason None")
        if self.reason is not None and not self.done:
            raise ValueError(f"StepResult has a reason ({self.reason.name}) but done=False")
        if self.done and self.reason is None:
            self.reason = TerminationReason.ENV_DONE


def reward_value(value: Any, what: str = "StepResult.reward") -> float:
    """A reward as the buffer's door takes one: a real number (or a one-element tensor or array),
    never text, never a bool. ``what`` names it in the error. A non-finite one passes here; the
    rollout (and the single-turn collector, ``collect/rewards.py``) drops its group."""
    item = value
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):  # a tensor, array or numpy scalar
        try:
            item = value.item()
        except (ValueError, RuntimeError):  # more than one element: refused below
            pass
    if isinstance(item, bool) or not isinstance(item, numbers.Real):
        hint = "; numbers are not parsed from text" if isinstance(value, str) else ""
        raise TypeError(f"{what}: expected a real number, got {value!r} ({type(value).__name__}){hint}; "
                        f"give a float, e.g. float(...)")
    try:
        return float(item)
    except OverflowError:  # an int beyond float64
        raise ValueError(f"{what}: {item.bit_length()}-bit integer does not fit in a float") from None


@runtime_checkable
class Environment(Protocol):
    """One episode's environment. Either method may be ``async def``."""

    def reset(self, task: Mapping[str, Any]) -> Sequence[Message] | Awaitable[Sequence[Message]]:
        """The opening messages of an episode on ``task`` (a dataset row)."""
        ...

    def step(self, turn: ModelTurn) -> StepResult | Awaitable[StepResult]:
        """The environment's answer to the model's turn."""
        ...


class TurnToolCounts:
    """The tool outcomes of one step, counted until the step ends (returns or times out).

    A timed-out synchronous step runs on in its thread and may still call tools; :meth:`close`
    freezes the counts when the step ends, so those late calls count in no turn and no round."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._closed = False

    def add(self, metric: str) -> None:
        with self._lock:
            if not self._closed:
                self._counts[metric] += 1

    def close(self) -> Counter[str]:
        """Stops counting; the counts as they stand."""
        with self._lock:
            self._closed = True
            return Counter(self._counts)


TURN_TOOL_OUTCOMES: contextvars.ContextVar[TurnToolCounts | None] = contextvars.ContextVar(
    "turn_tool_outcomes", default=None)
"""The tool outcomes of the step running (``calls``, ``ok``, ``malformed``, ...:
``ToolBox.METRICS``), or None outside a step. :meth:`EnvironmentRunner.step_counting_tools` sets
it and every ``ToolBox`` adds to it, so each stored turn knows its own failed calls even when
many episodes share one ``ToolBox`` and step at once, and the environment reports nothing
itself."""


def describe_exception(exc: BaseException) -> str:
    """``Type: message`` for an error answer, whatever the exception's ``str()`` does."""
    try:
        message = str(exc)
    except Exception:
        message = "(its message cannot be printed)"
    return printable(f"{type(exc).__name__}: {message}" if message else type(exc).__name__)


def printable(text: str) -> str:
    """``text`` with any lone surrogate written as an escape, so it can go to a tokenizer and a store."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


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
        # a timed-out step's thread is left to finish alone, outside the slots; an unbounded number
        # may run, since a round's steps are bounded by its episodes
        self._pool = WorkerPool(max_workers, max_abandoned=1 << 30, name="environment")
        self.timeouts = 0

    async def reset(self, env: Environment, task: Mapping[str, Any]) -> list[Message]:
        try:
            messages = await self._call(env.reset, task)
        except TimeoutError:
            self.timeouts += 1
            raise StepTimeout(f"{type(env).__name__}.reset took longer than {self.step_timeout_s}s") from None
        return [dict(m) for m in messages]

    async def reset_counting_tools(self, env: Environment, task: Mapping[str, Any]) -> tuple[list[Message], Counter[str]]:
        """:meth:`reset`, and the outcomes of the tool calls it ran (as :meth:`step_counting_tools`)."""
        outcomes = TurnToolCounts()
        token = TURN_TOOL_OUTCOMES.set(outcomes)
        try:
            messages = await self.reset(env, task)
        finally:
            TURN_TOOL_OUTCOMES.reset(token)
            counts = outcomes.close()
        return messages, counts

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
        """:meth:`step`, and the outcomes of the tool calls this step ran (``TURN_TOOL_OUTCOMES``),
        as they stood when it ended: a timed-out step's later calls are not counted.

        Each call of this coroutine under ``asyncio.gather`` runs in its own task, hence its own
        copy of the context: concurrent steps never count into each other's turn."""
        outcomes = TurnToolCounts()
        token = TURN_TOOL_OUTCOMES.set(outcomes)
        try:
            result = await self.step(env, turn)
        finally:
            TURN_TOOL_OUTCOMES.reset(token)
            counts = outcomes.close()
        return result, counts

    async def _call(self, method, argument):
        if inspect.iscoroutinefunction(method):
            return await asyncio.wait_for(method(argument), self.step_timeout_s)
        # the pool's threads do not carry the context; the step's tool counts need it
        context = contextvars.copy_context()
        running = self._pool.submit(context.run, method, argument)
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(running), self.step_timeout_s)
        except TimeoutError:
            self._pool.abandon(running)  # its thread runs on alone; the slot takes the next step
            raise
        if inspect.isawaitable(result):  # a sync method that hands back a coroutine
            result = await asyncio.wait_for(result, self.step_timeout_s)
        return result

    def close(self) -> None:
        """Stops taking work; threads of timed-out steps finish on their own (and are not waited
        for at exit)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> EnvironmentRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
