"""Shared pytest setup: ``tests/`` on ``sys.path`` so tests can ``from helpers import ...``."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

# Two cores shared by many processes: one intra-op thread keeps tests predictable.
torch.set_num_threads(1)
