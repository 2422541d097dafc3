"""``rlhf-pipeline branch s3://.../parent --from-step N s3://.../new``: a branch of a run at a URL,
at a URL beside it (``runs/branch.py`` has what a branch is; this is how one is made where there
are no directories, no renames and no hard links).

What changes at a URL:

* **copies, not links.** The checkpoint of step N, its rewind record, the weights of its policy
  version, the pipeline copy and the log parts are copied object by object, server-side where the
  cloud has a copy (S3's CopyObject: the bytes never travel through this machine; Azure goes
  through the client, a GET then a PUT: ``files/cloud_base.py``). A copy is the branch's own: the
  parent pruning its checkpoint or weights later takes nothing from it.
* **made in place, finished by ``branch.json``.** There is no rename of a whole prefix, so the
  branch is written where it will live: first ``branch.making`` (what is being made, from where),
  then its objects, then ``branch.json`` (created last: a branch with it is whole), then
  ``branch.making`` is deleted. A branch killed midway holds ``branch.making`` and no
  ``branch.json``: ``replay`` and ``run`` refuse it in one line (:func:`half_made_branch`), and
  ``branch`` with the same NEW removes its objects and makes it again.
* **a parent with collectors** (its Zarr buffer at the URL): ``parent-rows/`` is the saved
  selection of its rows published at step N, kept at the branch's URL (``storage/selection_url.py``)
  and naming the parent's shards at their URLs, read in place. The branch continues offline with
  ``replay --buffer NEW/parent-rows``, or online with ``run`` (``runs/branch_online_url.py``).
* **both at URLs of one cloud, or both local.** A parent finds its branches beside it (``inspect``),
  and a branch on another kind of storage than its parent would be found by neither; copy the run
  first (``convert``/``export`` its buffer, ``replay --init-from``) to move it.

The parent is only read (objects listed, read and copied from): its objects and their etags are
the same before and after.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from rlhf_pipeline.files.atomic import json_object
from rlhf_pipeline.files.object_run_store import ObjectRunStore
from rlhf_pipeline.files.run_paths import RunPaths, is_url
from rlhf_pipeline.runs.branch import (
    PARENT_ROWS,
    BranchError,
    changed_settings,
    half_made_removed,
    write_parent_rows,
)
from rlhf_pipeline.runs.lineage import BRANCH_FILE, BRANCH_FORMAT

MAKING = "branch.making"
_LOGS = ("metrics.jsonl", "batches.jsonl")
_MODULES = "pipeline_modules"


def check_same_kind(parent: str, new: str) -> None:
    """A parent at a URL branches at a URL of the same cloud; a local parent branches locally."""
    if is_url(parent) != is_url(new):
        where, other = (parent, new) if is_url(parent) else (new, parent)
        raise BranchError(
            f"RUN and NEW_RUN must both be local directories or both URLs ({where} is a URL, {other} is not): a "
            f"parent finds its branches beside it, and a branch elsewhere would be found by neither. Give NEW_RUN as "
            f"a name (made beside RUN) or a URL beside it")
    if is_url(parent) and parent.split("://", 1)[0] != new.split("://", 1)[0]:
        raise BranchError(f"RUN {parent} and NEW_RUN {new} are on different clouds; branch within one "
                          f"(give NEW_RUN as a name: it is made beside RUN)")


def branch_at_url(parent_url: str, step: int, new_url: str, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Makes the branch ``new_url`` of the run at ``parent_url`` from its checkpoint of ``step``
    (module docstring); returns its ``branch.json``."""
    check_same_kind(parent_url, new_url)
    parent, new = RunPaths.at_url(parent_url), RunPaths.at_url(new_url)
    if parent.url == new.url:
        raise BranchError(f"NEW_RUN is RUN ({new.url}); a branch is a new run: choose another name")
    source, target = parent.store, new.store
    if source.exists(MAKING) and not source.exists(BRANCH_FILE):
        raise BranchError(f"{parent.url} is a branch left half-made ({MAKING}, no {BRANCH_FILE}); make it again with "
                          f"`rlhf-pipeline branch` first")
    saved_text = source.read("settings.json")
    if saved_text is None:
        raise BranchError(f"{parent.url} holds no run (no settings.json); give the URL of a run, e.g. "
                          f"s3://BUCKET/runs/<run-name>")
    saved = json.loads(saved_text)
    from rlhf_pipeline.learn.checkpoint import run_checkpoints

    checkpoints = run_checkpoints(parent)
    if checkpoints.path_of(step) is None:
        kept = ", ".join(str(s) for s in checkpoints.steps()) or "none"
        reason = (f"{parent.url} keeps no checkpoint of step {step} (kept: {kept}); branch from one of those, or keep "
                  f"more with learner.checkpoint_keep_every=M (every M-th step)")
        # a branch of it left half-made there cannot be made any more, and no rerun would remove it
        raise BranchError(half_made_removed(reason, new.url) if _remove_half_made(target, parent.url) else reason)
    if saved.get("replay", {}).get("buffer") is None:
        _refuse_continued_online(parent, saved)
    _clear_place(target, new.url)
    settings, changed = _url_changes(parent, saved, overrides) if overrides else (saved, [])
    record = checkpoints.record(step) or {}
    lineage = {
        "format": BRANCH_FORMAT, "parent": parent.url, "step": step,
        "policy_version": record.get("policy_version"), "buffer_rows": record.get("buffer_rows"),
        "replay_source": saved.get("replay", {}).get("buffer"), "settings_changed": changed,
        "overrides": list(overrides), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    target.create(MAKING, json.dumps({"parent": parent.url, "step": step}).encode())
    try:
        _copy_branch(source, target, step, lineage["policy_version"])
        if lineage["replay_source"] is None:  # a run with collectors: its rows up to the step, by reference
            from rlhf_pipeline.runs.retention_url import wait_for_drops

            # our branch.making is up: a drop decided from here on sees it; one under way ends first
            wait_for_drops(source, (lineage["buffer_rows"] or {}).keys())
            _parent_rows_at_url(saved.get("buffer_url") or f"{parent.url}/buffer", f"{new.url}/{PARENT_ROWS}",
                                lineage["buffer_rows"], step, new)
    except FileNotFoundError as exc:  # the running parent pruned that checkpoint (or weights) meanwhile
        raise BranchError(f"{exc.filename} went away while branching (the parent is running and pruned it); "
                          f"branch from a step it keeps; {new.url} is left half-made: `branch` again removes it"
                          ) from None
    target.create("settings.json", json.dumps(settings, indent=2, sort_keys=True).encode())
    target.create(BRANCH_FILE, json.dumps(lineage, indent=2, sort_keys=True).encode())  # last: the branch is whole
    target.delete(MAKING)
    return lineage


def _refuse_continued_online(parent: RunPaths, saved: dict[str, Any]) -> None:
    """A branch continued online (``runs/branch_online_url.py``) is not branched again yet: its rows
    are partly its parent's."""
    from rlhf_pipeline.storage.continues import continued_rows

    continues = continued_rows(saved.get("buffer_url") or f"{parent.url}/buffer")
    if continues is not None:
        grandparent = str(continues["parent_buffer"]).rstrip("/").rpartition("/")[0]
        raise BranchError(f"{parent.url} is a branch continued online: its rows are partly its parent's, and "
                          f"branching it is not there yet; branch its parent ({grandparent}) instead")


def _parent_rows_at_url(buffer: str, url: str, buffer_rows: dict[str, int] | None, step: int,
                        new: RunPaths) -> None:
    """``parent-rows/`` at the branch's URL: the saved selection of the parent's rows published at
    ``step``, naming the parent's shards at their URLs (read in place), written in this machine's
    cache of the branch and uploaded (``storage/selection_url.py``)."""
    import shutil

    from rlhf_pipeline.storage.selection_url import upload_selection

    if buffer_rows is None:
        raise BranchError(f"the checkpoint of step {step} has no rewind record (a run made before records): which "
                          f"of its rows were published at that step is not known; branch from a later step")
    local = new.root / PARENT_ROWS
    if local.exists():
        shutil.rmtree(local)
    new.root.mkdir(parents=True, exist_ok=True)
    write_parent_rows(buffer, local, buffer_rows, step)
    upload_selection(local, url)


def _url_changes(parent: RunPaths, saved: dict[str, Any], overrides: Sequence[str]) -> tuple[dict, list[str]]:
    """:func:`changed_settings` for a parent at a URL: its pipeline copy is read into this machine's
    cache of the run first (the parent's own file checks each name and value)."""
    from rlhf_pipeline.runs.pipeline_copy import importable_copy

    pipeline = parent.store.read("pipeline.py")
    if pipeline is None:
        raise BranchError(f"{parent.url} keeps no pipeline.py: its settings cannot be checked for --set")
    parent.root.mkdir(parents=True, exist_ok=True)
    (parent.root / "pipeline.py").write_bytes(pipeline)
    importable_copy(parent)  # the modules it imports, into the same cache
    return changed_settings(parent.root, saved, overrides)


def _clear_place(target: ObjectRunStore, url: str) -> None:
    """NEW must hold nothing, or a branch left half-made (then its objects are removed)."""
    keys = walk(target, "")
    if not keys:
        return
    if MAKING not in keys or BRANCH_FILE in keys:
        raise BranchError(f"{url} holds objects already; a branch is a new run: choose another NEW_RUN name")
    print(f"[branch] {url} holds a branch left half-made ({MAKING}, no {BRANCH_FILE}): removing its "
          f"{len(keys)} objects and making it again", file=sys.stderr)
    _delete(target, keys)


def _remove_half_made(target: ObjectRunStore, parent_url: str) -> bool:
    """Removes the branch of ``parent_url`` left half-made at ``target`` (``branch.making``, no
    ``branch.json``), if there is one; whether it did."""
    from rlhf_pipeline.runs.branch_reads import making_record

    keys = walk(target, "")
    if MAKING not in keys or BRANCH_FILE in keys:
        return False
    if str((making_record(target.read(MAKING)) or {}).get("parent", parent_url)).rstrip("/") != parent_url:
        return False  # another parent's
    _delete(target, keys)
    return True


def _delete(target: ObjectRunStore, keys: list[str]) -> None:
    for key in sorted(keys, key=lambda k: k == MAKING):  # the marker last: a kill here is still recognisable
        target.delete(key)


def _copy_branch(source: ObjectRunStore, target: ObjectRunStore, step: int, version: int | None) -> None:
    from rlhf_pipeline.learn.metrics import truncate_metrics

    for key in ["pipeline.py", *walk(source, _MODULES)]:
        if key == "pipeline.py" and not source.exists(key):
            continue
        target.copy(key, key, source=source)
    checkpoint = f"checkpoints/step_{step:08d}.pt"
    target.copy(checkpoint, checkpoint, source=source)
    if source.exists(checkpoint[:-3] + ".json"):
        target.copy(checkpoint[:-3] + ".json", checkpoint[:-3] + ".json", source=source)
    for log in _LOGS:  # the lines of steps up to the branch point: the resumed learner writes the later ones
        for key in walk(source, f"{log}.parts"):
            target.copy(key, key, source=source)
        truncate_metrics(log, step, store=target)
    _copy_weights(source, target, checkpoint, version)


def _copy_weights(source: ObjectRunStore, target: ObjectRunStore, checkpoint: str, version: int | None) -> None:
    """The checkpoint's policy as the branch's newest weights version: the parent's object while it
    keeps it, else written from the checkpoint's model (the parent prunes old versions)."""
    from rlhf_pipeline.coordination.weights import WEIGHTS, publish_weights

    if version is not None:
        name = next((n for n in source.list(WEIGHTS) if n.startswith(f"policy_{version:08d}.")), None)
        if name is not None:
            target.copy(f"{WEIGHTS}/{name}", f"{WEIGHTS}/{name}", source=source)
            return
    from rlhf_pipeline.files.state_files import load_state_bytes

    state = load_state_bytes(target.read(checkpoint), what="learner checkpoint", where=target.describe(checkpoint),
                             legacy_numpy_arrays=True)
    publish_weights(target, state["model"], int(state["progress"]["policy_version"]))


def walk(store: ObjectRunStore, prefix: str) -> list[str]:
    """Every object key under ``prefix`` (``""``: the whole run), at any depth."""
    found, pending = [], [prefix.strip("/")]
    while pending:
        here = pending.pop()
        objects = store.list_etags(here)
        for name in store.list(here):
            key = f"{here}/{name}" if here else name
            (found if name in objects else pending).append(key)
    return found


def half_made_branch(paths: RunPaths) -> str | None:
    """The line ``replay``/``run`` print for a run at a URL that is a branch left half-made, else None."""
    if paths.url is None or not paths.store.exists(MAKING) or paths.store.exists(BRANCH_FILE):
        return None
    return (f"{paths.url} is a branch left half-made ({MAKING}, no {BRANCH_FILE}: `branch` was stopped while making "
            f"it); run the same `rlhf-pipeline branch ... {paths.url}` again: it removes it and makes it whole")


def offline_branch_of(paths: RunPaths) -> dict[str, Any] | None:
    """``branch.offline_branch`` for a run directory or a run at a URL: the ``branch.json`` of a branch
    of a run with collectors (it continues with ``replay`` over its ``parent-rows/``), else None."""
    from rlhf_pipeline.runs.branch import offline_branch

    if paths.url is None:
        return offline_branch(paths.root)
    raw = paths.store.read(BRANCH_FILE)
    lineage = json_object(raw)
    if raw is not None and not (lineage is not None and "parent" in lineage and "step" in lineage):
        raise BranchError(f"{paths.url}/{BRANCH_FILE} is damaged (no 'parent' and 'step'); it was written by "
                          f"`rlhf-pipeline branch`: restore it, or the branch no longer knows the rows it may read")
    return lineage if lineage is not None and lineage.get("replay_source") is None else None


def refuse_at_url(paths: RunPaths) -> str | None:
    """What ``run``/``collect``/``learn`` refuse at a URL, as ``branch.refuse_online_start`` does in a
    directory: a half-made branch. (A branch of a run with collectors is then set up to continue
    online: ``runs/branch_online_url.py``'s :func:`start_online_at_url`.)"""
    return half_made_branch(paths)


def url_message(new_url: str, lineage: dict[str, Any]) -> None:
    """What ``branch`` prints for a branch at a URL: where from, and the parent's command that
    continues it (``runs/branch_command.py``), the pipeline file given as PIPELINE.py: the run
    keeps its copy at its URL, and any machine may continue it."""
    from rlhf_pipeline.pipeline import PipelineError
    from rlhf_pipeline.runs.branch_command import branch_commands, describe, not_rebuilt

    changed = "; ".join(lineage["settings_changed"]) or "no setting changed"
    print(f"[branch] {new_url}: from {lineage['parent']} at step {lineage['step']} ({changed})", file=sys.stderr)
    try:
        commands = branch_commands(RunPaths.at_url(new_url), lineage, f"{new_url}/{PARENT_ROWS}")
    except (PipelineError, ValueError, OSError) as exc:
        print(f"[branch] {not_rebuilt(lineage['overrides'], exc)}", file=sys.stderr)
        return
    note = f" (PIPELINE.py: the parent's pipeline file, kept at {new_url}/pipeline.py)"
    print(f"[branch] {describe(commands, lineage['step'], note)}", file=sys.stderr)
