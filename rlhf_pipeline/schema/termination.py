"""Why a trajectory ended: the codes stored in the optional ``termination_reason`` row field.

The code lives in the schema (not with the environments that produce it) because readers of a
buffer -- ``filter``, ``inspect``, a learner that masks some endings out of the loss -- must
understand it without importing the agents package. Codes are stable on disk: append new ones,
never renumber.

Which reasons are ``terminated`` and which ``truncated`` follows Gymnasium's split: an episode is
*terminated* when it reached an end the policy is answerable for (the environment said done, or
the policy's tool use failed past the environment's tolerance), and *truncated* when something
outside the task cut it short (a turn, token or context limit, the per-turn generation length, a
timeout). A truncated episode's last state has a value we did not observe; a learner may mask
those out of the loss.
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
