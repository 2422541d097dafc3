"""Which ways a turn's tool calls failed: the bits of the optional ``tool_error_kinds`` row field.

A turn's row counts its tool calls (``tool_calls``) and the failed ones (``tool_errors``); this
says how they failed, one bit per kind, so a reader (``filter``, ``inspect``, ``show``) can tell
a model that writes broken JSON from a tool that times out without importing the agents
package. The names are ``ToolBox.METRICS``' failure counters. Stable on disk: append new kinds,
never renumber. Design: docs/architecture.md#rows-and-the-padded-batch.
"""

from __future__ import annotations

import enum


class ToolErrorKind(enum.IntFlag):
    MALFORMED = 1
    """The call could not be parsed (not JSON, not closed, no name)."""
    UNKNOWN_TOOL = 2
    """The call named a tool the environment does not offer."""
    BAD_ARGUMENTS = 4
    """The arguments did not bind to the tool's signature."""
    RAISED = 8
    """The tool raised an exception."""
    TIMEOUT = 16
    """The tool ran past its timeout."""
    OVER_CALL_LIMIT = 32
    """More calls than a turn may make; this one was not run."""
    BAD_OUTPUT = 64
    """The tool's result could not be made into text the model can read (an object whose
    ``str()`` raises, an int past Python's digit limit, a lone surrogate)."""


ALL_TOOL_ERROR_KINDS = int(sum(ToolErrorKind))


def kind_names(bits: int) -> list[str]:
    """The lowercase names of the kinds set in ``bits`` (``["unknown_tool", "timeout"]``)."""
    return [kind.name.lower() for kind in ToolErrorKind if bits & kind]
