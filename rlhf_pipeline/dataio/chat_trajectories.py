"""One whole trajectory as one JSON line of chat messages and token ids (``export --format chat``).

Format ``rlhf-pipeline/chat-trajectory/v1``: the conversation's ``messages`` (the stored
``turn_messages``, or ``null``), the rewards and endings, and per turn its ``prompt_ids`` (tokens
added before it), ``completion_ids`` / ``completion_logprobs`` as sampled and every other stored
field under its own name, so :func:`trajectory_rows` (``import``) gives the rows back field for
field. Only whole trajectories are written. Spec: docs/agents.md#export-and-import-trajectories-as-chat-messages;
design: docs/architecture.md#rows-in-and-out.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from rlhf_pipeline.schema.termination import TerminationReason
from rlhf_pipeline.schema.turn_messages import (
    decode_turn_messages,
    encode_turn_messages,
)

CHAT_FORMAT = "rlhf-pipeline/chat-trajectory/v1"
# stored field -> its name in a turn (the rest of a turn's stored fields keep their own names)
TURN_NAMES = {"prompt_tokens": "prompt_ids", "response_tokens": "completion_ids",
              "response_log_probs": "completion_logprobs", "prompt_text": "prompt_text",
              "response_text": "completion_text", "reward": "reward", "policy_version": "policy_version",
              "step": "step"}
# stored fields said once per trajectory, at the top of its line
TRAJECTORY_FIELDS = ("trajectory_id", "group_id", "done", "terminated", "truncated", "termination_reason")


class ChatFormatError(ValueError):
    """A chat trajectory line that cannot be turned back into rows; the message names the field."""


# ====================================================================== rows -> lines
@dataclass
class TrajectoryLines:
    """Stored rows (in buffer order) -> one line per whole trajectory, across chunk boundaries."""

    written: int = 0
    skipped: int = 0  # trajectories not held whole (first turns evicted)
    _rows: list[dict[str, Any]] = field(default_factory=list)

    def add(self, rows: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        """The lines of the trajectories these rows complete (a trajectory's rows are contiguous,
        in step order, its ``done`` row last)."""
        for row in rows:
            if self._rows and self._rows[-1]["trajectory_id"] != row["trajectory_id"]:
                self._drop()  # the trajectory before never reached its done row here
            if not self._rows and row["step"] != 0:  # its first turns are not held
                self.skipped += int(row["done"])
                continue
            self._rows.append(row)
            if row["done"]:
                rows_of_one, self._rows = self._rows, []
                self.written += 1
                yield trajectory_line(rows_of_one)

    def finish(self) -> None:
        self._drop()

    def _drop(self) -> None:
        if self._rows:
            self.skipped += 1
            self._rows = []


def trajectory_line(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One trajectory's rows (plain values, stored names, steps 0..n-1) as its chat line."""
    last = rows[-1]
    messages: list[dict[str, Any]] | None = [] if all("turn_messages" in r for r in rows) else None
    turns = []
    for row in rows:
        turn = {"step": row["step"]}
        if messages is not None:
            start = len(messages)
            messages += decode_turn_messages(row["turn_messages"])
            turn["messages"] = [start, len(messages)]
        for name, value in row.items():
            if name in TRAJECTORY_FIELDS or name in ("step", "turn_messages"):
                continue
            turn[TURN_NAMES.get(name, name)] = value
        turns.append(turn)
    rewards = [row["reward"] for row in rows]
    reason = last.get("termination_reason")
    return {
        "format": CHAT_FORMAT, "trajectory_id": last["trajectory_id"], "group_id": last["group_id"],
        "messages": messages, "turn_rewards": rewards, "final_reward": rewards[-1], "return": sum(rewards),
        "done": last["done"], "terminated": last["terminated"], "truncated": last["truncated"],
        "termination_reason": None if reason is None else TerminationReason(reason).name,
        "turns": turns,
    }


# ====================================================================== lines -> rows
def is_chat_line(record: dict[str, Any]) -> bool:
    return record.get("format") == CHAT_FORMAT


def trajectory_rows(line: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat line back to its rows under the stored field names (what a row ``export`` holds), so
    the importer reads them like any exported rows: ids, log-probs, rewards, flags, steps exact."""
    turns = _field(line, "turns", list)
    if not turns:
        raise ChatFormatError("field 'turns' is empty; a trajectory has at least one turn")
    messages = line.get("messages")
    if messages is not None and not isinstance(messages, list):
        raise ChatFormatError("field 'messages' must be a list of messages or null")
    reason = line.get("termination_reason")
    if reason is not None and reason not in TerminationReason.__members__:
        raise ChatFormatError(f"field 'termination_reason' is {reason!r}; the reasons are "
                              f"{list(TerminationReason.__members__)} (or null)")
    from_name = {turn_name: stored for stored, turn_name in TURN_NAMES.items()}
    rows = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise ChatFormatError(f"turns[{k}] must be an object")
        if turn.get("step") != k:
            raise ChatFormatError(f"turns[{k}] has step {turn.get('step')!r}; the turns must be steps 0, 1, 2, ... "
                                  f"in order")
        row = {from_name.get(name, name): value for name, value in turn.items() if name != "messages"}
        last = k == len(turns) - 1
        row.update(trajectory_id=_field(line, "trajectory_id", int), group_id=_field(line, "group_id", int),
                   done=last and _field(line, "done", bool), terminated=last and _field(line, "terminated", bool),
                   truncated=last and _field(line, "truncated", bool))
        if reason is not None:
            row["termination_reason"] = int(TerminationReason[reason]) if last else 0
        if messages is not None:
            span = turn.get("messages")
            if not (isinstance(span, list) and len(span) == 2 and all(isinstance(i, int) for i in span)
                    and 0 <= span[0] <= span[1] <= len(messages)):
                raise ChatFormatError(f"turns[{k}].messages must be [start, stop] within the {len(messages)} "
                                      f"messages, got {span!r}")
            row["turn_messages"] = encode_turn_messages(messages[span[0]:span[1]])
        rows.append(row)
    return rows


def _field(line: dict[str, Any], name: str, kind: type) -> Any:
    value = line.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ChatFormatError(f"field {name!r} must be {kind.__name__}, got {json.dumps(value)[:60]}")
    return value
