"""Shared by the agent collector tests and their kill -9 worker: a tiny real model with the char
tool tokenizer, a multi-turn test environment, and a collector writing through the write path.

``TurnsEnv`` runs ``task["turns"]`` model turns; each turn's reward depends on what was sampled
(its length mod 3), so returns vary within a group, and every step makes one real ``multiply``
call through the environment's ``ToolBox``, so the per-round tool counts are known exactly.
"""

from __future__ import annotations

import threading
from pathlib import Path

from rlhf_pipeline.agents.environment import StepResult, ToolCall
from rlhf_pipeline.agents.episode import AGENT_ROW_FIELDS, EpisodeLimits
from rlhf_pipeline.agents.calculator import multiply
from rlhf_pipeline.agents.tools import ToolBox, parse_hermes
from rlhf_pipeline.collect import Collector, CollectorConfig, Environments, SamplingConfig, TaskSource
from rlhf_pipeline.models import char_tool_tokenizer, tiny_causal_lm
from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage import create_store, make_replay_buffer, open_store
from rlhf_pipeline.transforms.group_advantage import GroupAdvantage

GROUP_SIZE = 3
TASKS = [{"question": f"Say something, {k}.", "turns": 1 + k % 3} for k in range(7)]


class TurnsEnv:
    def __init__(self, toolbox: ToolBox, on_step=None):
        self.toolbox, self.on_step = toolbox, on_step

    def reset(self, task):
        self.turns = int(task["turns"])
        return [{"role": "user", "content": task["question"]}]

    def step(self, turn):
        if self.on_step is not None:
            self.on_step(turn)
        answers = self.toolbox.run([ToolCall("multiply", {"a": turn.index, "b": 7}, "")])
        reward = float(len(turn.text) % 3)
        if turn.index + 1 >= self.turns:
            return StepResult(reward=reward, done=True)
        return StepResult(answers, reward=reward)


def tiny_policy():
    tokenizer = char_tool_tokenizer()
    model = tiny_causal_lm(len(tokenizer), hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=512,
                           pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, seed=3)
    return model, tokenizer


def open_or_create(path: Path):
    if path.exists():
        return open_store(path, mode="a")
    return create_store(path, "memmap", schema=StoreSchema(optional=("advantage", "termination_reason",
                                                                   *AGENT_ROW_FIELDS)))


def agent_collector(model, tokenizer, store, *, on_step=None, sink=None, tasks_per_round=2, make_env=None):
    """A collector of ``TurnsEnv`` episodes (or ``make_env(toolbox)``'s); rows go through ``GroupAdvantage``
    into ``store``, each group as it ends."""
    toolbox = ToolBox([multiply])
    if sink is None:
        buffer = make_replay_buffer(store, batch_size=4, transforms=[GroupAdvantage(GROUP_SIZE)])
        sink = buffer.extend
    config = CollectorConfig(tasks_per_round=tasks_per_round, group_size=GROUP_SIZE,
                             sampling=SamplingConfig(temperature=1.5), seed=11)
    build = (lambda: TurnsEnv(toolbox, on_step)) if make_env is None else (lambda: make_env(toolbox))
    episodes = Environments(build, parser=parse_hermes,
                            limits=EpisodeLimits(max_turns=3, max_new_tokens=6, end_on_cut_turn=False))
    return Collector(model, tokenizer, TaskSource(TASKS, seed=5), episodes, sink, config)


def hang_forever() -> None:
    threading.Event().wait()
