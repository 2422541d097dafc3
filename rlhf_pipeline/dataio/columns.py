"""Which source column holds what, and turning a chunk of source rows into stored-row columns.

Why one file: the column mapping of ``import`` (which source column holds what) and turning a chunk
into stored columns are one set of rules per row layout, checked against each other.

Two row layouts, told apart by the completion column: one row per completion, or one row per
prompt with a list of completions (its group); a chat's answer may be the assistant's message. :func:`resolve_columns` picks the columns from the
first record and every record must carry the same ones (:func:`check_columns`); :func:`normalize`
turns one chunk into :class:`ImportRows`, raising a ``SourceError`` naming the file, row and
column of the first bad value. Columns: docs/datasets.md; design: docs/architecture.md#rows-in-and-out.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rlhf_pipeline.dataio.sources import MISSING, SourceChunk, SourceError, lookup
from rlhf_pipeline.schema.ragged import RaggedTensor, lengths_to_offsets
from rlhf_pipeline.schema import FIELDS_BY_NAME, TOKEN_ID_MAX

# slot -> column names looked for when no option names one (stored field names first, so an
# export imports back with no options)
CANDIDATES: dict[str, tuple[str, ...]] = {
    "prompt": ("prompt_text", "prompt"),
    "messages": ("messages",),
    "prompt_ids": ("prompt_tokens", "prompt_token_ids", "prompt_ids"),
    "completion": ("response_text", "completion", "response", "completions", "responses"),
    "completion_ids": ("response_tokens", "completion_token_ids", "completion_ids", "token_ids"),
    "reward": ("reward", "rewards"),
    "group": ("group_id",),
    "log_probs": ("response_log_probs", "log_probs", "logprobs"),
    "version": ("policy_version",),
}
OPTION_OF_SLOT = {"prompt": "--prompt", "messages": "--messages", "prompt_ids": "--prompt-ids",
                  "completion": "--completion", "completion_ids": "--completion-ids", "reward": "--reward",
                  "group": "--group", "log_probs": "--log-probs", "version": "--version"}
# stored fields a source may carry as is, under their own names
PASSTHROUGH_FIELDS = ("trajectory_id", "step", "done", "terminated", "truncated",
                      "advantage", "step_advantage", "ref_log_probs", "kl", "token_rewards", "termination_reason",
                      "tool_calls", "tool_errors", "tool_error_kinds", "turn_messages")


@dataclass(frozen=True)
class ColumnMap:
    """Source columns by role; None looks for the names in ``CANDIDATES``. Dotted paths reach into
    nested records (``outputs.0.token_ids``)."""

    prompt: str | None = None
    messages: str | None = None
    prompt_ids: str | None = None
    completion: str | None = None
    completion_ids: str | None = None
    reward: str | None = None
    group: str | None = None
    log_probs: str | None = None
    version: str | None = None
    ignore: tuple[str, ...] = ()
    """Columns not to read even when their names say what they hold."""
    append_eos: bool = True
    """Text completions end with the tokenizer's EOS (they were complete answers); False stores
    them without it, as truncated."""
    check_text: bool = True
    """Where token ids and text are both given, the ids must decode to the text."""

    def to_json(self) -> dict:
        out = {k: getattr(self, k) for k in OPTION_OF_SLOT}
        return {**out, "ignore": list(self.ignore), "append_eos": self.append_eos, "check_text": self.check_text}


@dataclass(frozen=True)
class ResolvedColumns:
    """The columns an import reads, found in the source's first record."""

    slots: Mapping[str, str]  # slot -> column
    passthrough: Mapping[str, str]  # stored field -> column
    per_prompt: bool  # one row per prompt with a list of completions
    group_ids_given: bool  # the group column holds integer ids (kept as group_id)
    options: ColumnMap
    first_columns: frozenset[str]  # the first record's (top-level) columns
    first_record: str  # where the first record is, for errors
    # the column of the prompt's chat messages: `messages`, or a `prompt` column holding messages
    messages_column: str | None = None
    # where a completion's text is when it is a chat message: "message" (the completion column holds one
    # assistant message), "last message" (the last of the prompt's messages: the conversation ends with
    # the answer), None (text or token ids)
    answer_message: str | None = None

    @property
    def given_fields(self) -> tuple[str, ...]:
        """Stored fields taken from the source as they are (not computed by the import)."""
        given = set(self.passthrough)
        if "log_probs" in self.slots:
            given.add("response_log_probs")
        if "version" in self.slots:
            given.add("policy_version")
        if self.group_ids_given:
            given.add("group_id")
        return tuple(f for f in FIELDS_BY_NAME if f in given)

    def column_of_field(self, name: str) -> str:
        """The source column a stored field comes from (for error messages)."""
        slot = {"prompt_tokens": "prompt_ids", "response_tokens": "completion_ids", "response_log_probs": "log_probs",
                "reward": "reward", "group_id": "group", "policy_version": "version", "prompt_text": "prompt",
                "response_text": "completion"}.get(name)
        if name in self.passthrough:
            return self.passthrough[name]
        if slot == "prompt_ids" and slot not in self.slots:
            slot = "messages" if "messages" in self.slots else "prompt"
        if slot == "completion_ids" and slot not in self.slots:
            slot = "completion"
        if slot == "completion" and self.answer_message == "last message":
            return self.messages_column or name
        return self.slots.get(slot, name) if slot else name

    def describe(self, chat_trajectories: bool = False) -> str:
        """What the import reads, for its first log line. ``chat_trajectories``: the source is
        ``export --format chat`` lines, read as the rows of their turns (whose columns are not the file's)."""
        if chat_trajectories:
            return "whole trajectories as chat messages (export --format chat): one row per model turn, as stored"
        parts = [f"{slot}={col!r}" for slot, col in self.slots.items()]
        if self.messages_column is not None and "messages" not in self.slots:
            parts[list(self.slots).index("prompt")] = f"messages={self.messages_column!r}"
        if self.answer_message == "last message":
            parts.append(f"completion=the last message of {self.messages_column!r}")
        elif self.answer_message == "message":
            parts[list(self.slots).index("completion")] = f"completion=the message of {self.slots['completion']!r}"
        parts += [f"{f}={col!r}" for f, col in self.passthrough.items()]
        layout = "one row per prompt (a list of completions)" if self.per_prompt else "one row per completion"
        return f"{layout}; columns: {', '.join(parts)}"


