"""A toy tool-using environment: products of two numbers, with a ``multiply`` tool.

The task a small model cannot do in its head but can with the tool: ``{"question": "What is 37 *
58?", "answer": "2146"}``. A turn with tool calls is answered by the tools (reward 0); a turn
without is the final answer: reward 1 when its last number is the product, 0 otherwise, and the
episode ends (with ``partial_credit``, a wrong number earns ``0.5 * right-aligned matching digits /
longer length``, so near misses rank above wild guesses). The last number, not "the text contains
the product": a policy paid for containing it learns to write long strings of digits (seen: a run
was paid 1 for "77287" on 56 * 13 = 728). ``max_tool_errors`` failed calls end the
episode with ``TOOL_ERROR`` (reward 0). With ``nudges`` set, the first answers without a tool call are met with a reminder to use the tool
instead of being taken as final (a bounded number: ``max_turns`` still ends the episode).

:func:`warm_start` is supervised steps on demonstrations built as real episodes (the same token
lists and loss mask a rollout makes), some calling the tool and some guessing in the head, so a
tiny random model starts RL calling the tool, and with enough steps (~600 for a 64-wide, 2-layer
model) copying the factors into its call and the tool's answer into its reply.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Mapping
from typing import Any

import torch

from rlhf_pipeline.agents.environment import Message, ModelTurn, StepResult
from rlhf_pipeline.agents.episode import Episode
from rlhf_pipeline.agents.tools import ToolBox, parse_hermes
from rlhf_pipeline.models.supervised import supervised_step
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

    def __init__(self, toolbox: ToolBox | None = None, *, max_tool_errors: int = 3, nudges: int = 0,
                 partial_credit: bool = False):
        self.toolbox = toolbox or ToolBox([multiply])
        self.max_tool_errors = max_tool_errors
        self.nudges = nudges
        self.partial_credit = partial_credit

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
        if self.partial_credit:
            return StepResult(reward=digit_credit(turn.text, self.answer), done=True)
        return StepResult(reward=float(final_number(turn.text) == self.answer), done=True)


def final_number(text: str) -> str | None:
    """The last number written in ``text`` (its digits), the answer it gives; None without one."""
    numbers = re.findall(r"\d+", text)
    return numbers[-1] if numbers else None


def digit_credit(text: str, answer: str) -> float:
    """1.0 when the last number in ``text`` is ``answer``; else ``0.5 * right-aligned matching
    digits / longer length`` of that number (0 without one)."""
    said = final_number(text)
    if said is None:
        return 0.0
    if said == answer:
        return 1.0
    matching = sum(x == y for x, y in zip(reversed(said), reversed(answer), strict=False))
    return 0.5 * matching / max(len(said), len(answer))


# ======================================================================== warm start
def demonstration(tokenizer, task: Mapping[str, Any], *, use_tool: bool, guess: int, toolbox: ToolBox) -> Episode:
    """One ended episode of ``task`` as a rollout would record it: a ``multiply`` call, the tool's
    answer and the product (``use_tool``), or ``guess`` said at once. Written in Hermes style
    (``<tool_call>{json}</tool_call>``), the format :func:`~.tools.parse_hermes` reads."""
    env = CalculatorEnv(toolbox)
    episode = Episode(tokenizer, env.reset(task), tools=toolbox.schemas, parser=parse_hermes, check_drift=False)
    a, b = (int(x) for x in str(task["question"]).removeprefix("What is ").removesuffix("?").split(" * "))
    call = f'<tool_call>{{"name":"multiply","arguments":{{"a":{a},"b":{b}}}}}</tool_call>'
    for text in ([call, str(task["answer"])] if use_tool else [str(guess)]):
        ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        episode.add_environment(env.step(episode.add_turn(ids, [0.0] * len(ids))))
    return episode


def warm_start(model, tokenizer, steps: int, *, tool_fraction: float = 0.5, batch_size: int = 32, lr: float = 3e-3,
               seed: int = 0, low: int = 10, high: int = 99) -> dict[str, float]:
    """Supervised steps on :func:`demonstration` episodes (next-token loss where the episode's loss
    mask is 1: the model's own turns), ``tool_fraction`` of them calling the tool. Tasks come from
    seeds disjoint from :func:`product_tasks`' defaults. Returns ``{"loss", "seconds", "steps"}``;
    the model is left in eval mode."""
    rng = random.Random(seed + 20_000)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    warmup = max(1, steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    device = next(model.parameters()).device
    toolbox = ToolBox([multiply])
    model.train()
    started, loss_value = time.perf_counter(), float("nan")
    for step in range(steps):
        tasks = product_tasks(batch_size, low=low, high=high, seed=seed + 10_000 + step)
        episodes = [demonstration(tokenizer, task, use_tool=rng.random() < tool_fraction,
                                  guess=rng.randint(low * low, high * high), toolbox=toolbox) for task in tasks]
        width = max(len(e.token_ids) for e in episodes)
        ids = torch.full((batch_size, width), tokenizer.pad_token_id, dtype=torch.long)  # (B, L) right-padded
        target = torch.zeros((batch_size, width), dtype=torch.bool)  # (B, L): the model's own tokens
        for i, episode in enumerate(episodes):
            ids[i, :len(episode.token_ids)] = torch.tensor(episode.token_ids)
            target[i, :len(episode.token_ids)] = torch.tensor(episode.loss_mask, dtype=torch.bool)
        ids, target = ids.to(device), target.to(device)
        loss_value = supervised_step(model, optimizer, scheduler, ids, (ids != tokenizer.pad_token_id).long(), target)
    toolbox.close()
    model.eval()
    return {"loss": loss_value, "seconds": time.perf_counter() - started, "steps": float(steps)}
