"""A collector's console: lines that stand alone beside the learner's bar on a terminal, and the
agent round report that says what failed tool calls said."""

from __future__ import annotations

import io
import os
import pty

from agent_setup import GROUP_SIZE, TASKS, tiny_policy
from helpers import screen_lines

from rlhf_pipeline.agents.environment import StepResult, ToolCall
from rlhf_pipeline.agents.episode import EpisodeLimits
from rlhf_pipeline.agents.tools import ToolBox, parse_hermes
from rlhf_pipeline.collect import Collector, CollectorConfig, Environments, SamplingConfig, TaskSource
from rlhf_pipeline.collect.console import agent_round_printer, say


def test_a_line_said_on_a_terminal_stands_alone_after_a_half_drawn_bar():
    master, follower = pty.openpty()
    with os.fdopen(follower, "w", encoding="utf-8") as terminal:
        # what the learner's tqdm bar leaves on the shared terminal between two redraws
        terminal.write("\rlearner:  82%|########2 | 49/60 [00:25<00:04, reward=0.5]")
        terminal.flush()
        say("[collector] round 50: 64 rows", terminal)
        terminal.write("\rlearner:  83%|########3 | 50/60 [00:26<00:04, reward=0.5]")
    shown = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the terminal's only writer closed it, everything was read
            break
        if not chunk:
            break
        shown += chunk
    os.close(master)
    assert screen_lines(shown) == ["[collector] round 50: 64 rows",
                                   "learner:  83%|########3 | 50/60 [00:26<00:04, reward=0.5]"]


def test_a_line_said_to_a_log_is_written_as_it_is():
    log = io.StringIO()
    say("[collector] round 50: 64 rows", log)
    assert log.getvalue() == "[collector] round 50: 64 rows\n"


def multiply(a: int, b: int) -> int:
    """Multiplies two integers (a broken tool: it raises on every call).

    Args:
        a: The first factor.
        b: The second factor.
    """
    raise ZeroDivisionError("the tool is broken")


class BrokenToolsEnv:
    """Every step calls the broken tool and a tool that does not exist: two kinds of failure."""

    def __init__(self, toolbox: ToolBox):
        self.toolbox = toolbox

    def reset(self, task):
        return [{"role": "user", "content": task["question"]}]

    def step(self, turn):
        self.toolbox.run([ToolCall("multiply", {"a": turn.index, "b": 7}, ""), ToolCall("divide", {}, "")])
        return StepResult(reward=0.0, done=True)


def test_a_round_whose_tool_calls_all_fail_is_warned_of_once_with_the_first_error_of_each_kind():
    model, tokenizer = tiny_policy()
    toolbox = ToolBox([multiply], timeout_s=5.0)
    console = io.StringIO()
    config = CollectorConfig(tasks_per_round=2, group_size=GROUP_SIZE, sampling=SamplingConfig(temperature=1.5), seed=11)
    episodes = Environments(lambda: BrokenToolsEnv(toolbox), parser=parse_hermes,
                            limits=EpisodeLimits(max_turns=1, max_new_tokens=4))
    collector = Collector(model, tokenizer, TaskSource(TASKS, seed=5), episodes, lambda batch, writer_state: None,
                          config, hooks=[agent_round_printer(2, toolbox=toolbox, stream=console)])
    for _ in range(4):
        collector.collect()
    lines = console.getvalue().splitlines()
    calls = 2 * 2 * GROUP_SIZE  # two per episode
    raised = "[collector]   first raised error: multiply raised ZeroDivisionError: the tool is broken"
    unknown = "[collector]   first unknown_tool error: there is no tool 'divide'; the tools are ['multiply']"
    # at once, and once while every call keeps failing: the warning, then what each kind of failure said
    assert lines[0] == (f"[collector] warning: every tool call of round 1 failed ({calls} of {calls}); "
                        f"the first failure of each kind:")
    assert sorted(lines[1:3]) == [raised, unknown]
    assert sum("warning" in line for line in lines) == 1
    # a line every second round, each with the failed calls of the rounds since the line before and the
    # first failure of each kind among them
    assert lines[3].startswith("[collector] round 2 (policy v0): reward 0.000, tool-call rate 0.00, ")
    assert lines[3].endswith(f"; tool errors {2 * calls}/{2 * calls} in rounds 1-2")
    assert sorted(lines[4:6]) == [raised, unknown]
    assert lines[6].startswith("[collector] round 4 ") and lines[6].endswith("in rounds 3-4")
    assert sorted(lines[7:]) == [raised, unknown]
