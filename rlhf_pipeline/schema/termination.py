"""Why a trajectory ended: the codes stored in the optional ``termination_reason`` row field.

Terminated or truncated follows Gymnasium's split; codes are stable on disk (append, never
renumber). Design: docs/architecture.md#rows-and-the-padded-batch.
"""

from __future__ import annotations

import enum


class TerminationReason(enum.IntEnum):
    NOT_ENDED = 0
    """Not the trajectory's last row (or the writer recorded no reason)."""
    ENV_DONE = 1
    """The environment ended the episode (a final answer, a solved task; for single-turn rows the
    model's end-of-sequence token)."""
    MAX_TURNS = 2
    """The episode reached its limit of model turns."""
    TOKEN_BUDGET = 3
    """The per-trajectory budget of tokens (prompt, environment and sampled) was spent."""
    CONTEXT_FULL = 4
    """The next turn would not fit in the model's context length."""
    GENERATION_LENGTH = 5
    """The model's turn hit its ``max_new_tokens`` without ending its message."""
    TOOL_ERROR = 6
    """The environment ended the episode over failed tool calls."""
    TIMEOUT = 7
    """An environment step (or a tool) took longer than its timeout."""

    @property
    def terminated(self) -> bool:
        return self in _TERMINATED

    @property
    def truncated(self) -> bool:
        return self is not TerminationReason.NOT_ENDED and self not in _TERMINATED


_TERMINATED = frozenset({TerminationReason.ENV_DONE, TerminationReason.TOOL_ERROR})