def resolve_columns(record: Mapping[str, Any], options: ColumnMap, where: str) -> ResolvedColumns:
    """Chooses the columns from the first record; errors name the missing role and its option.

    Every record must carry the columns chosen here (:func:`check_columns` refuses a later record
    with a column this choice would have read, had the first record carried it)."""
    def present(column: str) -> bool:
        return column not in options.ignore and lookup(record, column) is not MISSING

    for slot in CANDIDATES:
        chosen = getattr(options, slot)
        if chosen is not None and not present(chosen):
            raise SourceError(f"{where}: column {chosen!r} (given with {OPTION_OF_SLOT[slot]}) is missing; "
                              f"the record has {sorted(record)}")
    slots, passthrough = _choose(present, options)
    if not {"prompt", "messages", "prompt_ids"} & set(slots):
        raise SourceError(f"{where}: no prompt column; name one with --prompt (text), --messages (chat) or "
                          f"--prompt-ids (token ids). The record has {sorted(record)}")
    messages_column = slots.get("messages")
    if messages_column is None and "prompt" in slots and _is_chat(lookup(record, slots["prompt"])):
        messages_column = slots["prompt"]  # TRL's conversational rows: the prompt's messages
    answer_message = None
    if not {"completion", "completion_ids"} & set(slots):
        conversation = lookup(record, messages_column) if messages_column is not None else None
        if not (_is_chat(conversation) and conversation[-1]["role"] == "assistant"):
            raise SourceError(f"{where}: no completion column; name one with --completion (text) or "
                              f"--completion-ids (token ids), or end each record's messages with the assistant's "
                              f"answer. The record has {sorted(record)}")
        answer_message = "last message"
    elif "completion_ids" not in slots and _is_chat(lookup(record, slots["completion"])):
        answer_message = "message"
    if "reward" not in slots:
        raise SourceError(f"{where}: no reward column; name it with --reward. The record has {sorted(record)}")
    if "completion_ids" in slots:
        completion = lookup(record, slots["completion_ids"])
        per_prompt = isinstance(completion, list) and bool(completion) and isinstance(completion[0], list)
    else:  # an answer given as a message is one completion per row
        per_prompt = answer_message is None and isinstance(lookup(record, slots["completion"]), list)
    group_ids_given = "group" in slots and isinstance(lookup(record, slots["group"]), int)
    return ResolvedColumns(slots, passthrough, per_prompt, group_ids_given, options, frozenset(record), where,
                           messages_column, answer_message)


