"""The lineage of a run at a URL (``s3://``, ``az://``), as ``runs/lineage.py`` gives a local
run's: its rewind points, its parent (its ``branch.json``) and its branches, found among the runs
beside it (the runs under the same URL prefix) by their ``branch.json``. The parent is never
written to, so nothing in it names its branches."""

from __future__ import annotations

import json
from typing import Any

from rlhf_pipeline.files.run_paths import RunPaths
from rlhf_pipeline.runs.lineage import BRANCH_FILE


def is_run_at_url(url: str) -> bool:
    """Whether ``url`` holds a run: its ``settings.json`` or a checkpoint."""
    paths = RunPaths.at_url(url)
    return paths.store.exists("settings.json") or bool(paths.store.list("checkpoints"))


def read_parent_at_url(url: str) -> dict[str, Any] | None:
    """The ``branch.json`` of the run at ``url``, or None for a run that is no branch."""
    from rlhf_pipeline.files.object_run_store import ObjectRunStore

    return _parent_of(ObjectRunStore(url.rstrip("/")), "", url)


def find_branches_at_url(url: str) -> list[dict[str, Any]]:
    """The branches of the run at ``url`` among the runs beside it: ``{"run": URL, "step": N}``,
    by step then URL (one listing of the home, one read per run in it)."""
    from rlhf_pipeline.files.object_run_store import ObjectRunStore

    url = url.rstrip("/")
    home, _, name = url.rpartition("/")
    if "://" not in home or home.endswith(":/"):  # a run at the top of a bucket has no runs beside it
        return []
    store = ObjectRunStore(home)
    found = []
    for other in sorted(store.list("")):
        if other == name:
            continue
        try:
            parent = _parent_of(store, f"{other}/", f"{home}/{other}")
        except ValueError:
            continue  # a damaged branch says so when it is inspected itself
        if parent is not None and str(parent["parent"]).rstrip("/") == url:
            found.append({"run": f"{home}/{other}", "step": int(parent["step"])})  # find_branches' fields
    return sorted(found, key=lambda b: (b["step"], b["run"]))


def url_run_lineage(url: str) -> dict[str, Any]:
    """What ``inspect URL`` says about a run at a URL: the same fields as ``lineage.run_lineage``."""
    from rlhf_pipeline.learn.checkpoint import run_checkpoints

    paths = RunPaths.at_url(url)
    parent = read_parent_at_url(paths.url)
    return {
        "run": paths.url,
        "rewind_points": run_checkpoints(paths).rewind_points(),
        "parent": None if parent is None else {"run": parent["parent"], "step": parent["step"],
                                               "settings_changed": parent.get("settings_changed", [])},
        # a branch at a URL is a replay's (runs/branch_url.py): it holds none of the parent's rows
        "branches": [{**b, "parent_rows": None, "reads": None,
                      "detached": bool((read_parent_at_url(b["run"]) or {}).get("detached"))}
                     for b in find_branches_at_url(paths.url)],
    }


def _parent_of(store, prefix: str, where: str) -> dict[str, Any] | None:
    raw = store.read(f"{prefix}{BRANCH_FILE}")
    if raw is None:
        return None
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        data = None
    if not isinstance(data, dict) or "parent" not in data or "step" not in data:
        raise ValueError(f"{where}/{BRANCH_FILE} is damaged (no 'parent' and 'step'); it was written by "
                         f"`rlhf-pipeline branch`: restore it, or the branch no longer knows where it came from")
    return data
