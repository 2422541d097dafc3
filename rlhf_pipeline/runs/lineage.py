"""A run's lineage and rewind points, read without torch through the run store (a directory or a
URL alike): what ``inspect RUN`` prints. A branch names its parent in ``branch.json``; a parent's
branches are found beside it. ``docs/branching.md#comparing-a-parent-and-its-branches``.
"""

from __future__ import annotations

import fcntl
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rlhf_pipeline.files.atomic import json_object
from rlhf_pipeline.files.run_paths import RunLocationError, RunPaths, is_url, resolved_location
from rlhf_pipeline.files.run_store import RunStore
from rlhf_pipeline.files.settings_history import history_entries
from rlhf_pipeline.files.state_files import StateFileError

BRANCH_FILE = "branch.json"
BRANCH_FORMAT = 1
BRANCH_MAKING = "branch.making"  # what a branch being made is made of ({"parent", "step"}), written first
PARENT_ROWS = "parent-rows"
PARENT_ROWS_MANIFEST = f"{PARENT_ROWS}/selection.json"
READS_AT_ONCE = 16  # reads of the runs beside a run in flight at once: a home of 100 runs in ~7 round trips


def is_inside(location: str, run: str) -> bool:
    """Whether ``location`` (a path or a URL) lies inside the run at ``run``."""
    return resolved_location(location).startswith(resolved_location(run).rstrip("/") + "/")


@contextmanager
def branches_settled(run: RunStore) -> Iterator[None]:
    """Held while a run's retention looks for its branches and drops rows (``runs/retention.py``), and
    while a branch of it names the rows it reads and appears (``runs/branch.py``): so a branch is either
    seen by the look or names only rows left after the drop, never rows a drop decided without it.
    In a directory, an exclusive ``flock`` on the run's ``settings.json``, opened read-only: the parent
    stays byte-identical; a run without ``settings.json`` (none was written yet) has nothing to hold.
    An object store has no lock: there a drop is marked and ``branch`` waits for it instead
    (``retention.drop_under_way``), so this holds nothing."""
    if not run.is_local:
        yield
        return
    try:
        handle = open(run.path("settings.json"), "rb")
    except (FileNotFoundError, NotADirectoryError):
        yield
        return
    with handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)  # released when the file is closed
        yield


def run_store_at(run: str | Path) -> Any:
    """The run store of the run at ``run``: a directory (made absolute) or an ``s3://``/``az://`` URL."""
    return RunPaths.at(resolved_location(str(run))).store


def is_run(run: str | Path) -> bool:
    """Whether ``run`` (a directory or a URL) holds a run: its ``settings.json`` or ``checkpoints/``."""
    store = run_store_at(run)
    return store.exists("settings.json") or store.exists("checkpoints") or bool(store.list("checkpoints"))


class KeepsNoBuffer(ValueError):
    """A replay's run given for a buffer: it read another's and keeps none of its own."""


def buffer_of_run(location: str) -> str | None:
    """The buffer the learner of the run at ``location`` (a directory or a URL) read: its ``buffer_url``,
    else ``RUN/buffer``; None where ``location`` holds no run's ``settings.json`` (a buffer, say).
    :class:`KeepsNoBuffer` for a replay, naming the buffer it read."""
    if "://" not in location and not (Path(location) / "settings.json").is_file():
        return None
    try:
        settings = json_object(run_store_at(location).read("settings.json"))
    except RunLocationError:  # a URL no run lives at (file://, ...)
        return None
    if settings is None:
        return None
    if "replay" in settings:
        raise KeepsNoBuffer(f"{location} is a replay of {settings['replay'].get('buffer')}, which keeps no buffer "
                            f"of its own: give that buffer")
    return str(settings.get("buffer_url") or RunPaths.at(resolved_location(location)).buffer_location).rstrip("/")


