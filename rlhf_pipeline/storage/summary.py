"""What ``inspect`` reports about a store, with one definition of each size figure; no torch.

Raw payload (``raw_bytes``), bytes on disk (``bytes_on_disk``: what ``du`` counts) and disk/raw
(``disk_bytes_per_raw_byte``) mean the same for every backend. API: :class:`StoreStats`,
:func:`disk_usage`, :func:`describe_versions`, and the trajectories held
(:func:`summarize_trajectories`: counts, turns, termination reasons).

Design: docs/storage.md#sizes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np


@dataclass
class StoreStats:
    """What ``rlhf-pipeline inspect`` prints; every backend fills it from its own metadata."""

    backend: str
    location: str
    rows: int  # rows held now (after eviction)
    first_row: int
    next_row: int  # rows ever written
    groups: int
    prompt_tokens: int
    response_tokens: int
    bytes_on_disk: int  # as du counts the store's directory (docs/storage.md#sizes)
    raw_bytes: int  # raw payload: token values, row values, UTF-8 text; no offsets, padding or compression
    segments: int
    reward_mean: float | None = None
    reward_std: float | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    policy_versions: dict[int, int] = field(default_factory=dict)  # version -> rows, ascending
    optional_fields: list[str] = field(default_factory=list)
    # trajectories held: "count", "multi_turn" (of more than one row), "turns_max", "turns_mean",
    # and "ended" (termination reason name -> done rows) when the store keeps termination_reason
    trajectories: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # backend-specific (codec, chunking...)

    @property
    def disk_bytes_per_raw_byte(self) -> float:
        """Bytes on disk over raw payload ("disk/raw"); below 1 means compression."""
        return self.bytes_on_disk / self.raw_bytes if self.raw_bytes else float("nan")

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict: keys sorted, policy versions in numeric order (JSON keys are strings)."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["disk_bytes_per_raw_byte"] = self.disk_bytes_per_raw_byte
        out["policy_versions"] = {str(v): n for v, n in sorted(self.policy_versions.items())}
        out["extra"] = dict(sorted(self.extra.items()))
        return dict(sorted(out.items()))


def summarize_trajectories(trajectory_id: np.ndarray, reasons: np.ndarray | None,
                           tool_calls: np.ndarray | None = None, tool_errors: np.ndarray | None = None,
                           tool_error_kinds: np.ndarray | None = None) -> dict[str, Any]:
    """``StoreStats.trajectories`` of the rows held (a trajectory's rows are counted where held:
    one whose first turns were evicted counts the turns left). With the agents' per-turn tool
    counts: ``tool_calls`` and ``tool_errors`` summed over the rows, the trajectories that
    called a tool (``with_tool_calls``) and that had a failed call (``with_tool_errors``), and
    the turns with a failure of each kind (``tool_error_turns``: kind name -> turns)."""
    if trajectory_id.size == 0:
        return {}
    import numpy as np  # here: importing this module (the storage package) stays numpy-free for run's launcher

    _, turns = np.unique(trajectory_id, return_counts=True)
    out: dict[str, Any] = {"count": int(turns.size), "multi_turn": int((turns > 1).sum()),
                           "turns_max": int(turns.max()), "turns_mean": float(turns.mean())}
    if reasons is not None:
        from rlhf_pipeline.schema.termination import TerminationReason

        codes, counts = np.unique(reasons[reasons != 0], return_counts=True)
        out["ended"] = {TerminationReason(int(c)).name: int(n) for c, n in zip(codes, counts)}
    if tool_calls is not None:
        out["tool_calls"] = int(tool_calls.sum())
        out["with_tool_calls"] = int(np.unique(trajectory_id[tool_calls > 0]).size)
    if tool_errors is not None:
        out["tool_errors"] = int(tool_errors.sum())
        out["with_tool_errors"] = int(np.unique(trajectory_id[tool_errors > 0]).size)
    if tool_error_kinds is not None:
        from rlhf_pipeline.schema.tool_errors import ToolErrorKind

        out["tool_error_turns"] = {kind.name.lower(): n for kind in ToolErrorKind
                                   if (n := int(((tool_error_kinds & int(kind)) != 0).sum()))}
    return out


_TOOL_KEYS = ("tool_calls", "with_tool_calls", "tool_errors", "with_tool_errors")


def combine_trajectories(per_store: list[dict[str, Any]]) -> dict[str, Any]:
    """The trajectories of several stores (shards hold disjoint trajectory ids: the collector's)."""
    parts = [t for t in per_store if t]
    if not parts:
        return {}
    count = sum(t["count"] for t in parts)
    out: dict[str, Any] = {"count": count, "multi_turn": sum(t["multi_turn"] for t in parts),
                           "turns_max": max(t["turns_max"] for t in parts),
                           "turns_mean": sum(t["turns_mean"] * t["count"] for t in parts) / count}
    if any("ended" in t for t in parts):
        ended: dict[str, int] = {}
        for t in parts:
            for name, n in t.get("ended", {}).items():
                ended[name] = ended.get(name, 0) + n
        out["ended"] = dict(sorted(ended.items()))
    for key in _TOOL_KEYS:
        if any(key in t for t in parts):
            out[key] = sum(t.get(key, 0) for t in parts)
    if any("tool_error_turns" in t for t in parts):
        turns: dict[str, int] = {}
        for t in parts:
            for name, n in t.get("tool_error_turns", {}).items():
                turns[name] = turns.get(name, 0) + n
        out["tool_error_turns"] = turns
    return out


def describe_trajectories(trajectories: dict[str, Any]) -> str:
    """One line for ``inspect``: counts, turns, and how multi-turn trajectories ended."""
    if not trajectories:
        return "0"
    text = f"{trajectories['count']}"
    if trajectories["multi_turn"]:
        text += (f"  ({trajectories['multi_turn']} of several turns; turns mean {trajectories['turns_mean']:.2f}, "
                 f"max {trajectories['turns_max']})")
    if trajectories.get("ended"):
        text += "; ended: " + ", ".join(f"{name} {n}" for name, n in trajectories["ended"].items())
    if "tool_calls" in trajectories:
        text += (f"; tool calls {trajectories['tool_calls']} in {trajectories['with_tool_calls']} trajectories")
    if "tool_errors" in trajectories:
        text += (f", failed {trajectories['tool_errors']} in {trajectories['with_tool_errors']} trajectories")
    if trajectories.get("tool_error_turns"):
        text += " (turns failing by kind: " + ", ".join(
            f"{name} {n}" for name, n in trajectories["tool_error_turns"].items()) + ")"
    return text


def disk_usage(path: str | os.PathLike) -> int:
    """Bytes ``du -s --block-size=1 path`` reports: allocated blocks of every file and directory
    under ``path`` (the directory itself included), each inode once. 0 when ``path`` is missing."""
    seen: set[tuple[int, int]] = set()
    total = 0

    def count(st: os.stat_result) -> None:
        nonlocal total
        key = (st.st_dev, st.st_ino)
        if key not in seen:
            seen.add(key)
            total += st.st_blocks * 512

    try:
        count(os.stat(path))
    except FileNotFoundError:
        return 0
    if not os.path.isdir(path):
        return total
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            try:
                count(os.lstat(os.path.join(root, name)))
            except FileNotFoundError:  # deleted while walking (a writer compacting or evicting)
                pass
    return total


def describe_versions(versions: dict[int, int], *, spell_out: int = 8) -> str:
    """One line about the rows per policy version: each version when there are few, else the
    runs of consecutive versions and a five-bin histogram of rows by version."""
    if not versions:
        return "-"
    items = sorted(versions.items())
    if len(items) <= spell_out:
        return ", ".join(f"v{v}: {n}" for v, n in items)
    runs, start, prev = [], items[0][0], items[0][0]
    for v, _ in items[1:]:
        if v != prev + 1:
            runs.append((start, prev))
            start = v
        prev = v
    runs.append((start, prev))
    spans = ", ".join(f"v{a}" if a == b else f"v{a}-v{b}" for a, b in runs[:4])
    if len(runs) > 4:
        spans += f", ... ({len(runs)} runs)"
    lo, hi = items[0][0], items[-1][0]
    bins = 5
    width = -(-(hi - lo + 1) // bins)
    histogram = []
    for b in range(bins):
        a, z = lo + b * width, min(hi, lo + (b + 1) * width - 1)
        if a > hi:
            break
        histogram.append(f"v{a}-v{z}: {sum(n for v, n in items if a <= v <= z)}")
    counts = sorted(n for _, n in items)
    return (f"{len(items)} versions ({spans}); rows per version min {counts[0]}, "
            f"median {counts[len(counts) // 2]}, max {counts[-1]}; rows by version: {', '.join(histogram)}")
