"""The ``turn_messages`` text field: one turn's chat messages as the environment produced them.

A multi-turn row stores its tokens (the source of truth) and their text as the chat template
rendered it. What the template rendered from -- the messages, with their roles (system, user,
tool, assistant) -- is kept beside them so that a trajectory can leave the buffer as a
conversation (``export --format chat``) and come back (``import``) unchanged. A row's
messages are those added before its turn (the task's opening messages at step 0; tool answers
and user replies after), then the model's own message. One encoding, used by the writer and by
``import``, so a round trip gives the stored bytes back. Design: docs/schema.md#multi-turn-episodes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any


def encode_turn_messages(messages: Sequence[Mapping[str, Any]]) -> str:
    """Compact JSON, non-ASCII kept as is; values JSON cannot hold are written as their ``str``."""
    return json.dumps([dict(m) for m in messages], ensure_ascii=False, separators=(",", ":"), default=str)


def decode_turn_messages(text: str) -> list[dict[str, Any]]:
    """The messages of ``encode_turn_messages``; ValueError naming the problem when ``text`` is not one."""
    try:
        messages = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"turn_messages is not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ValueError("turn_messages must be a JSON list of messages, each an object with a 'role'")
    return messages
