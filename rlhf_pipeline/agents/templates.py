"""Whether a tokenizer's chat template can render an agent's conversation, asked before any work. An
episode (:class:`~.episode.Episode`) and every demonstration of a warm start are rendered through the
tokenizer's chat template; a tokenizer with no template, or one that knows no ``tool`` role, would fail
only there, deep inside the warm start, after the run directory was made. A pipeline's ``preflight``
calls :func:`check_chat_template` instead, which renders a short conversation of the roles the pipeline
uses and says in one line what is missing. Design: docs/agents.md#collecting-episodes-into-the-buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

SAMPLE_MESSAGES = {
    "system": "You can call tools.",
    "user": "What is 12 * 34?",
    "assistant": '<tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 34}}</tool_call>',
    "tool": "408",
}


def check_chat_template(tokenizer: Any, *, roles: Sequence[str] = ("user", "assistant", "tool"),
                        tools: Sequence[Callable[..., Any] | dict[str, Any]] | None = None,
                        template_kwargs: dict[str, Any] | None = None) -> None:
    """Raises ``ValueError`` (one line, naming the fix) unless ``tokenizer.apply_chat_template``
    renders a conversation of ``roles`` (in that order, then a generation prompt) with ``tools``
    (functions or JSON schemas, as ``apply_chat_template`` takes them)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"the tokenizer has no chat template, and an agent's episodes are rendered with "
                         f"one; set tokenizer.chat_template (rlhf_pipeline.models.char_tool_tokenizer() has one "
                         f"with a tool role)")
    messages = [{"role": role, "content": SAMPLE_MESSAGES.get(role, "...")} for role in roles]
    try:
        tokenizer.apply_chat_template(messages, tools=list(tools) if tools else None, tokenize=False,
                                      add_generation_prompt=True, **(template_kwargs or {}))
    except Exception as exc:  # Jinja's TemplateError, transformers' ValueError: the template's own words
        said = " ".join(str(exc).split())
        raise ValueError(f"the tokenizer's chat template cannot render a conversation of the roles "
                         f"{', '.join(roles)}: {type(exc).__name__}: {said}; use a template with these roles "
                         f"(rlhf_pipeline.models.char_tool_tokenizer() has one)") from None
