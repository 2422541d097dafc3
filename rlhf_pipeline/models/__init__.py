"""Models and tokenizers: tiny offline ones built from configs, real ones from local paths.

Design: docs/architecture.md#models-and-tokenizers.
"""

from rlhf_pipeline.models.loading import ModelLoadError, load_model, load_reward_model, load_tokenizer
from rlhf_pipeline.models.tiny import (
    CHAT_TEMPLATE,
    TOOL_CHAT_TEMPLATE,
    char_tokenizer,
    char_tool_tokenizer,
    tiny_causal_lm,
    tiny_model_and_tokenizer,
    tiny_reward_model,
)

__all__ = [
    "CHAT_TEMPLATE",
    "TOOL_CHAT_TEMPLATE",
    "ModelLoadError",
    "char_tokenizer",
    "char_tool_tokenizer",
    "load_model",
    "load_reward_model",
    "load_tokenizer",
    "tiny_causal_lm",
    "tiny_model_and_tokenizer",
    "tiny_reward_model",
]
