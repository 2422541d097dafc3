"""The lineage of a run at a URL (``s3://``, ``az://``), as ``runs/lineage.py`` gives a local
run's: its rewind points, its parent (its ``branch.json``) and its branches, found among the runs
beside it (the runs under the same URL prefix) by their ``branch.json``. The parent is never
written to, so nothing in it names its branches."""

from __future__ import annotations

from typing import Any

from rlhf_pipeline.files.atomic import json_object
from rlhf_pipeline.files.run_paths import RunPaths
from rlhf_pipeline.runs.lineage import BRANCH_FILE

READS_AT_ONCE = 16  # reads of the runs beside a run in flight at once: a home of 100 runs in ~7 round trips


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
    found = [{"run": b["run"], "step": b["step"]} for b in branch_records_at_url(url) if not b["half_made"]]
    return sorted(found, key=lambda b: (b["step"], b["run"]))


def branch_records_at_url(url: str, *, half_made: bool = False, home_store: Any = None,
                          others: list[str] | None = None) -> list[dict[str, Any]]:
    """The branches of the run at ``url`` beside it, each ``{"run": URL, "step": N, "lineage":
    its branch.json, "half_made": False}``; with ``half_made``, also the branches ``branch`` is
    making (or left half-made): ``branch.making`` and no ``branch.json``, with ``"lineage": None``
    and ``"half_made": True``. One listing of the home and one read per run in it (two for a run
    that is no branch, with ``half_made``), sent a few at a time; ``home_store``: the home's
    ``ObjectRunStore`` to send them with (one is made when None); ``others``: the runs beside it, when
    the caller has listed them (:func:`runs_beside`)."""
    from concurrent.futures import ThreadPoolExecutor

    from rlhf_pipeline.files.object_run_store import ObjectRunStore
    from rlhf_pipeline.runs.branch_reads import BRANCH_MAKING, making_record

    url = url.rstrip("/")
    home, _, name = url.rpartition("/")
    if "://" not in home or home.endswith(":/"):  # a run at the top of a bucket has no runs beside it
        return []
    store = home_store if home_store is not None else ObjectRunStore(home)

    def record_of(other: str) -> dict[str, Any] | None:
        try:
            lineage = _parent_of(store, f"{other}/", f"{home}/{other}")
        except ValueError:
            return None  # a damaged branch says so when it is inspected itself
        making = making_record(store.read(f"{other}/{BRANCH_MAKING}")) if lineage is None and half_made else None
        named = lineage if lineage is not None else making
        if named is None or str(named.get("parent", "")).rstrip("/") != url:
            return None
        return {"run": f"{home}/{other}", "step": int(named.get("step", 0)), "lineage": lineage,
                "half_made": lineage is None}

    others = runs_beside(store, name) if others is None else others
    with ThreadPoolExecutor(max_workers=max(1, min(READS_AT_ONCE, len(others)))) as pool:
        return [found for found in pool.map(record_of, others) if found is not None]


def runs_beside(home_store: Any, name: str) -> list[str]:
    """The names of the runs in the home ``home_store`` other than ``name`` (one listing)."""
    return [other for other in sorted(home_store.list("")) if other != name]


def url_run_lineage(url: str) -> dict[str, Any]:
    """What ``inspect URL`` says about a run at a URL: the same fields as ``lineage.run_lineage``."""
    from rlhf_pipeline.learn.checkpoint import run_checkpoints

    paths = RunPaths.at_url(url)
    parent = read_parent_at_url(paths.url)
    records = sorted(branch_records_at_url(paths.url, half_made=True), key=lambda b: (b["step"], b["run"]))
    return {
        "run": paths.url,
        "rewind_points": run_checkpoints(paths).rewind_points(),
        "parent": None if parent is None else {"run": parent["parent"], "step": parent["step"],
                                               "settings_changed": parent.get("settings_changed", [])},
        "branches": [_what_branch_reads(b) for b in records if not b["half_made"]],
        "half_made": [{"run": b["run"], "step": b["step"]} for b in records if b["half_made"]],
    }


def _what_branch_reads(branch: dict[str, Any]) -> dict[str, Any]:
    """``lineage.what_branch_reads`` for a branch at a URL: a branch of a run with collectors holds
    the parent's rows its ``parent-rows/`` names (a replay's branch reads the replay's source)."""
    from rlhf_pipeline.files.object_run_store import ObjectRunStore
    from rlhf_pipeline.runs.branch_reads import PARENT_ROWS_MANIFEST

    lineage = branch["lineage"]
    holds = lineage.get("replay_source") is None and ObjectRunStore(branch["run"]).exists(PARENT_ROWS_MANIFEST)
    return {"run": branch["run"], "step": branch["step"], "parent_rows": lineage.get("buffer_rows") if holds else None,
            "reads": None, "detached": bool(lineage.get("detached"))}


def _parent_of(store, prefix: str, where: str) -> dict[str, Any] | None:
    raw = store.read(f"{prefix}{BRANCH_FILE}")
    if raw is None:
        return None
    data = json_object(raw)
    if data is None or "parent" not in data or "step" not in data:
        raise ValueError(f"{where}/{BRANCH_FILE} is damaged (no 'parent' and 'step'); it was written by "
                         f"`rlhf-pipeline branch`: restore it, or the branch no longer knows where it came from")
    return data
