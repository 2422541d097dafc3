"""A local run's lineage and rewind points, read without torch: what ``inspect RUN`` prints.

A branch (``runs/branch.py``) records its parent in ``<branch>/branch.json``; the parent is never
written to (its files stay byte-identical), so a parent's branches are found by looking at the runs
beside it (the same home) for a ``branch.json`` that names it. A branch made elsewhere is not found
from its parent, but still names its parent itself.
"""

from __future__ import annotations

import fcntl
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rlhf_pipeline.learn.checkpoint import CheckpointManager
from rlhf_pipeline.runs.branch_reads import BRANCH_MAKING, HALF_MADE_SUFFIX, making_record

BRANCH_FILE = "branch.json"
BRANCH_FORMAT = 1


@contextmanager
def branches_settled(run: str | Path) -> Iterator[None]:
    """Held while a run's retention looks for its branches and drops rows (``runs/retention.py``), and
    while a branch of it names the rows it reads and appears (``runs/branch.py``): so a branch is either
    seen by the look or names only rows left after the drop, never rows a drop decided without it.
    An exclusive ``flock`` on the run's ``settings.json``, opened read-only: the parent stays
    byte-identical. A run without ``settings.json`` (none was written yet) has nothing to hold."""
    try:
        handle = open(Path(run) / "settings.json", "rb")
    except (FileNotFoundError, NotADirectoryError):
        yield
        return
    with handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)  # released when the file is closed
        yield


def is_run_directory(path: str | Path) -> bool:
    """A directory a run made: it holds ``settings.json`` or ``checkpoints/``."""
    path = Path(path)
    return (path / "settings.json").is_file() or (path / "checkpoints").is_dir()


def read_parent(run: str | Path) -> dict[str, Any] | None:
    """The run's ``branch.json`` (``{"parent": path, "step": N, "buffer_rows": {...}, ...}``), or
    None for a run that is no branch."""
    try:
        data = json.loads((Path(run) / BRANCH_FILE).read_text())
    except (FileNotFoundError, NotADirectoryError):  # no run there yet, or a path the run's own checks refuse
        return None
    if not isinstance(data, dict) or "parent" not in data or "step" not in data:
        raise ValueError(f"{Path(run) / BRANCH_FILE} is damaged (no 'parent' and 'step'); it was written by "
                         f"`rlhf-pipeline branch`: restore it, or the branch no longer knows the rows it may read")
    return data


def is_detached(run: str | Path) -> bool:
    """Whether the branch ``run`` was made self-contained (``runs/detach.py``): it reads nothing of
    its parent any more, though its ``branch.json`` still names it."""
    try:
        return bool((read_parent(run) or {}).get("detached"))
    except (ValueError, OSError):
        return False  # damaged: treated as still reading its parent


def find_branches(run: str | Path) -> list[dict[str, Any]]:
    """The branches of ``run`` among the runs beside it: ``{"run": path, "step": N}``, by step then path."""
    run = Path(run).resolve()
    found = []
    for candidate in sorted(run.parent.iterdir()) if run.parent.is_dir() else []:
        if candidate == run or not (candidate / BRANCH_FILE).is_file():
            continue
        try:
            parent = read_parent(candidate)
        except (ValueError, json.JSONDecodeError, OSError):
            continue  # a damaged branch says so when it is inspected itself
        if parent is not None and Path(parent["parent"]).resolve() == run:
            found.append({"run": str(candidate), "step": int(parent["step"])})
    return sorted(found, key=lambda b: (b["step"], b["run"]))


def half_made_parent(making: Path) -> str | None:
    """The parent a branch left half-made at ``making`` (``NAME.creating/``) names in its
    ``branch.making``; None when it names none (stopped before writing it, or made before it was)."""
    parent = _making_record(making).get("parent")
    return None if parent is None else str(parent)


def _making_record(making: Path) -> dict[str, Any]:
    try:
        return making_record((making / BRANCH_MAKING).read_bytes()) or {}
    except OSError:
        return {}


