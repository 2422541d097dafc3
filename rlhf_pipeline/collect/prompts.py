"""Prompt records (chat ``messages`` or plain ``text``/``prompt``, plus the ``fields`` rewards read), their
validation, a JSONL loader, and the resumable sources a collector draws from: :class:`PromptSource`
(prompts) and :class:`TaskSource` (an environment's tasks), each a seeded per-epoch shuffle whose
``(epoch, position)`` state resumes without skipping or repeating one.
Design: docs/collector.md#the-collector.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


class PromptError(ValueError):
    """A prompt record is malformed; the message names the record and the field."""


@dataclass(frozen=True)
class PromptRecord:
    """One prompt: chat ``messages`` or ``text`` (exactly one), plus reward ``fields``."""

    messages: tuple[Mapping[str, str], ...] | None = None
    text: str | None = None
    fields: Mapping[str, Any] = field(default_factory=dict)
    prompt_id: str | None = None

    def render(self, tokenizer) -> list[int]:
        """Prompt token ids: the chat template with a generation prompt, or the tokenized text."""
        if self.messages is not None:
            ids = tokenizer.apply_chat_template(
                list(self.messages), add_generation_prompt=True, tokenize=True, return_dict=False
            )
            # transformers 5 may return a BatchEncoding-like mapping; normalise to a list of ints
            if isinstance(ids, Mapping):
                ids = ids["input_ids"]
            return list(ids)
        return list(tokenizer(self.text, add_special_tokens=False)["input_ids"])

    def display_text(self, tokenizer) -> str:
        """The prompt as stored in ``prompt_text``: the rendered template, or the raw text."""
        if self.messages is not None:
            return tokenizer.apply_chat_template(list(self.messages), add_generation_prompt=True, tokenize=False)
        return self.text


def make_prompt(
    source: PromptRecord | Mapping[str, Any] | str,
    *,
    required_fields: Sequence[str] = (),
    where: str = "prompt",
) -> PromptRecord:
    """Validates one record (a ``PromptRecord``, a JSON-like dict, or a bare string)."""
    if isinstance(source, PromptRecord):
        record = source
    elif isinstance(source, str):
        record = PromptRecord(text=source)
    elif isinstance(source, Mapping):
        data = dict(source)
        messages = data.pop("messages", None)
        text = data.pop("text", None)
        if "prompt" in data:
            if text is not None:
                raise PromptError(f"{where}: has both 'prompt' and 'text'; keep one")
            text = data.pop("prompt")
        prompt_id = data.pop("id", None)
        record = PromptRecord(
            messages=tuple(messages) if isinstance(messages, (list, tuple)) else messages,
            text=text,
            fields=data,
            prompt_id=None if prompt_id is None else str(prompt_id),
        )
    else:
        raise PromptError(f"{where}: expected a dict, str or PromptRecord, got {type(source).__name__}")

    if (record.messages is None) == (record.text is None):
        raise PromptError(
            f"{where}: needs exactly one of 'messages' (a chat) or 'text'/'prompt' (plain text)"
        )
    if record.text is not None and (not isinstance(record.text, str) or not record.text):
        raise PromptError(f"{where}: field 'text' must be a non-empty string")
    if record.messages is not None:
        if not isinstance(record.messages, tuple) or not record.messages:
            raise PromptError(f"{where}: field 'messages' must be a non-empty list of {{role, content}} dicts")
        for j, m in enumerate(record.messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise PromptError(f"{where}: messages[{j}] must be a dict with string 'role' and 'content'")
    missing = [f for f in required_fields if f not in record.fields]
    if missing:
        raise PromptError(
            f"{where}: missing field(s) {missing} that the rewards need; add them to every record "
            f"(e.g. {{\"messages\": [...], \"{missing[0]}\": ...}})"
        )
    return record


def validate_prompts(
    records: Iterable[PromptRecord | Mapping[str, Any] | str], *, required_fields: Sequence[str] = ()
) -> list[PromptRecord]:
    """All records validated (see :func:`make_prompt`); the first bad one raises ``PromptError``."""
    out = [make_prompt(r, required_fields=required_fields, where=f"prompt {i}") for i, r in enumerate(records)]
    if not out:
        raise PromptError("no prompts: a prompt source needs at least one record")
    return out


def load_jsonl(path: str | Path, *, required_fields: Sequence[str] = ()) -> list[PromptRecord]:
    """Reads one record per non-empty line of a JSONL file; errors name the file and line."""
    p = Path(path)
    if not p.is_file():
        raise PromptError(f"prompt file {str(p)!r} does not exist")
    records = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{p}:{lineno}"
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PromptError(f"{where}: not valid JSON ({exc.msg})") from None
            records.append(make_prompt(data, required_fields=required_fields, where=where))
    if not records:
        raise PromptError(f"prompt file {str(p)!r} holds no records")
    return records


class RecordCycle:
    """Cycles over a list of records forever, reshuffled each epoch with ``seed``; resumable.

    The order of epoch ``e`` is a permutation drawn from ``seed + e``, so the state is just
    ``(epoch, position)`` and the sequence after a restart is exactly the one an uninterrupted
    source would have produced. ``shuffle=False`` keeps the given order. The base of
    :class:`PromptSource` and :class:`TaskSource`, which differ in what a record is.
    """

    _kind, _noun = "record", "records"  # for messages: "prompt source ... 12 records"

    def __init__(self, items: list, *, seed: int, shuffle: bool) -> None:
        self._items = items
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self._items)))
        return torch.randperm(len(self._items), generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()

    def __len__(self) -> int:
        return len(self._items)

    def next_batch(self, n: int) -> list:
        """The next ``n`` records, crossing epoch boundaries as needed."""
        out = []
        for _ in range(n):
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            out.append(self._items[self._order[self.position]])
            self.position += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_records": len(self._items)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if int(state["num_records"]) != len(self._items) or int(state["seed"]) != self.seed:
            raise PromptError(
                f"{self._kind} source state was saved for {state['num_records']} {self._noun} with seed "
                f"{state['seed']}; this source has {len(self._items)} {self._noun} with seed {self.seed}: resume "
                f"with the same {self._kind}s"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._epoch_order(self.epoch)


class PromptSource(RecordCycle):
    """Cycles over prompt ``records`` forever (:class:`RecordCycle`), validated first."""

    _kind = "prompt"

    def __init__(
        self,
        records: Sequence[PromptRecord | Mapping[str, Any] | str],
        *,
        seed: int = 0,
        shuffle: bool = True,
        required_fields: Sequence[str] = (),
    ) -> None:
        self.records = validate_prompts(records, required_fields=required_fields)
        super().__init__(self.records, seed=seed, shuffle=shuffle)


class TaskSource(RecordCycle):
    """Cycles over task records (what an agent environment's ``reset`` takes, e.g. ``{"question",
    "answer"}``) exactly as :class:`PromptSource` cycles over prompts. A task is any mapping; the
    environment reads it."""

    _kind, _noun = "task", "tasks"

    def __init__(self, tasks: Sequence[Mapping[str, Any]], *, seed: int = 0, shuffle: bool = True,
                 required_fields: Sequence[str] = ()) -> None:
        self.tasks = [dict(task) for task in tasks]
        if not self.tasks:
            raise PromptError("no tasks: a task source needs at least one record")
        for i, task in enumerate(self.tasks):
            missing = [f for f in required_fields if f not in task]
            if missing:
                raise PromptError(f"task {i}: missing field(s) {missing} that the environment needs")
        super().__init__(self.tasks, seed=seed, shuffle=shuffle)

    def next_batch(self, n: int) -> list[dict[str, Any]]:
        """The next ``n`` tasks, copies, so an environment that edits its task changes nothing here."""
        return [dict(task) for task in super().next_batch(n)]