def _is_chat(value: Any) -> bool:
    """``value`` is a non-empty list of chat messages (``{"role": ..., "content": ...}``), as a record's
    first value is told apart from text, or from a list of completions."""
    return (isinstance(value, list) and bool(value)
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in value))


def _choose(present: Callable[[str], bool], options: ColumnMap) -> tuple[dict[str, str], dict[str, str]]:
    """``(slot -> column, stored field -> column)`` read from a record holding the columns ``present`` says."""
    slots: dict[str, str] = {}
    for slot, candidates in CANDIDATES.items():
        chosen = getattr(options, slot)
        found = chosen if chosen is not None else next((c for c in candidates if present(c)), None)
        if found is not None:
            slots[slot] = found
    if "messages" in slots and "prompt" in slots and options.prompt is None:
        del slots["prompt"]  # a chat prompt: the text is the rendered template
    return slots, {f: f for f in PASSTHROUGH_FIELDS if present(f)}


def check_columns(chunk: SourceChunk, resolved: ResolvedColumns) -> None:
    """Refuses a record carrying a column the import would read had the first record carried it.

    The columns are chosen from the first record, so such a column would be dropped from every
    record without a word (given log-probs replaced by computed ones, bad values never checked).
    A column the first record has and a later one lacks is refused where its values are read."""
    if chunk.records is not None:
        columns = set().union(*chunk.records)
    else:
        columns = set(chunk.table.schema.names)
    options = resolved.options
    for column in sorted(columns - resolved.first_columns - set(options.ignore)):
        read = resolved.first_columns | {column}
        slots, passthrough = _choose(lambda c: c in read and c not in options.ignore, options)  # noqa: B023
        if slots == dict(resolved.slots) and passthrough == dict(resolved.passthrough):
            continue  # a column the import would not read anyway
        row = 0 if chunk.records is None else next(i for i, r in enumerate(chunk.records) if column in r)
        raise SourceError(
            f"{chunk.where(row)}: column {column!r} is missing from {resolved.first_record}, which decides "
            f"the columns an import reads, so it would be dropped from every record; give it on "
            f"every record, or leave it out with --ignore-column {column}")


# ====================================================================== normalized rows
@dataclass
class ImportRows:
    """One chunk as stored-row columns (N completions) plus where each came from."""

    columns: dict[str, Any]  # field -> RaggedTensor / (N,) tensor / list[str]
    group_key: np.ndarray  # (N,) uint64: completions with equal keys form one group
    source_row: np.ndarray  # (N,) int64: row of the chunk each completion came from
    completion_index: np.ndarray | None  # (N,) int64 in the one-row-per-prompt layout
    chunk: SourceChunk
    resolved: ResolvedColumns = field(repr=False)

    def __len__(self) -> int:
        return len(self.source_row)

    def where(self, i: int) -> str:
        """Location of completion ``i``: file and line/row, and the completion's index in its row."""
        out = self.chunk.where(int(self.source_row[i]))
        if self.completion_index is not None:
            out += f", completion {int(self.completion_index[i])}"
        return out


class _Errors:
    """Builds SourceErrors for one chunk: ``fail(i, column, message)``."""

    def __init__(self, chunk: SourceChunk, completion_index: np.ndarray | None = None,
                 source_row: np.ndarray | None = None) -> None:
        self.chunk, self.completion_index, self.source_row = chunk, completion_index, source_row

    def fail(self, i: int, column: str, message: str, *, expanded: bool = False):
        row, where_extra = i, ""
        if expanded and self.source_row is not None:
            row = int(self.source_row[i])
            if self.completion_index is not None:
                where_extra = f", completion {int(self.completion_index[i])}"
        raise SourceError(f"{self.chunk.where(row)}{where_extra}, column {column!r}: {message}")


