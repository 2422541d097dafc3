"""A tool-use environment built from scratch: write a number in binary with a tool (docs/your-own-pipeline.md).

    rlhf-pipeline run pipelines/examples/binary_tool.py

The page builds this file step by step: the tool, the environment, demonstrations and a warm
start, the pipeline.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Annotated

from rlhf_pipeline.agents.environment import StepResult
from rlhf_pipeline.learn.settings import LearnerSettings
from rlhf_pipeline.pipeline import Pipeline, RunPaths
from rlhf_pipeline.run_settings import RunSettings
from rlhf_pipeline.setting_checks import Bounds


def to_binary(number: int) -> str:
    """Writes a whole number in base 2.

    Args:
        number: the number to convert
    """
    return format(int(number), "b")


def binary_tasks(n: int, *, seed: int) -> list[dict[str, str]]:
    """``n`` tasks: what the environment's ``reset`` reads."""
    rng = random.Random(seed)
    numbers = [rng.randint(10, 99) for _ in range(n)]
    return [{"question": f"{k} in binary?", "number": str(k), "answer": format(k, "b")} for k in numbers]


class BinaryEnv:
    """One episode: the model may call ``to_binary``; its first turn without a call is its answer."""

    def __init__(self, toolbox):
        self.toolbox = toolbox  # shared by every episode: it runs the calls on its own threads

    def reset(self, task):
        self.answer = task["answer"]
        return [{"role": "user", "content": task["question"]}]

    def step(self, turn):
        if turn.tool_calls:
            return StepResult(self.toolbox.run(turn.tool_calls))
        said = turn.text.strip()
        right = sum(a == b for a, b in zip(reversed(said), reversed(self.answer)))
        credit = 1.0 if said == self.answer else 0.5 * right / max(len(said), len(self.answer))
        return StepResult(reward=credit, done=True)


def demonstration(tokenizer, task, toolbox):
    """One ended episode as a rollout records it: the call, the tool's answer, the reply."""
    from rlhf_pipeline.agents.episode import Episode
    from rlhf_pipeline.agents.tools import parse_hermes

    env = BinaryEnv(toolbox)
    episode = Episode(tokenizer, env.reset(task), tools=toolbox.schemas, parser=parse_hermes, check_drift=False)
    call = f'<tool_call>{{"name":"to_binary","arguments":{{"number":{task["number"]}}}}}</tool_call>'
    for text in (call, task["answer"]):
        ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        episode.add_environment(env.step(episode.add_turn(ids, [0.0] * len(ids))))
    return episode


def warm_start(model, tokenizer, steps: int, *, lr: float, seed: int) -> float:
    """Supervised steps on demonstrations, the loss on the model's own turns; returns the last loss."""
    import torch

    from rlhf_pipeline.agents.tools import ToolBox
    from rlhf_pipeline.models.supervised import supervised_step

    toolbox = ToolBox([to_binary])
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / (steps // 10 + 1)))
    model.train()
    loss = float("nan")
    for step in range(steps):
        tasks = binary_tasks(32, seed=10_000 + seed * 1_000 + step)  # not the training tasks
        episodes = [demonstration(tokenizer, task, toolbox) for task in tasks]
        width = max(len(e.token_ids) for e in episodes)
        ids = torch.full((len(episodes), width), tokenizer.pad_token_id)  # (B, L), right-padded
        target = torch.zeros((len(episodes), width), dtype=torch.bool)  # (B, L): the model's own tokens
        for row, episode in enumerate(episodes):
            ids[row, :len(episode.token_ids)] = torch.tensor(episode.token_ids)
            target[row, :len(episode.token_ids)] = torch.tensor(episode.loss_mask, dtype=torch.bool)
        loss = supervised_step(model, optimizer, scheduler, ids, (ids != tokenizer.pad_token_id).long(), target)
    toolbox.close()
    model.eval()
    return loss


@dataclass
class Settings(RunSettings):
    steps: int = 20
    """Learner steps (optimizer updates); --steps sets it."""
    group_size: int = 4
    """Episodes per task (GRPO's G)."""
    warm_start_steps: Annotated[int, Bounds(ge=0, why=" (0: none)")] = 300
    """Supervised steps on demonstrations before RL (0: none)."""
    tasks_per_round: Annotated[int, Bounds(ge=1)] = 4
    """Tasks per collection round."""
    max_turns: Annotated[int, Bounds(ge=1)] = 3
    """Model turns per episode at most."""
    learner: LearnerSettings = field(default_factory=lambda: LearnerSettings(
        batch_size=32, sampler="exact", new_rows_per_step=32, lr=1e-3, warmup_steps=3, checkpoint_every=10,
        log_every=5))
    """Learner settings (--set learner.lr=3e-4; --list-settings shows them all)."""


def build(settings: Settings, run: RunPaths) -> Pipeline:
    from rlhf_pipeline.agents.episode import AGENT_ROW_FIELDS
    from rlhf_pipeline.models import char_tool_tokenizer, tiny_causal_lm

    tokenizer = char_tool_tokenizer()
    tasks = binary_tasks(2048, seed=settings.seed)

    def make_model():
        return tiny_causal_lm(len(tokenizer), max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=tokenizer.eos_token_id, seed=settings.seed)

    def make_policy():
        model = make_model()
        if settings.warm_start_steps:
            loss = warm_start(model, tokenizer, settings.warm_start_steps, lr=1e-2, seed=settings.seed)
            print(f"[run] warm start: {settings.warm_start_steps} steps, loss {loss:.3f}", flush=True)
        return model

    def make_write_path(store):
        from rlhf_pipeline.transforms.group_advantage import GroupAdvantage

        return [GroupAdvantage(settings.group_size, trajectory_return="sum")]

    def collector(engine, sink, store, collector_index: int):
        from rlhf_pipeline.agents.episode import EpisodeLimits
        from rlhf_pipeline.agents.tools import ToolBox, parse_hermes
        from rlhf_pipeline.collect import Collector, CollectorConfig, Environments, SamplingConfig, TaskSource
        from rlhf_pipeline.collect.console import agent_round_printer

        toolbox = ToolBox([to_binary], timeout_s=5.0, max_output_chars=100)
        config = CollectorConfig(
            tasks_per_round=settings.tasks_per_round, group_size=settings.group_size, seed=settings.seed,
            sampling=SamplingConfig(temperature=settings.temperature), collector_index=collector_index)
        episodes = Environments(lambda: BinaryEnv(toolbox), parser=parse_hermes,
                                limits=EpisodeLimits(max_turns=settings.max_turns, max_new_tokens=64, context_length=256))
        source = TaskSource(tasks, seed=settings.seed + collector_index, required_fields=("question", "answer"))
        return Collector(engine, tokenizer, source, episodes, sink=sink, config=config,
                         hooks=[agent_round_printer(5, collector_index, toolbox)])  # a line every 5 rounds

    def preflight():
        from rlhf_pipeline.agents.templates import check_chat_template

        check_chat_template(tokenizer, tools=[to_binary])

    return Pipeline(settings=settings, make_policy=make_policy, make_model=make_model, tokenizer=tokenizer,
                    make_write_path=make_write_path, row_fields=("advantage", "termination_reason", *AGENT_ROW_FIELDS),
                    collector=collector, preflight=preflight)
