"""A single-turn task built from scratch: write a word backwards (docs/your-own-pipeline.md).

    rlhf-pipeline run pipelines/examples/reverse_words.py

The page builds this file step by step: prompt records, a reward, a warm start, the pipeline.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Annotated

from rlhf_pipeline.collect.prompts import PromptRecord
from rlhf_pipeline.learn.settings import LearnerSettings
from rlhf_pipeline.pipeline import Pipeline, RunPaths, preflight_rewards
from rlhf_pipeline.run_settings import RunSettings
from rlhf_pipeline.setting_checks import Bounds


def reverse_prompts(n: int, *, length: int, seed: int) -> list[PromptRecord]:
    """``n`` prompts "reverse: abc", each carrying its ``answer`` field for the reward."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(length))
        records.append(PromptRecord(messages=({"role": "user", "content": f"reverse: {word}"},),
                                    fields={"answer": word[::-1]}, prompt_id=f"reverse-{word}"))
    return records


def reverse_reward(prompts: list[str], completions: list[str], *, answer: list[str], **_) -> list[float]:
    """The share of letters in their right place; 1.0 only for the whole word, with nothing after it."""
    rewards = []
    for completion, target in zip(completions, answer):
        said = completion.strip()
        right = sum(a == b for a, b in zip(said, target))
        rewards.append(right / max(len(said), len(target)))
    return rewards


def warm_start(model, tokenizer, steps: int, *, length: int, lr: float, seed: int) -> float:
    """Supervised steps on right answers, the loss on the assistant's tokens only; returns the last loss."""
    import torch

    from rlhf_pipeline.models.supervised import supervised_step

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
    model.train()
    loss = float("nan")
    for step in range(steps):
        records = reverse_prompts(32, length=length, seed=10_000 + seed * 1_000 + step)  # not the training prompts
        chats = [[*r.messages, {"role": "assistant", "content": r.fields["answer"]}] for r in records]
        batch = tokenizer.apply_chat_template(chats, return_dict=True, return_assistant_tokens_mask=True,
                                              padding=True, return_tensors="pt")
        loss = supervised_step(model, optimizer, scheduler, batch["input_ids"], batch["attention_mask"],
                               batch["assistant_masks"].bool())
    model.eval()
    return loss


@dataclass
class Settings(RunSettings):
    steps: int = 100
    """Learner steps (optimizer updates); --steps sets it."""
    length: Annotated[int, Bounds(ge=1, le=8)] = 3
    """Letters per word."""
    warm_start_steps: Annotated[int, Bounds(ge=0, why=" (0: none)")] = 200
    """Supervised steps before RL (0: none; a random tiny model writes noise)."""
    prompts_per_round: Annotated[int, Bounds(ge=1)] = 8
    """Prompts per collection round."""
    learner: LearnerSettings = field(default_factory=lambda: LearnerSettings(
        batch_size=64, sampler="exact", new_rows_per_step=64, lr=1e-3, warmup_steps=5, checkpoint_every=50,
        log_every=10))
    """Learner settings (--set learner.lr=1e-4; --list-settings shows them all)."""


def build(settings: Settings, run: RunPaths) -> Pipeline:
    from rlhf_pipeline.models import char_tokenizer, tiny_causal_lm

    tokenizer = char_tokenizer()
    prompts = reverse_prompts(2048, length=settings.length, seed=settings.seed)
    rewards = {"reverse": reverse_reward}

    def make_model():
        return tiny_causal_lm(len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=tokenizer.eos_token_id, seed=settings.seed)

    def make_policy():
        model = make_model()
        if settings.warm_start_steps:
            loss = warm_start(model, tokenizer, settings.warm_start_steps, length=settings.length, lr=3e-3,
                              seed=settings.seed)
            print(f"[run] warm start: {settings.warm_start_steps} steps, loss {loss:.3f}", flush=True)
        return model

    def make_write_path(store):
        from rlhf_pipeline.transforms.group_advantage import GroupAdvantage

        return [GroupAdvantage(settings.group_size)]

    def collector(engine, sink, store, collector_index: int):
        from rlhf_pipeline.collect import Collector, CollectorConfig, PromptSource, SamplingConfig, SingleTurn

        config = CollectorConfig(tasks_per_round=settings.prompts_per_round, group_size=settings.group_size,
                                 sampling=SamplingConfig(max_new_tokens=settings.length + 2,
                                                         temperature=settings.temperature),
                                 seed=settings.seed, collector_index=collector_index)
        source = PromptSource(prompts, seed=settings.seed + collector_index, required_fields=("answer",))
        return Collector(engine, tokenizer, source, SingleTurn(rewards), sink=sink, config=config)

    return Pipeline(settings=settings, make_policy=make_policy, make_model=make_model, tokenizer=tokenizer,
                    make_write_path=make_write_path, collector=collector,
                    preflight=lambda: preflight_rewards(rewards, prompts[:1], settings.group_size))