def normalize(chunk: SourceChunk, resolved: ResolvedColumns, tokenizer: Any) -> ImportRows:
    """Stored-row columns of ``chunk`` (token ids, texts, rewards, given fields); checks every value."""
    check_columns(chunk, resolved)
    slots = resolved.slots
    errors = _Errors(chunk)
    n_rows = len(chunk)

    # ---- how many completions each row holds
    completion_col = slots.get("completion_ids", slots.get("completion"))
    if resolved.per_prompt:
        lists = chunk.values(completion_col)
        counts = np.empty(n_rows, dtype=np.int64)
        for i, v in enumerate(lists):
            if not isinstance(v, list) or not v:
                errors.fail(i, completion_col, "expected a non-empty list of completions (one row per prompt)")
            counts[i] = len(v)
    else:
        counts = np.ones(n_rows, dtype=np.int64)
    source_row = np.repeat(np.arange(n_rows, dtype=np.int64), counts)
    completion_index = (np.arange(len(source_row)) - np.repeat(np.cumsum(counts) - counts, counts)
                        if resolved.per_prompt else None)
    errors = _Errors(chunk, completion_index, source_row)

    def per_completion(column: str, *, scalar_ok: bool = False) -> list[Any]:
        """One value per completion: rows of the per-prompt layout hold a list of ``counts[i]``."""
        values = chunk.values(column)
        if not resolved.per_prompt:
            return values
        out: list[Any] = []
        for i, v in enumerate(values):
            if isinstance(v, list) and len(v) == counts[i]:
                out.extend(v)
            elif scalar_ok and not isinstance(v, list):
                out.extend([v] * int(counts[i]))
            else:
                got = f"a list of {len(v)}" if isinstance(v, list) else type(v).__name__ if v is not MISSING else "nothing"
                errors.fail(i, column, f"expected a list of {counts[i]} values (one per completion), got {got}")
        return out

    def per_prompt_value(column: str) -> list[Any]:
        """A prompt-level column, repeated for each completion of its row."""
        values = chunk.values(column)
        return [values[i] for i in source_row]

    columns: dict[str, Any] = {}
    # ---- prompt
    prompt_ids, prompt_text = _prompts(chunk, resolved, tokenizer, errors, source_row)
    columns["prompt_tokens"], columns["prompt_text"] = prompt_ids, prompt_text
    # ---- completion
    response, response_text, ends_on_eos = _completions(chunk, resolved, tokenizer, errors, per_completion)
    columns["response_tokens"], columns["response_text"] = response, response_text
    n = len(source_row)
    # ---- reward, log-probs, version
    columns["reward"] = _floats(per_completion(slots["reward"]), slots["reward"], errors)
    if "log_probs" in slots:
        log_probs = _ragged(chunk, slots["log_probs"], per_completion, errors, torch.float32,
                            allow_dicts=True, flat_ok=not resolved.per_prompt)
        _check_aligned(log_probs, response, slots["log_probs"], errors, resolved.options.append_eos
                       and "completion_ids" not in slots)
        columns["response_log_probs"] = log_probs
    if "version" in slots:
        columns["policy_version"] = _ints(per_completion(slots["version"], scalar_ok=True), slots["version"], errors,
                                          minimum=0)
    # ---- ends and steps: given, or single-turn rows that ended on EOS or a limit
    for name, column in resolved.passthrough.items():
        spec = FIELDS_BY_NAME[name]
        if spec.kind == "token":
            columns[name] = _ragged(chunk, column, per_completion, errors, spec.dtype, flat_ok=not resolved.per_prompt)
        elif spec.kind == "text":
            columns[name] = _strings(per_completion(column, scalar_ok=True), column, errors, name, expanded=True)
        elif spec.dtype == torch.bool:
            columns[name] = _bools(per_completion(column, scalar_ok=True), column, errors)
        elif spec.dtype == torch.float32:
            columns[name] = _floats(per_completion(column, scalar_ok=True), column, errors)
        else:
            columns[name] = _ints(per_completion(column, scalar_ok=True), column, errors, minimum=0).to(spec.dtype)
    terminated = columns.setdefault("terminated", torch.as_tensor(ends_on_eos, dtype=torch.bool))
    columns.setdefault("truncated", ~terminated)
    columns.setdefault("done", columns["terminated"] | columns["truncated"])
    columns.setdefault("step", torch.zeros(n, dtype=torch.int32))

    # ---- groups
    group_key = _group_keys(chunk, resolved, errors, per_prompt_value, columns, source_row)
    if resolved.group_ids_given:
        columns["group_id"] = torch.from_numpy(group_key.view(np.int64).copy())
    return ImportRows(columns, group_key, source_row, completion_index, chunk, resolved)


