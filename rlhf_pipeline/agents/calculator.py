"""A toy tool-using environment: products of two numbers, with a ``multiply`` tool.

The task a small model cannot do in its head but can with the tool: ``{"question": "What is 37 *
58?", "answer": "2146"}``. A turn with tool calls is answered by the tools (reward 0); a turn
without is the final answer: reward 1 when it contains the product, 0 otherwise, and the episode
ends. ``max_tool_errors`` failed calls end the episode with ``TOOL_ERROR`` (reward 0). With
``nudges`` set, the first answers without a tool call are met with a reminder to use the tool
instead of being taken as final (a bounded number: ``max_turns`` still ends the episode).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from rlhf_pipeline.agents.environment import Message, ModelTurn, StepResult
from rlhf_pipeline.agents.tools import ToolBox
from rlhf_pipeline.schema import TerminationReason


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def product_tasks(n: int, *, low: int = 10, high: int = 99, seed: int = 0) -> list[dict[str, str]]:
    """``n`` tasks ``{"question", "answer"}`` with factors in ``[low, high]``."""
    rng = random.Random(seed)
    tasks = []
    for _ in range(n):
        a, b = rng.randint(low, high), rng.randint(low, high)
        tasks.append({"question": f"What is {a} * {b}?", "answer": str(a * b)})
    return tasks


class CalculatorEnv:
    """One episode on a product task; ``toolbox`` may be shared between episodes."""

    def __init__(self, toolbox: ToolBox | None = None, *, max_tool_errors: int = 3, nudges: int = 0):
        self.toolbox = toolbox or ToolBox([multiply])
        self.max_tool_errors = max_tool_errors
        self.nudges = nudges

    def reset(self, task: Mapping[str, Any]) -> list[Message]:
        self.answer = str(task["answer"])
        self.tool_errors = 0
        self.nudged = 0
        return [{"role": "user", "content": str(task["question"])}]

    def step(self, turn: ModelTurn) -> StepResult:
        if turn.tool_calls:
            answers, errors = self.toolbox.run_counted(turn.tool_calls)
            self.tool_errors += errors
            if self.tool_errors >= self.max_tool_errors:
                return StepResult(done=True, reason=TerminationReason.TOOL_ERROR)
            return StepResult(answers)
        if self.nudged < self.nudges:
            self.nudged += 1
            return StepResult([{"role": "user", "content": "Use the multiply tool, then answer."}])
        return StepResult(reward=float(self.answer in turn.text), done=True)