def run_recording(buffer: str) -> str | None:
    """The run whose ``buffer/`` (or a shard of it) is ``buffer`` (a path or a URL), or None: what
    :func:`buffer_of_run` gives, read the other way."""
    location = resolved_location(buffer if is_url(buffer) else str(Path(buffer).expanduser())).rstrip("/")
    buffers = (location, location.rpartition("/")[0])  # the buffer, or the buffer of a shard given
    return next((b.rpartition("/")[0] for b in buffers if b.rpartition("/")[2] == "buffer"
                 and is_run(b.rpartition("/")[0])), None)


def read_parent(run: str | Path | RunStore) -> dict[str, Any] | None:
    """The ``branch.json`` of ``run`` (a directory, a URL or its run store): ``{"parent": its
    location, "step": N, "buffer_rows": {...}, ...}``, or None for a run that is no branch."""
    store = run if isinstance(run, RunStore) else run_store_at(run)
    return _lineage_at(store, "")


def _lineage_at(store: Any, prefix: str) -> dict[str, Any] | None:
    """The ``branch.json`` at ``prefix`` in ``store``; a damaged one raises one line naming it."""
    raw = store.read(f"{prefix}{BRANCH_FILE}")
    if raw is None:
        return None
    data = json_object(raw)
    if data is None or "parent" not in data or "step" not in data:
        raise ValueError(f"{store.describe(prefix + BRANCH_FILE)} is damaged (no 'parent' and 'step'); it was written "
                         f"by `rlhf-pipeline branch`: restore it, or the branch no longer knows the rows it may read")
    return data


def home_of(run: str | Path) -> tuple[Any, str]:
    """The run store of the home that holds ``run`` (its directory or URL prefix; None for a run at
    the top of a bucket, which has no runs beside it) and the run's name there."""
    location = resolved_location(str(run)).rstrip("/")
    home, _, name = location.rpartition("/")
    if "://" in location and ("://" not in home or home.endswith(":/")):
        return None, name
    return run_store_at(home or "/"), name


def runs_beside(home: Any, name: str) -> list[str]:
    """The names in the home ``home`` other than ``name`` (one listing)."""
    return [other for other in sorted(home.list("")) if other != name]


def branch_records(run: str | Path, *, half_made: bool = False, home: Any = None,
                   others: list[str] | None = None) -> list[dict[str, Any]]:
    """The branches of ``run`` beside it, each ``{"run": location, "step": N, "lineage": its
    branch.json, "half_made": False}``; with ``half_made``, also the branches ``branch`` is making or
    left half-made (``branch.making`` and no ``branch.json``), with ``"lineage": None`` and
    ``"half_made": True``. One listing of the home and a read or two per run in it, sent
    a few at a time; ``home``/``others``: the home's store and its runs, when the caller has them."""
    location = resolved_location(str(run)).rstrip("/")
    if home is None:
        home, name = home_of(location)
        if home is None:
            return []
    else:
        name = location.rpartition("/")[2]
    where = home.location.rstrip("/")

    def record_of(other: str) -> dict[str, Any] | None:
        try:
            lineage = _lineage_at(home, f"{other}/")
        except ValueError:
            return None  # a damaged branch says so when it is inspected itself
        making = json_object(home.read(f"{other}/{BRANCH_MAKING}")) if lineage is None and half_made else None
        parent = (lineage if lineage is not None else making or {}).get("parent")
        if parent is None or resolved_location(str(parent)).rstrip("/") != location:
            return None  # no branch, or another run's
        step = int(lineage["step"]) if lineage is not None else making.get("step")
        return {"run": f"{where}/{other}", "step": step, "lineage": lineage, "half_made": lineage is None}

    others = runs_beside(home, name) if others is None else others
    return read_each(record_of, others)


def read_each(read: Callable[[str], Any], others: list[str]) -> list[Any]:
    """``read(name)`` of each run beside, ``READS_AT_ONCE`` at a time: those that are not None."""
    with ThreadPoolExecutor(max_workers=max(1, min(READS_AT_ONCE, len(others)))) as pool:
        return [found for found in pool.map(read, others) if found is not None]


