"""The default pipeline with a training reward that can be gamed: it pays for the answer's length, not
its being right. Its held-out set is the default's, scored on the exact answer, so training reward
rising while the held-out score falls is reward hacking caught by evaluation (tests/evaluation/test_best_run.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import rlhf_pipeline
from rlhf_pipeline.pipeline import Pipeline, RunPaths, load_pipeline_module

# by the package's place, not this file's: the run keeps a copy of this file and rebuilds from it
_DEFAULT = load_pipeline_module(Path(rlhf_pipeline.__file__).resolve().parents[1] / "pipelines" / "default.py")


@dataclasses.dataclass
class Settings(_DEFAULT.Settings):
    """The default pipeline's settings (this file is what the run keeps as its pipeline)."""


def length_reward(prompts, completions, **_) -> list[float]:
    """The share of the longest answer the completion fills, right or wrong."""
    return [min(len(c), 6) / 6 for c in completions]


def build(settings: Settings, run: RunPaths) -> Pipeline:
    from rlhf_pipeline.collect import Collector, CollectorConfig, PromptSource, SamplingConfig

    pipeline = _DEFAULT.build(settings, run)
    prompts = _DEFAULT.training_prompts(settings, _DEFAULT.held_out_prompts(settings))

    def collector(engine, sink, store, collector_index: int):
        config = CollectorConfig(
            prompts_per_batch=settings.prompts_per_round, num_generations=settings.group_size,
            sampling=SamplingConfig(max_new_tokens=settings.max_new_tokens, temperature=settings.temperature),
            seed=settings.seed, collector_index=collector_index,
        )
        source = PromptSource(prompts, seed=settings.seed + 1_000_003 * collector_index, required_fields=("answer",))
        return Collector(engine, pipeline.tokenizer, source, {"length": length_reward}, sink=sink, config=config)

    return dataclasses.replace(pipeline, collector=collector, preflight=lambda: None)