def half_made_branches(run: str | Path) -> list[dict[str, Any]]:
    """The branches of ``run`` that a ``branch`` stopped midway left beside it, ``NAME.creating/``
    (``runs/branch.py``): ``{"run": path, "step": N}``, by path; one that names no parent is listed
    too (step None): nothing else would ever show it."""
    run = Path(run).resolve()
    found = []
    for candidate in sorted(run.parent.iterdir()) if run.parent.is_dir() else []:
        if not candidate.name.endswith(HALF_MADE_SUFFIX) or not candidate.is_dir():
            continue
        record = _making_record(candidate)
        if record.get("parent") is None or Path(str(record["parent"])).resolve() == run:
            found.append({"run": str(candidate), "step": record.get("step")})
    return found


def run_lineage(run: str | Path) -> dict[str, Any]:
    """What ``inspect RUN`` says about a run directory: its rewind points, its parent, its branches."""
    run = Path(run).resolve()
    parent = read_parent(run)
    return {
        "run": str(run),
        "rewind_points": CheckpointManager(run / "checkpoints").rewind_points(),
        "parent": None if parent is None else {"run": parent["parent"], "step": parent["step"],
                                               "settings_changed": parent.get("settings_changed", [])},
        "branches": [{**b, **what_branch_reads(b["run"], run)} for b in find_branches(run)],
        "half_made": half_made_branches(run),
    }


def what_branch_reads(branch: str | Path, parent: str | Path) -> dict[str, Any]:
    """Which of ``parent``'s rows ``branch`` holds by reference: ``parent_rows`` (per shard, the rows
    it reads below that row, or None when it reads none: a replay's branch reads the replay's
    source), ``reads`` (a replay source inside the parent, else None) and ``detached``."""
    lineage = read_parent(branch) or {}
    source = lineage.get("replay_source")
    inside = source is not None and "://" not in str(source) and Path(source).resolve().is_relative_to(
        Path(parent).resolve())
    holds = lineage.get("replay_source") is None and (Path(branch) / "parent-rows").exists()
    return {"parent_rows": lineage.get("buffer_rows") if holds else None, "reads": source if inside else None,
            "detached": bool(lineage.get("detached"))}


def describe_branch(branch: dict[str, Any]) -> str:
    """One branch as ``inspect`` lists it: where from, and what of the parent it reads."""
    rows = branch.get("parent_rows")
    shards = ", ".join(f"{name or 'store'}={n}" for name, n in sorted((rows or {}).items()))
    if branch.get("detached"):
        what = f"detached: its own copy of the parent's rows below {shards}" if rows else "detached"
    elif rows:
        what = f"reads the parent's rows below {shards}"
    elif branch.get("reads"):
        what = f"reads {branch['reads']}"
    else:
        what = "reads none of its rows"
    return f"  {branch['run']} (from step {branch['step']}; {what})"


def format_lineage(lineage: dict[str, Any]) -> str:
    """``run_lineage`` as the lines ``inspect`` prints above the buffer's table."""
    lines = [f"run  {lineage['run']}"]
    parent = lineage["parent"]
    if parent is not None:
        changed = ", ".join(parent["settings_changed"]) or "no setting changed"
        lines.append(f"branched from  {parent['run']} at step {parent['step']} ({changed})")
    points = lineage["rewind_points"]
    lines.append(f"rewind points  {len(points)} (checkpoints a branch can start from)" if points
                 else "rewind points  none (no checkpoint yet)")
    for point in points:
        rows = point.get("buffer_rows")
        where = ("  buffer rows " + ", ".join(f"{name or 'store'}={n}" for name, n in sorted(rows.items()))
                 if rows is not None else "  (buffer position not recorded: a checkpoint made before records)")
        version = f"  policy version {point['policy_version']}" if "policy_version" in point else ""
        lines.append(f"  step {point['step']}{version}{where}")
    branches = lineage["branches"]
    lines.append(f"branches  {len(branches)}" if branches else "branches  none")
    lines += [describe_branch(b) for b in branches]
    half_made = lineage.get("half_made") or []
    if half_made:
        lines.append(f"half-made branches  {len(half_made)} (a `branch` stopped midway, or making it now)")
    for branch in half_made:
        step = "" if branch["step"] is None else f"from step {branch['step']}; "
        lines.append(f"  {branch['run']} ({step}run the same `rlhf-pipeline branch` again: it makes it whole, or "
                     f"removes it if the step is no longer kept; it holds nothing anyone reads)")
    return "\n".join(lines)