def run_lineage(run: str | Path) -> dict[str, Any]:
    """What ``inspect RUN`` says about a run (a directory or a URL): its rewind points, its parent,
    its branches and the branches left half-made beside it."""
    from rlhf_pipeline.learn.checkpoint import run_checkpoints

    location = resolved_location(str(run)).rstrip("/")
    paths = RunPaths.at(location)
    parent = read_parent(paths.store)
    try:
        resumed_with: list[dict[str, Any]] | str = history_entries(paths.store)
    except StateFileError as exc:  # said in its place: the rest of what inspect shows stands
        resumed_with = str(exc)
    records = branch_records(location, half_made=True)
    home = home_of(location)[0]
    return {
        "run": location,
        "rewind_points": run_checkpoints(paths).rewind_points(),
        "resumed_with": resumed_with,
        "parent": None if parent is None else {"run": parent["parent"], "step": parent["step"],
                                               "settings_changed": parent.get("settings_changed", []),
                                               # a branch of a replay counts its source's rows, not the parent's
                                               "buffer_rows": parent.get("buffer_rows")
                                               if parent.get("replay_source") is None else None},
        "branches": [{"run": b["run"], "step": b["step"], **what_branch_reads(b, location, home)}
                     for b in sorted(records, key=lambda b: (b["step"], b["run"])) if not b["half_made"]],
        "half_made": [{"run": b["run"], "step": b["step"]} for b in sorted(records, key=lambda b: b["run"])
                      if b["half_made"]],
    }


def what_branch_reads(branch: dict[str, Any], parent: str, home: Any) -> dict[str, Any]:
    """Which of ``parent``'s rows the branch (a :func:`branch_records` record) holds by reference:
    ``parent_rows`` (per shard, the rows it reads below that row, or None when it reads none: a
    replay's branch reads the replay's source), ``reads`` (a replay source inside the parent, else
    None) and ``detached``."""
    lineage = branch["lineage"]
    source = lineage.get("replay_source")
    name = branch["run"].rstrip("/").rpartition("/")[2]
    holds = source is None and home.exists(f"{name}/{PARENT_ROWS_MANIFEST}")
    return {"parent_rows": lineage.get("buffer_rows") if holds else None,
            "reads": source if source is not None and is_inside(str(source), parent) else None,
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


def _split(rows: int, inherited: int | None) -> str:
    """How a branch's checkpoint's rows of a shard divide: the parent's below the branch step, then its own."""
    if not isinstance(inherited, int) or rows < inherited:
        return ""
    return f" (the parent's {inherited}, then {rows - inherited} of its own)"


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
    # a branch's rows are the parent's below its branch step, then its own shard's: its own ids (retention's
    # first row held, the buffer's table) start at 0 again, its checkpoints count both
    inherited = (parent or {}).get("buffer_rows") or {}
    for point in points:
        rows = point.get("buffer_rows")
        where = ("  buffer rows " + ", ".join(f"{name or 'store'}={n}{_split(n, inherited.get(name))}"
                                              for name, n in sorted(rows.items()))
                 if rows is not None else "  (buffer position not recorded: a checkpoint made before records)")
        version = f"  policy version {point['policy_version']}" if "policy_version" in point else ""
        lines.append(f"  step {point['step']}{version}{where}")
    resumes = lineage.get("resumed_with") or []
    if isinstance(resumes, str):  # the history is damaged: what it says instead
        lines.append(f"resumed with other training settings  unknown: {resumes}")
        resumes = []
    if resumes:
        lines.append(f"resumed with other training settings  {len(resumes)} (settings.json has the first start's)")
    for resume in resumes:
        changed = ", ".join(f"{key}={value!r}" for key, value in sorted(resume["settings"].items()))
        lines.append(f"  after step {resume['after_step']}: {changed or 'those of settings.json again'}")
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
