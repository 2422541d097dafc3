"""A toy tool-using environment: products of two numbers, with a ``multiply`` tool, and its warm start.

A turn with tool calls is answered by the tools (reward 0); a turn without is the final answer,
paid 1 when its LAST number is the product (a policy paid for containing it learns to write long
strings of digits), or partial credit per matching digit with ``partial_credit``.
:func:`warm_start` trains on demonstrations built as real episodes; copying the factors into the
call is learned abruptly, so :func:`evaluate_tool_use` checks it in greedy episodes and
:func:`warm_start_until_copying` adds stages until it copies (measured: docs/pipelines.md).
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

import torch

from rlhf_pipeline.agents.environment import Message, ModelTurn, StepResult
from rlhf_pipeline.agents.episode import Episode
from rlhf_pipeline.agents.tools import ToolBox, parse_hermes
from rlhf_pipeline.models.supervised import supervised_step, warmup_then_cosine
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


def warm_start_demonstrations(tokenizer, steps: int, *, tool_fraction: float = 0.5, batch_size: int = 32,
                              seed: int = 0, low: int = 10, high: int = 99, first_step: int = 0,
                              held_out: Collection[str] = ()) -> Iterator[tuple[list[bool], list[Episode]]]:
    """The :func:`warm_start`'s batches, one a step: whether each demonstration calls the tool, and the
    :func:`demonstration` episodes. Never a task whose question is in ``held_out`` (an evaluation's
    tasks): a batch that drew some is that much smaller, and every other demonstration is the one it
    would be without them. Tasks come from seeds disjoint from :func:`product_tasks`' defaults."""
    rng = random.Random(seed + 20_000 + first_step)
    toolbox = ToolBox([multiply])
    try:
        for step in range(first_step, first_step + steps):
            uses_tool, episodes = [], []
            for task in product_tasks(batch_size, low=low, high=high, seed=seed + 10_000 + step):
                # each task's draw of the tool, then of a guess, held out or not: the rest stay as they were
                tool, guess = rng.random() < tool_fraction, rng.randint(low * low, high * high)
                if task["question"] not in held_out:
                    uses_tool.append(tool)
                    episodes.append(demonstration(tokenizer, task, use_tool=tool, guess=guess, toolbox=toolbox))
            yield uses_tool, episodes
    finally:
        toolbox.close()


def warm_start(model, tokenizer, steps: int, *, tool_fraction: float = 0.5, batch_size: int = 32, lr: float = 3e-3,
               copy_weight: float = 1.0, seed: int = 0, low: int = 10, high: int = 99, first_step: int = 0,
               max_grad_norm: float | None = 1.0, min_lr_ratio: float = 0.1,
               held_out: Collection[str] = ()) -> dict[str, float]:
    """Supervised steps on :func:`demonstration` episodes (next-token loss where the episode's loss
    mask is 1: the model's own turns), ``tool_fraction`` of them calling the tool.

    The schedule is a linear warm-up over the first tenth, then a cosine down to ``min_lr_ratio *
    lr``, with gradients clipped to ``max_grad_norm``: at a constant rate, copying the factors into
    the call was learned abruptly and on some seeds and machines not at all, or learned and lost
    again; the decay lets it settle (``docs/pipelines.md`` has the measurements). ``first_step``
    numbers the first step, so a later stage (:func:`warm_start_until_copying`) draws demonstrations
    no earlier stage saw. ``copy_weight`` weighs the digits a tool demonstration copies (the factors
    into the call, the tool's answer into the reply) against the other tokens of the model's turns.
    The demonstrations are :func:`warm_start_demonstrations`', never of a ``held_out`` question.
    Returns ``{"loss", "seconds", "steps"}`` (the loss of the last step, weighted); the model is left
    in eval mode."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_then_cosine(steps, warmup=max(1, steps // 10), floor=min_lr_ratio))
    device = next(model.parameters()).device
    digit_ids = torch.tensor(digit_token_ids(tokenizer), dtype=torch.long)
    model.train()
    started, loss_value = time.perf_counter(), float("nan")
    for uses_tool, episodes in warm_start_demonstrations(
            tokenizer, steps, tool_fraction=tool_fraction, batch_size=batch_size, seed=seed, low=low, high=high,
            first_step=first_step, held_out=held_out):
        if not episodes:  # every task drawn is held out (a tiny batch of a tiny range)
            continue
        width = max(len(e.token_ids) for e in episodes)
        ids = torch.full((len(episodes), width), tokenizer.pad_token_id, dtype=torch.long)  # (B, L) right-padded
        target = torch.zeros((len(episodes), width), dtype=torch.bool)  # (B, L): the model's own tokens
        for i, episode in enumerate(episodes):
            ids[i, :len(episode.token_ids)] = torch.tensor(episode.token_ids)
            target[i, :len(episode.token_ids)] = torch.tensor(episode.loss_mask, dtype=torch.bool)
        weights = None
        if copy_weight != 1.0:  # (B, L): copy_weight on a tool demonstration's digits, 1 elsewhere
            copied = torch.isin(ids, digit_ids) & torch.tensor(uses_tool)[:, None]
            weights = torch.where(copied, copy_weight, 1.0).to(device)
        ids, target = ids.to(device), target.to(device)
        loss_value = supervised_step(model, optimizer, scheduler, ids, (ids != tokenizer.pad_token_id).long(), target,
                                     weights, max_grad_norm=max_grad_norm)
    model.eval()
    return {"loss": loss_value, "seconds": time.perf_counter() - started, "steps": float(steps)}


def warm_start_until_copying(model, tokenizer, steps: int, *, check: Callable[[Any], Mapping[str, float]] | None,
                             target: float, more_stages: int = 2,
                             on_stage: Callable[[Mapping[str, float], Mapping[str, float] | None, int], None]
                             | None = None,
                             **options: Any) -> tuple[dict[str, float], Mapping[str, float] | None]:
    """:func:`warm_start` for ``steps``, then, while ``check(model)``'s ``right_factors`` is below
    ``target``, up to ``more_stages`` stages of ``steps // 2`` more (each a warm restart of the
    schedule on fresh demonstrations). Measured over seeds and thread counts, one schedule either
    reached copying or stalled short of it on the same seed, and a short second run from the stalled
    weights reached it: the check makes a stall visible, the stages get past it. ``on_stage(result,
    reached, next_steps)`` is called after each stage (``reached`` None when ``check`` is None;
    ``next_steps`` the steps of the stage that follows, 0 when none does). Returns the last stage's
    result with ``steps`` and ``seconds`` summed over the stages, and the last check."""
    result = warm_start(model, tokenizer, steps, **options)
    total, seconds, stages_left = steps, result["seconds"], more_stages
    while True:
        reached = check(model) if check is not None else None
        again = reached is not None and reached["right_factors"] < target and stages_left > 0 and steps // 2 > 0
        if on_stage is not None:
            on_stage(result, reached, steps // 2 if again else 0)
        if not again:
            return {**result, "steps": float(total), "seconds": seconds}, reached
        stages_left -= 1
        result = warm_start(model, tokenizer, steps // 2, first_step=total, **options)
        total, seconds = total + steps // 2, seconds + result["seconds"]


def digit_token_ids(tokenizer) -> list[int]:
    """The ids of the tokens that are digits only (one each in a character tokenizer)."""
    return [i for i, token in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))
            if token and token.lstrip("Ġ▁ ").isdigit()]


# ======================================================================== what the warm start reached
def question_factors(question: str) -> tuple[int, int]:
    """``(a, b)`` of ``"What is a * b?"``."""
    a, b = str(question).removeprefix("What is ").removesuffix("?").split(" * ")
    return int(a), int(b)


@torch.no_grad()
def greedy_turns(model, prompts: list[list[int]], max_new_tokens: int, *, pad_token_id: int,
                 eos_token_id: int) -> list[list[int]]:
    """Each prompt's most likely continuation, to ``eos_token_id`` (kept) or ``max_new_tokens``.
    No KV cache: the whole left-padded batch is run again for each token, which is plenty for a
    tiny model on a few dozen prompts and needs nothing but the model's forward."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_token_id] * (width - len(p)) + list(p) for p in prompts], device=device)  # (N, P)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)  # (N, P)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    out: list[list[int]] = [[] for _ in prompts]
    for _ in range(max_new_tokens):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding: each prompt starts at position 0
        token = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1].argmax(-1)  # (N,)
        for i in (~done).nonzero().flatten().tolist():
            out[i].append(int(token[i]))
        done |= token == eos_token_id
        if bool(done.all()):
            break
        ids = torch.cat([ids, token.masked_fill(done, pad_token_id)[:, None]], dim=1)
        mask = torch.cat([mask, (~done).long()[:, None]], dim=1)
    return out


