"""Session fixtures of the agents tests: the BPE tokenizers trained here (see agent_scripts.py)."""

from __future__ import annotations

import pytest
from agent_scripts import THINKING_TEMPLATE, TRIMMING_TEMPLATE, train_tokenizer


@pytest.fixture(scope="session")
def bpe_tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="session")
def thinking_tokenizer():
    return train_tokenizer(THINKING_TEMPLATE)


@pytest.fixture(scope="session")
def trimming_tokenizer():
    return train_tokenizer(TRIMMING_TEMPLATE)
