"""One stored trajectory, turn by turn: what the model saw, what it sampled, what is trained.

:func:`find_trajectory` reads its rows from a store or a run's shards, :func:`format_trajectory`
prints them for a terminal and :func:`trajectory_html` writes a self-contained page with each
token's id and log-probs. A single-turn row is a trajectory of one turn. User's guide:
docs/agents.md#looking-at-stored-trajectories.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf_pipeline.schema import TrajectoryBatch
from rlhf_pipeline.schema.termination import TerminationReason
from rlhf_pipeline.schema.tool_errors import kind_names

# rows of trajectory ids read at a time while searching a buffer
_SEARCH_ROWS = 65_536


class TrajectoryNotFound(LookupError):
    pass


@dataclass
class TurnView:
    step: int
    position: int  # the row's position in the buffer
    prompt_ids: list[int]  # what was added before this turn (the environment, the template)
    response_ids: list[int]  # sampled: the trained tokens
    response_log_probs: list[float]
    reference_log_probs: list[float] | None
    prompt_text: str | None
    response_text: str | None
    reward: float
    advantage: float | None
    tool_calls: int | None = None  # the turn's tool calls and failed ones, in buffers that store them
    tool_errors: int | None = None
    tool_error_kinds: int | None = None  # a schema.ToolErrorKind bit set

    @property
    def tools(self) -> str:
        """`` · 2 tool calls, 1 failed (timeout)`` for a turn whose counts are stored, else nothing."""
        if self.tool_calls is None:
            return ""
        failed = f", {self.tool_errors} failed" if self.tool_errors is not None else ""
        if self.tool_error_kinds:
            failed += f" ({', '.join(kind_names(self.tool_error_kinds))})"
        return f" · {self.tool_calls} tool call{'s' if self.tool_calls != 1 else ''}{failed}"


@dataclass
class TrajectoryView:
    trajectory_id: int
    group_id: int
    policy_version: int
    turns: list[TurnView]
    done: bool
    terminated: bool
    truncated: bool
    termination_reason: TerminationReason | None

    @property
    def trained_tokens(self) -> int:
        return sum(len(t.response_ids) for t in self.turns)

    @property
    def context_tokens(self) -> int:
        return sum(len(t.prompt_ids) for t in self.turns)

    @property
    def ending(self) -> str:
        flags = [name for name, on in (("terminated", self.terminated), ("truncated", self.truncated)) if on]
        reason = self.termination_reason.name if self.termination_reason is not None else None
        parts = ([reason] if reason else []) + flags
        return ", ".join(parts) if parts else ("done" if self.done else "not done")


# ---------------------------------------------------------------------------------------- finding
def find_trajectory(store, trajectory_id: int | None = None, *, row: int | None = None) -> TrajectoryView:
    """The rows of ``trajectory_id`` (or of the trajectory holding ``row``, or else the newest
    whole trajectory: the one whose ``done`` row is the buffer's last) as a :class:`TrajectoryView`."""
    total = len(store)
    if total == 0:
        raise TrajectoryNotFound(f"{store.location} holds no rows")
    if trajectory_id is None:
        if row is not None:
            if not 0 <= row < total:
                raise TrajectoryNotFound(f"--row {row} is outside the buffer's {total} rows (0..{total - 1})")
            trajectory_id = int(store.read(torch.tensor([row]), fields=("trajectory_id",))["trajectory_id"][0])
        else:
            trajectory_id = _newest_whole(store, total)
    positions = _positions_of(store, trajectory_id, total)
    rows = store.read(positions)
    return _view(rows, positions, trajectory_id)


def _newest_whole(store, total: int) -> int:
    for end in range(total, 0, -_SEARCH_ROWS):
        start = max(0, end - _SEARCH_ROWS)
        done = store.read(torch.arange(start, end), fields=("done", "trajectory_id"))
        last = torch.nonzero(done["done"]).flatten()
        if last.numel():
            return int(done["trajectory_id"][last[-1]])
    raise TrajectoryNotFound(f"{store.location} holds no whole trajectory (no row is done)")


def _positions_of(store, trajectory_id: int, total: int) -> torch.Tensor:
    found, low, high = [], None, None
    # ids are int64 and >= 0 (schema/ids.py): one past int64 is in no buffer, as -1 is not, and torch
    # cannot compare it
    wanted = trajectory_id if 0 <= trajectory_id < 2**63 else -1
    for start in range(0, total, _SEARCH_ROWS):
        ids = store.read(torch.arange(start, min(total, start + _SEARCH_ROWS)), fields=("trajectory_id",))
        ids = ids["trajectory_id"]
        found.append(torch.nonzero(ids == wanted).flatten() + start)
        low = int(ids.min()) if low is None else min(low, int(ids.min()))
        high = int(ids.max()) if high is None else max(high, int(ids.max()))
    positions = torch.cat(found)
    if positions.numel() == 0:
        raise TrajectoryNotFound(f"trajectory {trajectory_id} is not in {store.location} (its trajectory ids run "
                                 f"from {low} to {high}; `rlhf-pipeline export` lists them all)")
    return positions


def _view(rows: TrajectoryBatch, positions: torch.Tensor, trajectory_id: int) -> TrajectoryView:
    order = torch.argsort(rows["step"].to(torch.int64), stable=True).tolist()
    turns = []
    for i in order:
        turns.append(TurnView(
            step=int(rows["step"][i]), position=int(positions[i]),
            prompt_ids=rows["prompt_tokens"].row(i).tolist(), response_ids=rows["response_tokens"].row(i).tolist(),
            response_log_probs=rows["response_log_probs"].row(i).to(torch.float32).tolist(),
            reference_log_probs=(rows["ref_log_probs"].row(i).to(torch.float32).tolist()
                                 if "ref_log_probs" in rows else None),
            prompt_text=rows["prompt_text"][i] if "prompt_text" in rows else None,
            response_text=rows["response_text"][i] if "response_text" in rows else None,
            reward=float(rows["reward"][i]),
            advantage=float(rows["advantage"][i]) if "advantage" in rows else None,
            tool_calls=int(rows["tool_calls"][i]) if "tool_calls" in rows else None,
            tool_errors=int(rows["tool_errors"][i]) if "tool_errors" in rows else None,
            tool_error_kinds=int(rows["tool_error_kinds"][i]) if "tool_error_kinds" in rows else None))
    last = order[-1]
    reason = None
    if "termination_reason" in rows and int(rows["termination_reason"][last]) != 0:
        reason = TerminationReason(int(rows["termination_reason"][last]))
    return TrajectoryView(trajectory_id, int(rows["group_id"][last]), int(rows["policy_version"][last]), turns,
                          bool(rows["done"][last]), bool(rows["terminated"][last]), bool(rows["truncated"][last]),
                          reason)


def missing_steps(view: TrajectoryView) -> list[int]:
    """Turns absent from the buffer (evicted, or a trajectory still being written elsewhere)."""
    steps = [t.step for t in view.turns]
    return sorted(set(range(max(steps) + 1)) - set(steps))


# ---------------------------------------------------------------------------------------- pieces
def token_pieces(ids: Sequence[int], tokenizer: Any | None) -> list[str]:
    """The text each token adds, so that the pieces join to the decoded segment.

    Decoding token by token would split a multi-byte character (a byte-level BPE token can
    hold half of one) into replacement characters; decoding growing prefixes and taking the
    difference keeps the text whole, giving the character to the token that completes it.
    """
    if tokenizer is None:
        return [f"[{i}]" for i in ids]
    pieces, previous = [], ""
    for end in range(1, len(ids) + 1):
        text = tokenizer.decode(list(ids[:end]), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if text.endswith("\ufffd"):  # an incomplete character: it belongs to a later token
            pieces.append("")
            continue
        pieces.append(text[len(previous):] if text.startswith(previous) else text)
        previous = text
    return pieces


# ---------------------------------------------------------------------------------------- text
_DIM, _TRAINED, _RESET = "\x1b[2m", "\x1b[32m", "\x1b[0m"


def format_trajectory(view: TrajectoryView, tokenizer: Any | None = None, *, color: bool = False,
                      log_probs: bool = False) -> str:
    """The trajectory for a terminal: a header, then per turn what was added and what was sampled.

    Trained tokens are green with ``color``; with ``log_probs`` each sampled token is followed
    by its sampling log-prob, ``token⟨-0.12⟩``."""
    lines = [_header(view)]
    for turn in view.turns:
        lines.append("")
        lines.append(f"── turn {turn.step} (row {turn.position}) · reward {_num(turn.reward)}"
                     + (f" · advantage {_num(turn.advantage)}" if turn.advantage is not None else "")
                     + turn.tools + f" · {len(turn.prompt_ids)} context + {len(turn.response_ids)} trained tokens")
        context = _segment_text(turn.prompt_ids, turn.prompt_text, tokenizer)
        sampled = _segment_text(turn.response_ids, turn.response_text, tokenizer,
                                turn.response_log_probs if log_probs else None)
        lines.append("not trained | " + _indent(_paint(context, _DIM, color)))
        lines.append("trained     | " + _indent(_paint(sampled, _TRAINED, color)))
    gaps = missing_steps(view)
    if gaps:
        lines.append(f"\nwarning: turns {gaps} are not in the buffer (evicted, or never written)")
    return "\n".join(lines)


def _header(view: TrajectoryView) -> str:
    rewards = [t.reward for t in view.turns]
    tools = ""
    if all(t.tool_calls is not None for t in view.turns):
        calls = sum(t.tool_calls for t in view.turns)
        tools = f" · {calls} tool call{'s' if calls != 1 else ''}"
        if all(t.tool_errors is not None for t in view.turns):
            tools += f", {sum(t.tool_errors for t in view.turns)} failed"
    return (f"trajectory {view.trajectory_id} · group {view.group_id} · policy version {view.policy_version} · "
            f"{len(view.turns)} turn{'s' if len(view.turns) != 1 else ''} · ended: {view.ending}\n"
            f"return {_num(sum(rewards))} (turn rewards {', '.join(_num(r) for r in rewards)}) · "
            f"{view.trained_tokens} trained tokens, {view.context_tokens} not trained{tools}")


def _segment_text(ids: list[int], stored_text: str | None, tokenizer: Any | None,
                  log_probs: list[float] | None = None) -> str:
    if tokenizer is None and log_probs is None:
        return stored_text if stored_text is not None else " ".join(token_pieces(ids, None))
    pieces = token_pieces(ids, tokenizer)
    if log_probs is None:
        return "".join(pieces)
    return "".join(f"{piece}⟨{lp:.2f}⟩" for piece, lp in zip(pieces, log_probs, strict=True))


def _indent(text: str) -> str:
    return text.replace("\n", "\n            | ")


def _paint(text: str, style: str, color: bool) -> str:
    return f"{style}{text}{_RESET}" if color else text


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


# ---------------------------------------------------------------------------------------- HTML
_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 70em; }
h1 { font-size: 1.3em; } table { border-collapse: collapse; margin: 1em 0; }
td, th { border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: right; } th { background: #f4f4f4; }
.turn { margin: 1.2em 0; } .turn h2 { font-size: 1em; margin: 0 0 0.3em 0; }
.tokens { font-family: ui-monospace, monospace; white-space: pre-wrap; overflow-wrap: anywhere; line-height: 1.6;
          border: 1px solid #ddd; padding: 0.6em; }
.tokens span { box-shadow: inset -1px 0 0 rgba(0, 0, 0, 0.12); }
.context { color: #888; background: #f2f2f2; }
.trained { color: #000; }
.legend span { padding: 0 0.4em; margin-right: 1em; font-family: ui-monospace, monospace; }
details { margin: 0.3em 0; } summary { cursor: pointer; color: #555; }
table.ids { font-family: ui-monospace, monospace; font-size: 0.9em; margin: 0.3em 0; }
table.ids td.piece { text-align: left; white-space: pre; }
.warning { color: #a00; }
"""


PAGE_MARK = '<meta name="generator" content="rlhf-pipeline show">'
"""In the head of every page :func:`trajectory_html` writes: ``show --html`` replaces such a page, no other file."""


def written_by_show(page: Path) -> bool:
    """Whether ``page`` is a page ``show --html`` wrote (its head holds :data:`PAGE_MARK`)."""
    try:
        with open(page, "rb") as f:
            return PAGE_MARK.encode() in f.read(512)
    except OSError:
        return False


def trajectory_html(view: TrajectoryView, tokenizer: Any | None = None, *, title: str | None = None) -> str:
    """A self-contained page that reads as text: each turn's tokens run on as its text does, each a
    span, grey when not trained, shaded by its sampling probability when trained (pale =
    unlikely); under each turn a table (closed until opened, by keyboard or mouse) gives every
    token's id and log-probs, which each token's tooltip shows as well."""
    out = ["<!DOCTYPE html>", f'<html><head><meta charset="utf-8">{PAGE_MARK}',
           f"<title>{html.escape(title or f'trajectory {view.trajectory_id}')}</title>",
           f"<style>{_CSS}</style></head><body>",
           f"<h1>{html.escape(title or '')} trajectory {view.trajectory_id}</h1>",
           "<p>" + html.escape(_header(view)).replace("\n", "<br>") + "</p>",
           '<p class="legend"><span class="context">not trained (prompt, template, environment)</span>'
           '<span class="trained" style="background:rgb(120,220,120)">trained, likely</span>'
           '<span class="trained" style="background:rgb(235,250,235)">trained, unlikely</span>'
           " each turn's token table gives ids and log-probs (a token's tooltip too)</p>",
           _turn_table(view)]
    for turn in view.turns:
        out.append(f'<div class="turn" id="turn-{turn.step}"><h2>turn {turn.step} · row {turn.position} · reward '
                   f"{_num(turn.reward)}" + (f" · advantage {_num(turn.advantage)}" if turn.advantage is not None
                                             else "") + html.escape(turn.tools) + "</h2>")
        context, sampled = token_pieces(turn.prompt_ids, tokenizer), token_pieces(turn.response_ids, tokenizer)
        spans = [f'<span class="context" title="id {token} · not trained">{html.escape(piece)}</span>'
                 for token, piece in zip(turn.prompt_ids, context, strict=True)]
        for k, (token, piece) in enumerate(zip(turn.response_ids, sampled, strict=True)):
            spans.append(f'<span class="trained" style="background:{_shade(turn.response_log_probs[k])}" '
                         f'title="{html.escape(_tip(turn, k))}">{html.escape(piece)}</span>')
        # nothing between the spans: the block keeps white space, so a newline there would be shown
        out.append('<div class="tokens">' + "".join(spans) + "</div>")
        out.append(_token_table(turn, context, sampled))
        out.append("</div>")
    gaps = missing_steps(view)
    if gaps:
        out.append(f'<p class="warning">turns {gaps} are not in the buffer (evicted, or never written)</p>')
    out.append("</body></html>")
    return "\n".join(out)


def _tip(turn: TurnView, k: int) -> str:
    lp = turn.response_log_probs[k]
    tip = f"id {turn.response_ids[k]} · sampled log-prob {lp:.4f} (p {math.exp(lp):.3f})"
    if turn.reference_log_probs is not None:
        tip += f" · reference log-prob {turn.reference_log_probs[k]:.4f}"
    return tip


def _token_table(turn: TurnView, context: list[str], sampled: list[str]) -> str:
    """Every token of the turn, one row each: the piece (spaces as ␣, line ends as \\n), id,
    whether trained, and for sampled tokens their log-probs."""
    reference = turn.reference_log_probs is not None
    rows = ["<tr><th>#</th><th>token</th><th>id</th><th>trained</th><th>sampled log-prob</th><th>p</th>"
            + ("<th>reference log-prob</th>" if reference else "") + "</tr>"]
    for k, (token, piece) in enumerate(zip(turn.prompt_ids, context, strict=True)):
        rows.append(f'<tr><td>{k}</td><td class="piece">{html.escape(_visible(piece))}</td><td>{token}</td>'
                    f"<td>no</td><td></td><td></td>" + ("<td></td>" if reference else "") + "</tr>")
    for k, (token, piece) in enumerate(zip(turn.response_ids, sampled, strict=True)):
        lp = turn.response_log_probs[k]
        rows.append(f'<tr><td>{len(context) + k}</td><td class="piece">{html.escape(_visible(piece))}</td>'
                    f"<td>{token}</td><td>yes</td><td>{lp:.4f}</td><td>{math.exp(lp):.3f}</td>"
                    + (f"<td>{turn.reference_log_probs[k]:.4f}</td>" if reference else "") + "</tr>")
    return (f"<details><summary>ids and log-probs of the turn's {len(context) + len(sampled)} tokens "
            f"({len(sampled)} trained)</summary><table class=\"ids\">" + "".join(rows) + "</table></details>")


def _visible(piece: str) -> str:
    if not piece:
        return "(part of the next token's character)"
    return piece.replace(" ", "␣").replace("\n", "\\n").replace("\t", "\\t")


def _turn_table(view: TrajectoryView) -> str:
    head = "<tr><th>turn</th><th>row</th><th>context tokens</th><th>trained tokens</th><th>reward</th>" \
           "<th>advantage</th><th>tool calls</th><th>failed</th><th>mean sampled log-prob</th></tr>"
    body = []
    for turn in view.turns:
        mean_lp = sum(turn.response_log_probs) / len(turn.response_log_probs) if turn.response_log_probs else None
        body.append(f'<tr><td><a href="#turn-{turn.step}">{turn.step}</a></td><td>{turn.position}</td>'
                    f"<td>{len(turn.prompt_ids)}</td><td>{len(turn.response_ids)}</td><td>{_num(turn.reward)}</td>"
                    f"<td>{_num(turn.advantage)}</td><td>{_count(turn.tool_calls)}</td>"
                    f"<td>{_count(turn.tool_errors)}</td><td>{_num(mean_lp)}</td></tr>")
    return "<table>" + head + "".join(body) + "</table>"


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


def _shade(log_prob: float) -> str:
    """Green, deeper for likelier tokens: probability 1 -> rgb(120,220,120), 0 -> rgb(235,250,235)."""
    p = min(1.0, max(0.0, math.exp(log_prob)))
    r, g, b = (round(235 - 115 * p), round(250 - 30 * p), round(235 - 115 * p))
    return f"rgb({r},{g},{b})"