def evaluate_tool_use(model, tokenizer, tasks: list[Mapping[str, Any]], *, max_turns: int = 3,
                      max_new_tokens: int = 64, context_length: int = 384) -> dict[str, float]:
    """Runs one greedy episode per task with the real tool and says what the model does, as shares
    of the tasks: ``tool_calls`` (its first turn makes a call that parses), ``right_factors`` (that
    call is ``multiply`` with the question's two factors, in order) and ``exact`` (the episode's
    final answer is the product). A model that calls with wrong factors gets calls that pay no
    better than guesses, and RL has nothing to reinforce: :func:`warm_start` has to reach copying."""
    from rlhf_pipeline.agents.episode import EpisodeLimits

    toolbox = ToolBox([multiply])
    limits = EpisodeLimits(max_turns=max_turns, max_new_tokens=max_new_tokens, context_length=context_length)
    envs = [CalculatorEnv(toolbox, max_tool_errors=2) for _ in tasks]
    episodes = [Episode(tokenizer, env.reset(task), limits=limits, tools=toolbox.schemas, parser=parse_hermes,
                        check_drift=False) for env, task in zip(envs, tasks, strict=True)]
    was_training = model.training
    model.eval()
    try:
        while active := [k for k, episode in enumerate(episodes) if not episode.done]:
            turns = greedy_turns(model, [episodes[k].token_ids for k in active],
                                 min(episodes[k].max_new_tokens() for k in active),
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            for k, ids in zip(active, turns, strict=True):
                episodes[k].add_environment(envs[k].step(episodes[k].add_turn(ids, [0.0] * len(ids))))
    finally:
        toolbox.close()
        model.train(was_training)
    called = right = exact = 0
    for task, episode in zip(tasks, episodes, strict=True):
        calls = [c for c in episode.turns[0].tool_calls if c.error is None]
        called += bool(calls)
        right += bool(calls) and calls[0].name == "multiply" and _factors_of(calls[0].arguments) == \
            question_factors(task["question"])
        exact += episode.rewards[-1] == 1.0  # the environment without partial credit: 1 only for the product
    n = max(1, len(tasks))
    return {"tool_calls": called / n, "right_factors": right / n, "exact": exact / n}


def _factors_of(arguments: Any) -> tuple[Any, Any] | None:
    return (arguments.get("a"), arguments.get("b")) if isinstance(arguments, Mapping) else None
