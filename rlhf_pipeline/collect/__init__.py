"""Collection: prompts and tasks, rewards, the one collector over episodes of one turn or with
environments, a toy task (and, re-exported from ``generation``, batched sampling with log-probs).
Design: docs/collector.md#the-collector.
"""

from rlhf_pipeline.collect.collector import Collector, CollectorConfig
from rlhf_pipeline.collect.episodes import Environments, SingleTurn
from rlhf_pipeline.generation.loop import Generation, generate, teacher_forced_log_probs
from rlhf_pipeline.generation.sampling import SamplingConfig, process_logits
from rlhf_pipeline.collect.prompts import (
    PromptError,
    PromptRecord,
    PromptSource,
    TaskSource,
    load_jsonl,
    make_prompt,
    validate_prompts,
)
from rlhf_pipeline.collect.rewards import (
    REWARDS,
    RewardError,
    RewardModelReward,
    WeightedReward,
    extract_number,
    get_reward,
    score,
)

__all__ = [
    "REWARDS", "Collector", "CollectorConfig", "Environments", "Generation", "SingleTurn",
    "PromptError", "PromptRecord", "PromptSource", "RewardError", "RewardModelReward", "SamplingConfig",
    "TaskSource", "WeightedReward", "extract_number", "generate", "get_reward", "load_jsonl", "make_prompt",
    "process_logits", "score", "teacher_forced_log_probs", "validate_prompts",
]
