from __future__ import annotations

import pytest

from rlhf_pipeline.models import tiny_model_and_tokenizer


@pytest.fixture(scope="session")
def tiny():
    """(model, tokenizer): a tiny random Qwen2 and the char tokenizer; treat as read-only."""
    return tiny_model_and_tokenizer(hidden_size=32, num_layers=2, num_heads=4)
