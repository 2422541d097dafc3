"""Tools: typed Python functions, the calls parsed from the model's text, and running them safely.

:data:`PARSERS` holds a parser per chat-template family (``hermes``, ``mistral``, ``llama3_json``,
``deepseek``; :func:`parser_for_template` picks one). :class:`ToolBox` runs a turn's calls and
answers every failure as that tool's output, counted in its metrics. Design:
docs/architecture.md#episodes-are-token-lists.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from transformers.utils import get_json_schema

from rlhf_pipeline.agents.environment import TURN_TOOL_OUTCOMES, Message, ToolCall, describe_exception, printable
from rlhf_pipeline.agents.workers import PoolExhausted, WorkerPool

# ======================================================================== parsers
_HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


def _call_from_object(obj: Any, raw: str, arguments_key: str = "arguments") -> ToolCall:
    if not isinstance(obj, dict):
        return ToolCall("", {}, raw, f"a tool call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall("", {}, raw, 'a tool call needs a "name" string')
    arguments = obj.get(arguments_key, {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            return ToolCall(name, {}, raw, f"the arguments are not valid JSON ({exc.msg})")
    if not isinstance(arguments, dict):
        return ToolCall(name, {}, raw, f'"{arguments_key}" must be a JSON object')
    return ToolCall(name, arguments, raw)


def parse_hermes(text: str) -> list[ToolCall]:
    """Calls written as ``<tool_call>{json}</tool_call>``; an unclosed last one (a turn cut at its
    length) is a malformed call, not text."""
    calls = []
    for match in _HERMES_CALL.finditer(text):
        raw = match.group(0)
        if not raw.rstrip().endswith("</tool_call>"):
            calls.append(ToolCall("", {}, raw, "the tool call is not closed with </tool_call>"))
            continue
        try:
            obj = json.loads(match.group(1))
        except json.JSONDecodeError as exc:
            calls.append(ToolCall("", {}, raw, f"the tool call is not valid JSON ({exc.msg})"))
            continue
        calls.append(_call_from_object(obj, raw))
    return calls


def parse_mistral(text: str) -> list[ToolCall]:
    """Calls written as ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``."""
    marker = text.find("[TOOL_CALLS]")
    if marker < 0:
        return []
    raw = text[marker:]
    try:
        # the list is the first JSON value after the marker; text after it is ignored
        obj, _ = json.JSONDecoder().raw_decode(raw[len("[TOOL_CALLS]"):].lstrip())
    except json.JSONDecodeError as exc:
        return [ToolCall("", {}, raw, f"the tool calls are not valid JSON ({exc.msg})")]
    if not isinstance(obj, list):
        obj = [obj]
    return [_call_from_object(item, raw) for item in obj]


def parse_llama3_json(text: str) -> list[ToolCall]:
    """A message that is JSON call objects (``;``-separated) with their arguments under
    ``"parameters"``; a message that does not start with ``{`` (after an optional
    ``<|python_tag|>``) is an answer, not a call."""
    body = text.strip()
    tagged = body.startswith("<|python_tag|>")
    body = body.removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return [ToolCall("", {}, text, "<|python_tag|> is not followed by a JSON tool call")] if tagged else []
    calls, decoder, at = [], json.JSONDecoder(), 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError as exc:
            return [*calls, ToolCall("", {}, body[at:], f"the tool call is not valid JSON ({exc.msg})")]
        key = "parameters" if isinstance(obj, dict) and "parameters" in obj else "arguments"
        calls.append(_call_from_object(obj, body[at:end], key))
        at = end
        while at < len(body) and body[at] in "; \n\t":
            at += 1
    return calls


_DEEPSEEK_CALL = re.compile(
    r"<｜tool▁call▁begin｜>(?P<kind>[^<]*?)<｜tool▁sep｜>(?P<name>[^\n]*)\n```(?:json)?\n(?P<args>.*?)\n```"
    r"(?P<end><｜tool▁call▁end｜>)?", re.S)


def parse_deepseek(text: str) -> list[ToolCall]:
    """Calls written as DeepSeek V3/R1 templates do: a fenced JSON block per call."""
    if "<｜tool▁call▁begin｜>" not in text:
        return []
    calls = []
    for match in _DEEPSEEK_CALL.finditer(text):
        raw, name = match.group(0), match.group("name").strip()
        if match.group("end") is None:
            calls.append(ToolCall(name, {}, raw, "the tool call is not closed with <｜tool▁call▁end｜>"))
            continue
        try:
            arguments = json.loads(match.group("args"))
        except json.JSONDecodeError as exc:
            calls.append(ToolCall(name, {}, raw, f"the arguments are not valid JSON ({exc.msg})"))
            continue
        calls.append(_call_from_object({"name": name, "arguments": arguments}, raw))
    if not calls:  # a begin marker with nothing we can read: say so rather than answer nothing
        start = text.index("<｜tool▁call▁begin｜>")
        calls.append(ToolCall("", {}, text[start:], "the tool call does not follow "
                              "function<｜tool▁sep｜>NAME and a ```json block"))
    return calls


ToolCallParser = Callable[[str], list[ToolCall]]
PARSERS: dict[str, ToolCallParser] = {"hermes": parse_hermes, "mistral": parse_mistral,
                                      "llama3_json": parse_llama3_json, "deepseek": parse_deepseek}
"""Tool-call parsers by chat-template family. To add one, write ``text -> list[ToolCall]``
(malformed calls as ``ToolCall(..., error=...)``, never an exception) and a marker below."""
_TEMPLATE_MARKERS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"),
                     ("<｜tool▁calls▁begin｜>", "deepseek"), ("<|python_tag|>", "llama3_json"))


def parser_for_template(chat_template: str) -> ToolCallParser:
    """The parser of the family whose tool-call marker ``chat_template`` writes."""
    for marker, family in _TEMPLATE_MARKERS:
        if marker in chat_template:
            return PARSERS[family]
    raise ValueError(
        f"the chat template writes none of the tool-call markers we parse "
        f"({', '.join(m for m, _ in _TEMPLATE_MARKERS)}); pass a parser from PARSERS by name"
    )


# ======================================================================== running tools
class ToolBox:
    """The tools an environment offers, and the one place their calls run.

    ``timeout_s`` bounds each call (a timed-out call's thread runs on alone, its slot taken by a
    new thread; its answer is dropped), ``max_output_chars`` each answer, ``max_calls_per_turn``
    the calls answered in one turn (the rest are answered with an error without running).
    ``max_workers`` calls run at once; ``max_hung_calls`` timed-out calls may still be running
    before new calls are answered at once with a ``timeout`` error instead of being started.
    """

    METRICS = ("calls", "ok", "malformed", "unknown_tool", "bad_arguments", "raised", "timeout",
               "over_call_limit", "bad_output", "truncated_output")

    def __init__(self, tools: Iterable[Callable[..., Any]], *, timeout_s: float | None = 10.0,
                 max_output_chars: int = 2000, max_calls_per_turn: int = 8, max_workers: int = 4,
                 max_hung_calls: int = 64):
        self.tools: dict[str, Callable[..., Any]] = {}
        self.schemas: list[dict[str, Any]] = []
        for tool in tools:
            try:
                schema = get_json_schema(tool)
            except Exception as exc:  # transformers' own message says which docstring part is missing
                raise ValueError(f"tool {getattr(tool, '__name__', tool)!r}: {exc}") from exc
            name = schema["function"]["name"]
            if name in self.tools:
                raise ValueError(f"two tools are named {name!r}")
            self.tools[name] = tool
            self.schemas.append(schema)
        if max_output_chars < 1 or max_calls_per_turn < 1:
            raise ValueError("max_output_chars and max_calls_per_turn must be >= 1")
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self.max_calls_per_turn = max_calls_per_turn
        self.metrics: Counter[str] = Counter({name: 0 for name in self.METRICS})
        self._first_errors: dict[str, str] = {}  # failure kind -> its first message since take_first_errors()
        self._lock = threading.Lock()
        self._pool = WorkerPool(max_workers, max_abandoned=max_hung_calls, name="tool")

    def run(self, calls: Sequence[ToolCall]) -> list[Message]:
        """One ``tool`` message per call, in order; never raises for the model's mistakes."""
        return self.run_counted(calls)[0]

    def run_counted(self, calls: Sequence[ToolCall]) -> tuple[list[Message], int]:
        """:meth:`run`, and how many of these calls were answered with an error.

        A turn's calls run at the same time (a model asking for three lookups waits for the
        slowest, not their sum), each bounded by ``timeout_s`` from its submission; the answers
        come back in the order of the calls."""
        started: list[tuple[str, Future | tuple[str, bool], float]] = []
        for number, call in enumerate(calls):
            self._count("calls")
            if number >= self.max_calls_per_turn:
                outcome = self._failed("over_call_limit", f"only {self.max_calls_per_turn} tool calls are "
                                       f"answered per turn; this one was not run")
            else:
                outcome = self._start(call)
            started.append((call.name, outcome, time.monotonic()))
        answers, errors = [], 0
        for name, outcome, submitted in started:
            content, ok = self._finish(name, outcome, submitted) if isinstance(outcome, Future) else outcome
            errors += not ok
            answers.append({"role": "tool", "name": name or "unknown", "content": content})
        return answers, errors

    def errors(self) -> int:
        """Calls answered with an error so far."""
        return self.metrics["calls"] - self.metrics["ok"]

    def take_first_errors(self) -> dict[str, str]:
        """The first error message of each kind of failure (``raised``, ``malformed``...) since the
        last call, in the order they came: what a round's console report shows beside the counts."""
        with self._lock:
            taken, self._first_errors = self._first_errors, {}
        return taken

    def _start(self, call: ToolCall) -> Future | tuple[str, bool]:
        """The running call, or at once the error answer of a call that cannot run."""
        if call.error is not None:
            return self._failed("malformed", call.error)
        tool = self.tools.get(call.name)
        if tool is None:
            return self._failed("unknown_tool", f"there is no tool {call.name!r}; the tools are "
                                f"{sorted(self.tools)}")
        try:
            inspect.signature(tool).bind(**call.arguments)
        except TypeError as exc:
            return self._failed("bad_arguments", f"{call.name}: {exc}")
        try:
            return self._pool.submit(_call_tool, tool, call.arguments)
        except PoolExhausted as exc:
            return self._failed("timeout", f"{call.name} was not run: {exc}")

    def _finish(self, name: str, future: Future, submitted: float) -> tuple[str, bool]:
        left = None if self.timeout_s is None else max(0.0, self.timeout_s - (time.monotonic() - submitted))
        try:
            text = future.result(timeout=left)
        except FutureTimeout:
            self._pool.abandon(future)  # frees its slot for the next call; its thread finishes alone
            return self._failed("timeout", f"{name} took longer than {self.timeout_s}s")
        except UnusableOutput as exc:
            return self._failed("bad_output", f"{name} returned {exc}")
        except Exception as exc:  # the tool's own failure is the model's answer, not our crash
            return self._failed("raised", f"{name} raised {describe_exception(exc)}")
        self._count("ok")
        return self._truncate(text), True

    def _truncate(self, text: str) -> str:
        if len(text) <= self.max_output_chars:
            return text
        self._count("truncated_output")
        cut = len(text) - self.max_output_chars
        return text[: self.max_output_chars] + f"... [{cut} more characters cut]"

    def _failed(self, metric: str, message: str) -> tuple[str, bool]:
        with self._lock:
            self._first_errors.setdefault(metric, message)
        return self._error(metric, message), False

    def _error(self, metric: str, message: str) -> str:
        self._count(metric)
        return self._truncate(f"Error: {printable(message)}")

    def _count(self, metric: str) -> None:
        turn = TURN_TOOL_OUTCOMES.get()  # the turn being stepped, when an EnvironmentRunner steps it
        with self._lock:
            self.metrics[metric] += 1
        if turn is not None:
            turn.add(metric)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class UnusableOutput(Exception):
    """A tool's result that cannot be the model's answer: no text comes of it, or its text is not
    valid Unicode (a lone surrogate, which no tokenizer or store takes)."""


def _call_tool(tool: Callable[..., Any], arguments: dict[str, Any]) -> str:
    """The call and its answer as text, both on the worker thread: a result whose conversion
    hangs or is slow is bounded by the call's timeout too."""
    result = tool(**arguments)
    if inspect.isawaitable(result):  # an async tool: its own loop, in this worker thread
        result = asyncio.run(_await(result))
    return as_text(result)


async def _await(awaitable):
    return await awaitable


def as_text(result: Any) -> str:
    """A tool's result as the text the model reads: a str as it is, else JSON, else ``str()``.
    Raises :class:`UnusableOutput` when neither works (an object whose ``str()`` raises, an int
    past Python's digit limit) or the text is not valid Unicode."""
    if isinstance(result, str):
        text = result
    else:
        try:
            try:
                text = json.dumps(result, ensure_ascii=False)
            except (TypeError, ValueError):
                text = str(result)
            if not isinstance(text, str):
                raise TypeError(f"str() gave {type(text).__name__}")
        except Exception as exc:
            raise UnusableOutput(f"a {type(result).__name__} that cannot be made into text "
                                 f"({describe_exception(exc)})") from None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UnusableOutput(f"text that is not valid Unicode: character {exc.start} is a lone surrogate "
                             f"({text[exc.start]!r})") from None
    return text