# ====================================================================== prompts
def _prompts(chunk, resolved, tokenizer, errors, source_row) -> tuple[RaggedTensor, list[str]]:
    from rlhf_pipeline.collect.prompts import PromptRecord

    slots, n_rows = resolved.slots, len(chunk)
    texts: list[str | None] = [None] * n_rows
    ids: RaggedTensor | None = None
    if "prompt_ids" in slots:
        ids = _ragged(chunk, slots["prompt_ids"], chunk.values, errors, torch.int32, flat_ok=True, expanded=False)
        _check_ids(ids, slots["prompt_ids"], errors, tokenizer, "prompt")
    if resolved.messages_column is not None:
        column = resolved.messages_column
        records = []
        for i, messages in enumerate(chunk.values(column)):
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages):
                errors.fail(i, column, "expected a non-empty list of {role, content} messages")
            if resolved.answer_message == "last message":  # the answer is the completion, the rest the prompt
                if messages[-1]["role"] != "assistant":
                    errors.fail(i, column, f"expected the assistant's answer as the last message (it is the "
                                           f"completion, as in {resolved.first_record}), got a {messages[-1]['role']!r} "
                                           f"message")
                if len(messages) == 1:
                    errors.fail(i, column, "the assistant's answer is the only message: no prompt comes before it")
                messages = messages[:-1]
            for m in messages:
                _check_text(m["role"], i, column, errors)
                _check_text(m["content"], i, column, errors)
            records.append(PromptRecord(messages=tuple({"role": m["role"], "content": m["content"]} for m in messages)))
        _need_tokenizer(tokenizer, "render chat messages")
        texts, rendered = [], []
        for i, r in enumerate(records):  # one at a time, so a failure names its record
            try:
                texts.append(r.display_text(tokenizer))
                if ids is None:
                    rendered.append(r.render(tokenizer))
            # the template is the tokenizer's code run on this record's messages: whatever it raises (a
            # jinja2 TemplateError for a role it rejects, a ValueError...) is this record's fault
            except Exception as exc:  # noqa: BLE001
                errors.fail(i, column, f"the tokenizer's chat template failed: {exc}")
        if ids is None:
            ids = RaggedTensor.from_sequences(rendered, dtype=torch.int32)
    elif "prompt" in slots:
        column = slots["prompt"]
        texts = _strings(chunk.values(column), column, errors, "prompt")
        if ids is None:
            _need_tokenizer(tokenizer, "tokenize prompt text")
            ids = RaggedTensor.from_sequences(tokenizer(texts, add_special_tokens=False)["input_ids"], dtype=torch.int32)
    if ids is None:  # token ids only: the text is what they decode to
        raise AssertionError("resolve_columns guarantees a prompt column")
    lengths = ids.lengths()
    if bool((lengths == 0).any()):
        i = int(torch.nonzero(lengths == 0)[0])
        errors.fail(i, slots.get("prompt_ids", slots.get("messages", slots.get("prompt"))),
                    "empty prompt: it tokenizes to no tokens")
    if "prompt_ids" in slots:
        if tokenizer is not None:
            decoded = tokenizer.batch_decode(ids.to_list(), skip_special_tokens=False)
            if all(t is None for t in texts):
                texts = decoded
            elif resolved.options.check_text:
                _check_decoded(decoded, texts, slots["prompt_ids"], errors)
        elif any(t is None for t in texts):
            _need_tokenizer(tokenizer, "decode prompt token ids to text")
    index = torch.from_numpy(source_row)
    return ids.index(index), [texts[i] for i in source_row.tolist()]


