"""A local run's lineage and rewind points, read without torch: what ``inspect RUN`` prints.

A branch (``runs/branch.py``) records its parent in ``<branch>/branch.json``; the parent is never
written to (its files stay byte-identical), so a parent's branches are found by looking at the runs
beside it (the same home) for a ``branch.json`` that names it. A branch made elsewhere is not found
from its parent, but still names its parent itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlhf_pipeline.learn.checkpoint import CheckpointManager

BRANCH_FILE = "branch.json"
BRANCH_FORMAT = 1


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


def run_lineage(run: str | Path) -> dict[str, Any]:
    """What ``inspect RUN`` says about a run directory: its rewind points, its parent, its branches."""
    run = Path(run).resolve()
    parent = read_parent(run)
    return {
        "run": str(run),
        "rewind_points": CheckpointManager(run / "checkpoints").rewind_points(),
        "parent": None if parent is None else {"run": parent["parent"], "step": parent["step"],
                                               "settings_changed": parent.get("settings_changed", [])},
        "branches": find_branches(run),
    }


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
    lines += [f"  {b['run']} (from step {b['step']})" for b in branches]
    return "\n".join(lines)
