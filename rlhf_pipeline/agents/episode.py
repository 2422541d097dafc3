"""One multi-turn episode as a token list: sampled ids verbatim, environment turns as the template
renders them, a loss mask, the limits, and the rows it is stored as (one per model turn).

The token list is the source of truth; nothing sampled is re-tokenized. Design:
docs/architecture.md#episodes-are-token-lists.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlhf_pipeline.agents.environment import Message, ModelTurn, StepResult, ToolCall, reward_value
from rlhf_pipeline.schema import TerminationReason, TrajectoryBatch
from rlhf_pipeline.schema.tool_errors import ToolErrorKind
from rlhf_pipeline.schema.turn_messages import encode_turn_messages

AGENT_ROW_FIELDS = ("tool_calls", "tool_errors", "tool_error_kinds", "turn_messages")
"""Optional stored fields an episode can fill on each of its rows: the turn's tool calls, how many
of them failed and how (``schema/tool_errors.py``), and its chat messages (``schema/turn_messages.py``)."""


@dataclass(frozen=True)
class EpisodeLimits:
    """Where an episode stops, whatever its environment says."""

    max_turns: int = 8
    """Model turns at most; the episode ends after the last (``MAX_TURNS``)."""
    max_new_tokens: int = 256
    """Sampled tokens per turn at most; a turn cut there ends the episode (``GENERATION_LENGTH``)
    unless ``end_on_cut_turn`` is False."""
    token_budget: int | None = None
    """Tokens of the whole trajectory at most (prompt, environment and sampled: ``TOKEN_BUDGET``)."""
    context_length: int | None = None
    """The model's context: the token list plus a turn's new tokens never exceed it (``CONTEXT_FULL``)."""
    end_on_cut_turn: bool = True
    """False hands a turn cut at ``max_new_tokens`` to the environment like any other (with
    ``ModelTurn.finished`` False; the template closes the message)."""

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_new_tokens < 1:
            raise ValueError("max_turns and max_new_tokens must be >= 1")
        for name in ("token_budget", "context_length"):
            value = getattr(self, name)
            if value is not None and value < 2:
                raise ValueError(f"{name} must be >= 2 or None, got {value}")


@dataclass(frozen=True)
class Segment:
    """A run of the token list: the environment's (or the opening prompt's) or one sampled turn."""

    ids: tuple[int, ...]
    text: str
    sampled: bool
    log_probs: tuple[float, ...] = ()  # sampled segments only


class Episode:
    """One episode's token list and conversation, advanced turn by turn.

    ``render`` is the chat template: ``tokenizer.apply_chat_template`` with ``tools`` and
    ``template_kwargs``; ``stop_token_ids`` are the ids that end a model turn (default: the
    tokenizer's EOS). ``parser`` finds tool calls in the model's text (:mod:`.tools`).
    """

    def __init__(self, tokenizer, messages: Sequence[Message], *, limits: EpisodeLimits = EpisodeLimits(),
                 tools: Sequence[Mapping[str, Any]] | None = None,
                 parser: Callable[[str], list[ToolCall]] | None = None,
                 stop_token_ids: Collection[int] | None = None, check_drift: bool = True,
                 template_kwargs: Mapping[str, Any] | None = None):
        self.tokenizer = tokenizer
        self.limits = limits
        self.tools = list(tools) if tools else None
        self.parser = parser
        self.stop_token_ids = frozenset(stop_token_ids if stop_token_ids is not None else [tokenizer.eos_token_id])
        self.check_drift = check_drift
        self.template_kwargs = dict(template_kwargs or {})
        self.messages: list[Message] = [dict(m) for m in messages]
        self.segments: list[Segment] = []
        self.rewards: list[float] = []  # one per model turn
        self.tool_calls: list[int] = []  # one per model turn: the calls it wrote
        self.tool_errors: list[int] = []  # one per model turn: of those, the ones answered with an error
        self.tool_error_kinds: list[int] = []  # one per model turn: a ToolErrorKind bit set
        self.turn_messages: list[list[Message]] = []  # one per model turn: the messages before it, then its own
        self._messages_told = 0  # messages already given to a turn's turn_messages
        self.turns: list[ModelTurn] = []
        self.reason: TerminationReason | None = None
        self.metrics: Counter[str] = Counter(template_mismatch=0, retokenization_drift=0)
        self._ids: list[int] = []
        self._text = ""  # what the model saw and sampled, as text: the template's rendering should begin with it
        self._cut_reason: TerminationReason | None = None
        text = self.render(self.messages, add_generation_prompt=True)
        self._append(Segment(tuple(self.encode(text)), text, sampled=False))
        if self.max_new_tokens() < 1:
            raise ValueError(f"the opening prompt ({len(self._ids)} tokens) leaves no room for a turn "
                             f"within {limits}")

    # ---------------------------------------------------------------- the token list
    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    @property
    def loss_mask(self) -> list[int]:
        """1 on sampled tokens, 0 on everything the template or the environment wrote."""
        return [int(s.sampled) for s in self.segments for _ in s.ids]

    @property
    def done(self) -> bool:
        return self.reason is not None

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(list(messages), tools=self.tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  **self.template_kwargs)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def max_new_tokens(self) -> int:
        """This turn's limit: the per-turn limit, or less where the budget or context runs out."""
        room = [self.limits.max_new_tokens]
        for limit in (self.limits.token_budget, self.limits.context_length):
            if limit is not None:
                room.append(limit - len(self._ids))
        return min(room)

    # ---------------------------------------------------------------- a turn
    def add_turn(self, sampled_ids: Sequence[int], log_probs: Sequence[float]) -> ModelTurn:
        """Records the model's turn as sampled, and returns it as the environment sees it."""
        if self.done:
            raise RuntimeError(f"the episode has ended ({self.reason.name}); no turn can be added")
        if len(self.segments) and self.segments[-1].sampled:
            raise RuntimeError("a model turn must be followed by the environment's answer (add_environment)")
        ids, log_probs = [int(i) for i in sampled_ids], [float(p) for p in log_probs]
        if not ids or len(ids) != len(log_probs):
            raise ValueError(f"a turn needs >= 1 sampled id and one log-prob per id, got {len(ids)} and {len(log_probs)}")
        if len(ids) > self.max_new_tokens():
            raise ValueError(f"{len(ids)} sampled ids, more than this turn's max_new_tokens ({self.max_new_tokens()})")
        finished = ids[-1] in self.stop_token_ids
        self._cut_reason = None if finished else self._cut_reason_for(len(ids))
        text = self.decode(ids)
        self._append(Segment(tuple(ids), text, sampled=True, log_probs=tuple(log_probs)))
        content = self.decode(ids[:-1]) if finished else text
        turn = ModelTurn(len(self.turns), content, tuple(self.parser(content)) if self.parser else (), finished)
        self.turns.append(turn)
        self.messages.append({"role": "assistant", "content": content})
        self.turn_messages.append([dict(m) for m in self.messages[self._messages_told:]])
        self._messages_told = len(self.messages)
        return turn

    def add_environment(self, result: StepResult, tool_outcomes: Mapping[str, int] | None = None) -> None:
        """The environment's answer to the last turn: its reward, then the end or its messages.

        ``tool_outcomes`` are the ``ToolBox`` counts of the calls the environment ran for this turn
        (``EnvironmentRunner.step_counting_tools``): the turn's failed calls are ``calls - ok``.
        The turn's calls are those the parser found, or the ones run when the environment ran more."""
        if not self.segments[-1].sampled or self.done:
            raise RuntimeError("add_environment answers a model turn; add_turn first")
        self.rewards.append(reward_value(result.reward))  # set after construction: checked again
        outcomes = tool_outcomes or {}
        ran = int(outcomes.get("calls", 0))
        self.tool_calls.append(max(len(self.turns[-1].tool_calls), ran))
        self.tool_errors.append(ran - int(outcomes.get("ok", 0)))
        self.tool_error_kinds.append(int(sum(kind for kind in ToolErrorKind if outcomes.get(kind.name.lower(), 0))))
        if self._cut_reason is not None:  # a limit cut the turn: that is why it ended, whatever the env says
            self._end(self._cut_reason)
        elif result.done:
            self._end(result.reason or TerminationReason.ENV_DONE)
        elif len(self.turns) >= self.limits.max_turns:
            self._end(TerminationReason.MAX_TURNS)
        else:
            self._add_environment_messages(list(result.messages))

    def _cut_reason_for(self, sampled: int) -> TerminationReason | None:
        """Why a turn that did not end its message stopped (called before it is appended)."""
        used = len(self._ids)
        if self.limits.context_length is not None and used + sampled >= self.limits.context_length:
            return TerminationReason.CONTEXT_FULL
        if self.limits.token_budget is not None and used + sampled >= self.limits.token_budget:
            return TerminationReason.TOKEN_BUDGET
        return TerminationReason.GENERATION_LENGTH if self.limits.end_on_cut_turn else None

    def _add_environment_messages(self, new: list[Message]) -> None:
        full = self.render(self.messages + new, add_generation_prompt=True)
        if full.startswith(self._text):
            delta = full[len(self._text):]
        else:  # not append-only: take what the template writes after the model's last message
            self.metrics["template_mismatch"] += 1
            delta = self._text_after_last_turn(new, full)
        ids = self.encode(delta)
        grown = len(self._ids) + len(ids)
        for limit, reason in ((self.limits.context_length, TerminationReason.CONTEXT_FULL),
                              (self.limits.token_budget, TerminationReason.TOKEN_BUDGET)):
            if limit is not None and grown + 1 > limit:  # no room for one sampled token after them
                self._end(reason)
                return
        if self.check_drift and self.encode(full) != self._ids + ids:
            self.metrics["retokenization_drift"] += 1
        self.messages.extend(dict(m) for m in new)
        self._append(Segment(tuple(ids), delta, sampled=False))

    def _text_after_last_turn(self, new: list[Message], full: str) -> str:
        """What the template writes after the model's last message when ``new`` follows it: its
        closing of that message (less the stop token the model sampled), the new messages and
        the generation prompt. Found by rendering a probe in the last message's place, so how
        the template renders earlier turns (trimmed, thinking stripped) does not matter."""
        probe = "PROBE-CONTENT-0f3a"
        rendered = self.render(self.messages[:-1] + [{"role": "assistant", "content": probe}] + new,
                               add_generation_prompt=True)
        at = rendered.rfind(probe)
        if at < 0:  # the template dropped the probe: the text after the longest common prefix
            return full[len(_common_prefix(full, self.render(self.messages, add_generation_prompt=False))):]
        tail = rendered[at + len(probe):]
        if self.turns[-1].finished:
            tail = tail.removeprefix(self.decode(self.segments[-1].ids[-1:]))
        return tail

    def _append(self, segment: Segment) -> None:
        self.segments.append(segment)
        self._ids.extend(segment.ids)
        self._text += segment.text

    def _end(self, reason: TerminationReason) -> None:
        if reason is TerminationReason.NOT_ENDED:
            raise ValueError("NOT_ENDED is not a reason to end")
        self.reason = reason

    # ---------------------------------------------------------------- rows
    def rows(self, *, group_id: int, trajectory_id: int, policy_version: int,
             fields: Collection[str] = ()) -> list[dict[str, Any]]:
        """The stored rows, one per turn: the tokens added before the turn, then the turn's samples;
        plus the optional ``fields`` of :data:`AGENT_ROW_FIELDS` asked for."""
        if not self.done:
            raise RuntimeError("an episode is stored when it has ended; it is still running")
        unknown = sorted(set(fields) - set(AGENT_ROW_FIELDS))
        if unknown:
            raise ValueError(f"an episode fills the optional fields {list(AGENT_ROW_FIELDS)}, not {unknown}")
        rows = []
        pairs = list(zip(self.segments[0::2], self.segments[1::2], strict=False))
        for step, ((prompt, response), reward) in enumerate(zip(pairs, self.rewards, strict=True)):
            last = step == len(pairs) - 1
            reason = self.reason if last else TerminationReason.NOT_ENDED
            rows.append({
                "prompt_tokens": torch.tensor(prompt.ids, dtype=torch.int32),
                "response_tokens": torch.tensor(response.ids, dtype=torch.int32),
                "response_log_probs": torch.tensor(response.log_probs, dtype=torch.float32),
                "group_id": group_id, "trajectory_id": trajectory_id, "step": step,
                "reward": reward, "policy_version": policy_version,
                "done": last, "terminated": last and reason.terminated, "truncated": last and reason.truncated,
                "termination_reason": int(reason),
                "prompt_text": prompt.text, "response_text": response.text,
            })
            extra = {"tool_calls": self.tool_calls[step], "tool_errors": self.tool_errors[step],
                     "tool_error_kinds": self.tool_error_kinds[step],
                     "turn_messages": encode_turn_messages(self.turn_messages[step])}
            rows[-1].update({name: extra[name] for name in fields})
        return rows


def _common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return a[:n]


# ======================================================================== rebuilding from rows
@dataclass(frozen=True)
class RebuiltTrajectory:
    """A trajectory's token list from its stored rows. Shapes: L = its total length."""

    token_ids: torch.Tensor  # (L,) int32
    loss_mask: torch.Tensor  # (L,) bool: True on sampled tokens
    log_probs: torch.Tensor  # (L,) float32: sampling log-prob on sampled tokens, 0 elsewhere
    turn_rewards: torch.Tensor  # (turns,) float32
    termination_reason: TerminationReason | None


def rebuild_trajectory(rows: TrajectoryBatch) -> RebuiltTrajectory:
    """One trajectory's rows (any order) -> its token list, loss mask and sampled log-probs."""
    ids = rows["trajectory_id"]
    if len(rows) == 0 or bool((ids != ids[0]).any()):
        raise ValueError("rebuild_trajectory takes the rows of exactly one trajectory")
    order = torch.argsort(rows["step"].to(torch.int64))
    steps = rows["step"][order].tolist()
    if steps != list(range(len(steps))):
        raise ValueError(f"trajectory {int(ids[0])}: steps {steps} are not 0..{len(steps) - 1}; rows are missing")
    done = rows["done"][order].tolist()
    if not done[-1] or any(done[:-1]):
        raise ValueError(f"trajectory {int(ids[0])}: only its last row may be done, and it must be")
    pieces, mask, log_probs = [], [], []
    for i in order.tolist():
        prompt, response = rows["prompt_tokens"].row(i), rows["response_tokens"].row(i)
        pieces += [prompt, response]
        mask += [torch.zeros(len(prompt), dtype=torch.bool), torch.ones(len(response), dtype=torch.bool)]
        log_probs += [torch.zeros(len(prompt)), rows["response_log_probs"].row(i).to(torch.float32)]
    reason = None
    if "termination_reason" in rows:
        reason = TerminationReason(int(rows["termination_reason"][order[-1]]))
    return RebuiltTrajectory(torch.cat(pieces).to(torch.int32), torch.cat(mask), torch.cat(log_probs),
                             rows["reward"][order].to(torch.float32), reason)


def episodes_to_batch(episodes: Sequence[Episode], *, group_ids: Sequence[int], trajectory_ids: Sequence[int],
                      policy_version: int, fields: Collection[str] = ()) -> TrajectoryBatch:
    """The rows of ended episodes as one batch (a whole group, written together), with the
    optional ``fields`` of :data:`AGENT_ROW_FIELDS` asked for."""
    rows = []
    for episode, group, trajectory in zip(episodes, group_ids, trajectory_ids, strict=True):
        rows += episode.rows(group_id=group, trajectory_id=trajectory, policy_version=policy_version, fields=fields)
    return TrajectoryBatch.from_rows(rows)