# ====================================================================== completions
def _completions(chunk, resolved, tokenizer, errors, per_completion) -> tuple[RaggedTensor, list[str], np.ndarray]:
    slots = resolved.slots
    texts: list[str] | None = None
    if resolved.answer_message is not None:
        texts = _answers(chunk, resolved, errors)
    elif "completion" in slots:
        texts = _strings(per_completion(slots["completion"]), slots["completion"], errors, "completion", expanded=True)
    eos = getattr(tokenizer, "eos_token_id", None)
    if "completion_ids" in slots:
        column = slots["completion_ids"]
        ids = _ragged(chunk, column, per_completion, errors, torch.int32, flat_ok=not resolved.per_prompt)
        _check_ids(ids, column, errors, tokenizer, "completion", expanded=True)
        lengths = ids.lengths()
        if bool((lengths == 0).any()):
            errors.fail(int(torch.nonzero(lengths == 0)[0]), column, "empty completion (no token ids)", expanded=True)
        if tokenizer is not None:
            decoded = tokenizer.batch_decode(ids.to_list(), skip_special_tokens=True)
            if texts is None:
                texts = decoded
            elif resolved.options.check_text:
                kept = None
                if any(t is not None and t != d for t, d in zip(texts, decoded)):
                    # agents' rows store a turn's text with its special tokens (the stop token) kept
                    kept = tokenizer.batch_decode(ids.to_list(), skip_special_tokens=False)
                _check_decoded(decoded, texts, column, errors, expanded=True, or_decoded=kept)
        elif texts is None:
            _need_tokenizer(tokenizer, "decode completion token ids to text")
        last = ids.values[ids.offsets[1:] - 1]
        ends_on_eos = (last == eos).numpy() if eos is not None else np.zeros(len(ids), dtype=bool)
        return ids, texts, ends_on_eos
    _need_tokenizer(tokenizer, "tokenize completion text")
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    append = resolved.options.append_eos
    if append and eos is None:
        raise SourceError("the tokenizer has no EOS token to end completions with; pass --no-eos")
    sequences = [list(t) + [eos] if append else list(t) for t in encoded]
    empty = next((i for i, t in enumerate(sequences) if not t), None)
    if empty is not None:
        errors.fail(empty, slots["completion"], "empty completion: it tokenizes to no tokens (with --no-eos, "
                                                "an empty text has no EOS either)", expanded=True)
    ids = RaggedTensor.from_sequences(sequences, dtype=torch.int32)
    return ids, texts, np.full(len(sequences), append, dtype=bool)


def _answers(chunk, resolved, errors) -> list[str]:
    """The completions given as the assistant's message: the last of the prompt's messages (checked with
    the prompt), or a completion column's one message."""
    if resolved.answer_message == "last message":
        return [messages[-1]["content"] for messages in chunk.values(resolved.messages_column)]
    column = resolved.slots["completion"]
    texts = []
    for i, value in enumerate(chunk.values(column)):
        if not (_is_chat(value) and len(value) == 1 and value[0]["role"] == "assistant"
                and isinstance(value[0]["content"], str)):
            errors.fail(i, column, f"expected the completion as one assistant message, as in {resolved.first_record} "
                                   f"([{{\"role\": \"assistant\", \"content\": \"...\"}}]), got {_short(repr(value))}")
        _check_text(value[0]["content"], i, column, errors)
        texts.append(value[0]["content"])
    return texts


# ====================================================================== groups
def _group_keys(chunk, resolved, errors, per_prompt_value, columns, source_row) -> np.ndarray:
    """(N,) uint64 group key per completion: the given id, a hash of the given key, the source
    row (one row per prompt), or a hash of the prompt's token ids (completions of one prompt)."""
    n = len(source_row)
    if "group" in resolved.slots:
        column = resolved.slots["group"]
        keys = np.empty(n, dtype=np.uint64)
        values = per_prompt_value(column) if resolved.per_prompt else chunk.values(column)
        for i, v in enumerate(values):
            if v is MISSING or v is None:
                errors.fail(i, column, _missing(v), expanded=True)
            if resolved.group_ids_given:
                if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 2**63:
                    errors.fail(i, column, f"expected an integer group id in [0, 2**63) like the first row's, got {v!r}",
                                expanded=True)
                keys[i] = v
            elif isinstance(v, (str, int)) and not isinstance(v, bool):
                if isinstance(v, str):
                    _check_text(v, i, column, errors, expanded=True)
                keys[i] = _hash(f"{type(v).__name__}:{v}".encode())
            else:
                errors.fail(i, column, f"expected a group key (string or integer), got {v!r}", expanded=True)
        return keys
    if resolved.per_prompt:
        return (chunk.ordinal + source_row).astype(np.uint64)
    prompts = columns["prompt_tokens"]
    values = prompts.values.numpy()
    offsets = prompts.offsets.numpy()
    return np.fromiter((_hash(values[offsets[i]:offsets[i + 1]].tobytes()) for i in range(n)), dtype=np.uint64, count=n)


def _hash(data: bytes) -> int:
    # 64-bit keys: two different prompts share one with probability ~n^2 / 2^65
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


