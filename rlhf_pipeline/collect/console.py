"""What a collector says on the console: :func:`say` (a line that starts clean on a terminal the learner's
progress bar shares: ``\\r`` then erase-line first) and :func:`agent_round_printer`, a metrics hook that
reports an agent round's tool calls and warns when every call of a round failed.
Design: docs/agents.md#collecting-episodes-into-the-buffer ("On the console").
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any, TextIO

CLEAR_LINE = "\r\x1b[K"  # carriage return, then erase to the end of the line (ECMA-48 EL)
ERROR_CHARS = 200  # of one tool error, on the console


def say(line: str, stream: TextIO | None = None) -> None:
    """Writes one line to ``stream`` (stderr), starting a clean line on a terminal."""
    stream = stream if stream is not None else sys.stderr
    prefix = CLEAR_LINE if getattr(stream, "isatty", lambda: False)() else ""
    stream.write(f"{prefix}{line}\n")  # one write: another process's output does not land mid-line
    stream.flush()


# Whether this process's collector is one of several: collect_main knows (`run --collectors N`
# with N > 1 gives each its --collector-index, as does a user starting `collect --collector-index K`);
# a pipeline's own console hooks, built by make_collector with the index alone, do not.
_one_of_several = False


def name_collectors(one_of_several: bool) -> None:
    """Sets how :func:`collector_tag` names this process's collector."""
    global _one_of_several
    _one_of_several = one_of_several


def collector_tag(collector_index: int) -> str:
    """``[collector]`` for a run's only collector; ``[collector 0]``, ``[collector 1]``... for several."""
    return f"[collector {collector_index}]" if _one_of_several or collector_index else "[collector]"


def agent_round_printer(every: int, collector_index: int = 0, toolbox: Any = None,
                        stream: TextIO | None = None) -> Callable[[Mapping[str, float]], None]:
    """The hook. ``every``: rounds per line (0: no lines, warnings only); ``toolbox``: the
    :class:`~rlhf_pipeline.agents.tools.ToolBox` the episodes call, whose ``take_first_errors()``
    gives the error messages (without one, only counts are printed)."""
    since_line: dict[str, str] = {}  # kind -> first message since the last line
    # the line's tool counts cover the rounds since the line before, as its error messages do: a round's
    # own counts printed above an earlier round's error read as "0 errors" and an error at once
    state = {"rounds": 0, "warned": False, "calls": 0, "ok": 0, "first_round": None}

    def hook(m: Mapping[str, float]) -> None:
        tag = collector_tag(collector_index)
        state["rounds"] += 1
        for kind, message in (toolbox.take_first_errors() if toolbox is not None else {}).items():
            since_line.setdefault(kind, message)
        calls, ok = int(m.get("tools/calls", 0)), int(m.get("tools/ok", 0))
        round_number = int(m.get("batches", state["rounds"]))
        state["calls"] += calls
        state["ok"] += ok
        if state["first_round"] is None:
            state["first_round"] = round_number
        if calls and not ok:
            if not state["warned"]:  # once per stretch of rounds in which every call fails
                say(f"{tag} warning: every tool call of round {round_number} failed ({calls} of {calls}); "
                    f"the first failure of each kind:", stream)
                say_errors(tag)
            state["warned"] = True
        elif ok:
            state["warned"] = False
        if every and state["rounds"] % every == 0:
            reasons = " ".join(f"{k.removeprefix('reason/')}={int(v)}" for k, v in m.items()
                               if k.startswith("reason/") and v)
            first = state["first_round"]
            rounds = f"round {first}" if first == round_number else f"rounds {first}-{round_number}"
            say(f"{tag} round {round_number} (policy v{int(m.get('policy_version', 0))}): reward "
                f"{m.get('reward_mean', float('nan')):.3f}, tool-call rate {m.get('tool_call_rate', 0.0):.2f}, "
                f"turns/episode {m.get('turns_per_episode', 0.0):.2f}, ends: {reasons}; tool errors "
                f"{state['calls'] - state['ok']}/{state['calls']} in {rounds}", stream)
            say_errors(tag)
            state.update(calls=0, ok=0, first_round=None)

    def say_errors(tag: str) -> None:
        for kind, message in since_line.items():
            say(f"{tag}   first {kind} error: {_one_line(message)}", stream)
        since_line.clear()

    return hook


def _one_line(message: str) -> str:
    text = " ".join(str(message).split())
    return text if len(text) <= ERROR_CHARS else text[:ERROR_CHARS] + "..."
