"""verifiers 0.4 (``verifiers.v1``) tasksets for tests/agents/test_verifiers_v1.py.

A module of its own because verifiers serves a toolset by running its module
(``python -m verifiers_v1_tasks``) in a subprocess; the test puts this folder on that process's
``PYTHONPATH``.
"""

from __future__ import annotations

import verifiers.v1 as vf


class Tools(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = None  # advertised bare: "multiply", "guess"

    @vf.tool
    async def multiply(self, a: int, b: int) -> int:
        """Multiplies two integers."""
        return a * b

    @vf.tool
    async def guess(self, n: int) -> str:
        """Guess the number from 1 to 9."""
        return "Correct!" if n == 7 else "Higher." if n < 7 else "Lower."


class ToolsConfig(vf.TasksetConfig):
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()


class MathData(vf.TaskData):
    answer: str


class MathTask(vf.Task[MathData]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.endswith(self.data.answer))

    @vf.reward(weight=0.5)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(bool(trace.tool_messages))

    @vf.metric
    async def calls(self, trace: vf.Trace) -> float:
        return float(sum(len(m.tool_calls or []) for m in trace.assistant_messages))


class MathTaskset(vf.Taskset[MathTask, ToolsConfig]):
    def load(self):
        return [MathTask(MathData(prompt=f"What is 12 * {b}?", system_prompt="Use the tool.", answer=str(12 * b)),
                         self.config.task) for b in (34, 35)]

    @classmethod
    def toolsets(cls, config: ToolsConfig) -> list[vf.Toolset]:
        return [Tools(config.tools)]


class GuessTask(vf.Task[vf.TaskData]):
    """Guess with the tool until it says "Correct!"; the @vf.stop ends the rollout then."""

    @vf.stop
    async def solved(self, trace: vf.Trace) -> bool:
        return any(m.content == "Correct!" for m in trace.tool_messages)

    @vf.reward
    async def found(self, trace: vf.Trace) -> float:
        return float(any(m.content == "Correct!" for m in trace.tool_messages))

    @vf.reward
    async def fewer_guesses(self, trace: vf.Trace) -> float:
        return -0.1 * trace.num_turns


class GuessTaskset(vf.Taskset[GuessTask, ToolsConfig]):
    def load(self):
        return [GuessTask(vf.TaskData(prompt="Guess my number (1-9)."), self.config.task)]

    @classmethod
    def toolsets(cls, config: ToolsConfig) -> list[vf.Toolset]:
        return [Tools(config.tools)]


if __name__ == "__main__":  # how verifiers starts the toolset's server
    Tools.run()