# ====================================================================== values
def _need_tokenizer(tokenizer: Any, what: str) -> None:
    if tokenizer is None:
        raise SourceError(f"the import needs the pipeline's tokenizer to {what}, but the pipeline sets no "
                          f"`tokenizer`; set it in build(), or give token ids in the source")


def _strings(values: Sequence[Any], column: str, errors: _Errors, what: str, *, expanded: bool = False) -> list[str]:
    for i, v in enumerate(values):
        if v is MISSING or v is None:
            errors.fail(i, column, _missing(v), expanded=expanded)
        if not isinstance(v, str):
            errors.fail(i, column, f"expected the {what} as a string, got {type(v).__name__}", expanded=expanded)
        _check_text(v, i, column, errors, expanded=expanded)
    # an empty text is no error by itself: the door's rule is on tokens (a completion that is only
    # EOS is a real sample, stored with response_text ""); the token checks name empty rows
    return list(values)


def _missing(value: Any) -> str:
    if value is MISSING:  # the first record has the column (it was chosen from it): every record needs it
        return "missing (the first record has this column, and every record needs the columns an import reads)"
    return "missing"


def _check_text(text: str, i: int, column: str, errors: _Errors, *, expanded: bool = False) -> None:
    """Refuses a lone surrogate (a JSON ``\\ud800`` escape without its pair): not text that
    a tokenizer or a store can encode."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        errors.fail(i, column, f"holds a lone surrogate ({text[exc.start]!r} at character {exc.start}), half of a "
                               f"UTF-16 pair and not text; fix or drop the record", expanded=expanded)


def _floats(values: Sequence[Any], column: str, errors: _Errors) -> torch.Tensor:
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            errors.fail(i, column, _missing(v) if v is MISSING or v is None else f"expected a number, got {v!r}",
                        expanded=True)
        if not math.isfinite(v):
            errors.fail(i, column, f"{v} is not finite; store a finite value (e.g. 0 for a failed completion)",
                        expanded=True)
    return torch.tensor(values, dtype=torch.float64).to(torch.float32)


def _ints(values: Sequence[Any], column: str, errors: _Errors, *, minimum: int) -> torch.Tensor:
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum or v >= 2**63:
            errors.fail(i, column, _missing(v) if v is MISSING or v is None else
                        f"expected an integer >= {minimum}, got {v!r}", expanded=True)
    return torch.tensor(values, dtype=torch.int64)


def _bools(values: Sequence[Any], column: str, errors: _Errors) -> torch.Tensor:
    for i, v in enumerate(values):
        if not isinstance(v, bool):
            errors.fail(i, column, _missing(v) if v is MISSING or v is None else f"expected true/false, got {v!r}",
                        expanded=True)
    return torch.tensor(values, dtype=torch.bool)


def _ragged(chunk: SourceChunk, column: str, per_completion, errors: _Errors, dtype: torch.dtype, *,
            allow_dicts: bool = False, flat_ok: bool = False, expanded: bool = True) -> RaggedTensor:
    """A list-of-numbers column as a RaggedTensor; Arrow lists go through without Python objects.

    ``expanded``: one entry per completion (else one per source row, as prompts are).
    """
    if flat_ok:
        fast = chunk.list_column(column)
        if fast is not None:
            offsets, values = fast
            if dtype == torch.int32 and values.dtype.kind not in "iu":
                errors.fail(0, column, f"expected integer token ids, got {values.dtype} values")
            if dtype == torch.int32 and values.size and (values.min() < 0 or values.max() > TOKEN_ID_MAX):
                bad = int(np.searchsorted(offsets, int(np.argmax((values < 0) | (values > TOKEN_ID_MAX))), "right")) - 1
                errors.fail(bad, column, f"token id outside [0, {TOKEN_ID_MAX}]")
            # a copy: Arrow buffers are read-only, and a chunk's tensors may be edited downstream
            tensor = torch.from_numpy(np.array(values, dtype=_NUMPY[dtype]))
            return RaggedTensor(tensor, torch.from_numpy(offsets))
    values = per_completion(column)
    lengths = np.empty(len(values), dtype=np.int64)
    flat: list[Any] = []
    for i, v in enumerate(values):
        if not isinstance(v, list):
            errors.fail(i, column, _missing(v) if v is MISSING or v is None else
                        f"expected a list of numbers, got {type(v).__name__}", expanded=expanded)
        if allow_dicts and v and isinstance(v[0], dict):  # [{"token": ..., "logprob": -0.1}, ...]
            v = [d.get("logprob", MISSING) if isinstance(d, dict) else d for d in v]
        lengths[i] = len(v)
        flat.extend(v)
    array = np.asarray(flat) if flat else np.zeros(0, dtype=_NUMPY[dtype])
    wanted = "iu" if dtype == torch.int32 else "iuf"
    if array.dtype.kind not in wanted or (dtype == torch.int32 and array.size and
                                          (array.min() < 0 or array.max() > TOKEN_ID_MAX)):
        offsets = lengths_to_offsets(torch.from_numpy(lengths)).numpy()
        for i in range(len(values)):
            for x in flat[offsets[i]:offsets[i + 1]]:
                if dtype == torch.int32 and (isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= TOKEN_ID_MAX):
                    errors.fail(i, column, f"expected token ids in [0, {TOKEN_ID_MAX}], found {x!r}", expanded=expanded)
                if dtype != torch.int32 and (isinstance(x, bool) or not isinstance(x, (int, float))):
                    errors.fail(i, column, f"expected numbers, found {x!r}", expanded=expanded)
    tensor = torch.from_numpy(array.astype(_NUMPY[dtype]))
    return RaggedTensor.from_lengths(tensor, torch.from_numpy(lengths))


_NUMPY = {torch.int32: np.int32, torch.float32: np.float32, torch.int64: np.int64}


def _check_ids(ids: RaggedTensor, column: str, errors: _Errors, tokenizer: Any, what: str, *,
               expanded: bool = False) -> None:
    """Token ids the model cannot embed would fail deep inside it; catch them with their row."""
    if tokenizer is None or not ids.values.numel():
        return
    vocab = len(tokenizer)
    too_big = ids.values >= vocab
    if bool(too_big.any()):
        pos = int(torch.nonzero(too_big)[0])
        row = int(torch.searchsorted(ids.offsets, pos, right=True)) - 1
        errors.fail(row, column, f"{what} token id {int(ids.values[pos])} is outside the tokenizer's vocabulary "
                                 f"({vocab} tokens): were these ids made by another tokenizer?", expanded=expanded)


def _check_decoded(decoded: Sequence[str], texts: Sequence[str | None], column: str, errors: _Errors, *,
                   expanded: bool = False, or_decoded: Sequence[str] | None = None) -> None:
    for i, (got, want) in enumerate(zip(decoded, texts)):
        if want is not None and got != want and (or_decoded is None or or_decoded[i] != want):
            errors.fail(i, column, f"the token ids decode to {_short(got)} but the text column holds {_short(want)}; "
                                   f"were they made by another tokenizer? (--no-text-check skips this check)",
                        expanded=expanded)


def _check_aligned(log_probs: RaggedTensor, response: RaggedTensor, column: str, errors: _Errors,
                   eos_appended: bool) -> None:
    got, want = log_probs.lengths(), response.lengths()
    bad = torch.nonzero(got != want)
    if bad.numel():
        i = int(bad[0])
        hint = (" (the completion text was tokenized and EOS appended; pass --no-eos if the log-probs do not "
                "cover an EOS token)") if eos_appended else ""
        errors.fail(i, column, f"{int(got[i])} log-probs for a completion of {int(want[i])} tokens; expected one "
                               f"per completion token{hint}", expanded=True)


def _short(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def chat_template_warning(resolved: ResolvedColumns, tokenizer: Any) -> str | None:
    """A warning when rows give their prompt as plain text to a pipeline whose tokenizer has a chat
    template: the text is stored as given, while the pipeline's collector renders every prompt
    through the template, so such rows train (and score) the model on prompts it never sees. Not
    when the prompt's token ids are given too (an export of a buffer, logged traffic): the ids are
    what is stored and trained, and the text only has to match them."""
    if "prompt" not in resolved.slots or "prompt_ids" in resolved.slots or resolved.messages_column is not None:
        return None
    if not getattr(tokenizer, "chat_template", None):
        return None
    return (f"[import] warning: column {resolved.slots['prompt']!r} is plain prompt text, stored as given, but the "
            f"pipeline's tokenizer has a chat template, which its collector applies to every prompt: give the "
            f"prompt as chat messages (--messages COLUMN, e.g. {{\"messages\": [{{\"role\": \"user\", "
            f"\"content\": \"...\"}}]}}) unless the text is already rendered with that template")

