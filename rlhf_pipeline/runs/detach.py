"""``rlhf-pipeline detach BRANCH``: makes a branch self-contained, so that its parent may be
deleted or prune what the branch read by reference.

A branch (``runs/branch.py``) holds its own link or copy of its checkpoint and weights; what it
still reads in its parent is the parent's rows, through ``parent-rows/`` (a branch of a run with
collectors: a saved selection naming, by global id, the rows each parent shard had published at
the branch step). Detaching copies those rows, in the selection's order, into the branch's own
store ``own-rows/`` and points ``parent-rows/`` at it; ``replay --buffer BRANCH/parent-rows``
then reads the same rows at the same positions (the same batches after a resume: the selection
keeps the identity its checkpoints recorded), and nothing under the parent's directory.
``branch.json`` keeps the parent and the step (``inspect`` and ``plot`` still show the lineage)
and gains ``detached`` (when, how many rows, where to). A branch of a replay reads nothing of its
parent (its source is the replay's, read-only): detaching it only records that.

Crash-safe: each step leaves the branch usable and ``detach`` re-runnable, one switch at a time:

1. the rows are copied to a memmap store ``own-rows.partial``, renamed ``own-rows``
   when complete; a kill leaves ``parent-rows/`` as it was, and the next ``detach`` deletes the
   partial copy and starts again;
2. the selection of every row of ``own-rows`` (one range of ids: ``storage/row_ranges.py``, a few
   hundred bytes at any size, no per-row ids file) replaces ``parent-rows/selection.json`` whole
   (one atomic rename): before it, the branch reads the parent; after it, its own copy. A branch
   detached before ranges names its copy's rows one by one in ``parent-rows/own-rows.npy``; it
   opens as before;
3. ``branch.json`` is rewritten (atomically) with ``detached``; then the parent's ids files of
   the old selection, which nothing names any more, are deleted.

At a URL (``runs/branch_url.py``) the same steps, with ``own-rows/`` a Zarr store at the branch's
URL: there is no rename there, so a copy found unswitched is kept when it holds every row and
deleted and made again otherwise; the switch is one PUT of ``parent-rows/selection.json``.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from rlhf_pipeline.files.atomic import PARTIAL_SUFFIX, publish_json
from rlhf_pipeline.files.run_paths import is_url
from rlhf_pipeline.runs.branch import PARENT_ROWS, BranchError
from rlhf_pipeline.runs.lineage import BRANCH_FILE, read_parent

OWN_ROWS = "own-rows"
OWN_IDS = "own-rows.npy"  # the per-row ids of a copy, as detach wrote them before ranges
SWITCHED = "detached_into"  # in a switched selection's manifest: the copy it reads (OWN_ROWS)


def detach(branch: str | Path) -> dict[str, Any]:
    """Makes ``branch`` self-contained (module docstring); returns the ``detached`` record."""
    if is_url(str(branch)):
        return _detach_at_url(str(branch).rstrip("/"))
    branch = Path(branch).resolve()
    try:
        lineage = read_parent(branch)
    except (ValueError, OSError) as exc:
        raise BranchError(str(exc)) from None
    if lineage is None:
        raise BranchError(f"{branch} is no branch (no {BRANCH_FILE}); detach takes a run made by `rlhf-pipeline "
                          f"branch`")
    if lineage.get("detached"):
        _forget_parent_ids(branch / PARENT_ROWS)  # a kill after step 3 left them
        return lineage["detached"]
    _refuse_source_in_parent(lineage, str(branch), Path(lineage["parent"]).resolve())
    selection = branch / PARENT_ROWS
    rows = _own_selection(selection, branch / OWN_ROWS) if selection.is_dir() else 0
    detached = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows_copied": rows,
                "rows_in": str(branch / OWN_ROWS) if rows else None}
    publish_json(branch / BRANCH_FILE, {**lineage, "detached": detached})
    _forget_parent_ids(selection)
    return detached


def _refuse_source_in_parent(lineage: dict[str, Any], branch: str, parent: Path | str) -> None:
    """A branch of a replay whose source lies in its parent (a branch of a branch replayed over its own
    ``parent-rows/``) reads that source at every start; copying it would change the replay's --buffer."""
    source = lineage.get("replay_source")
    if source is None:
        return
    inside = source.startswith(f"{parent}/") if is_url(source) else Path(source).resolve().is_relative_to(parent)
    if inside:
        raise BranchError(
            f"{branch} replays {source}, which is part of its parent {parent}: detach the parent first (then its "
            f"rows are its own), and keep the parent; the branch reads them at every start")


def _own_selection(selection: Path, own: Path) -> int:
    """Steps 1 and 2: the selection's rows copied into ``own``, and the selection switched to it."""
    from rlhf_pipeline.storage import open_buffer
    from rlhf_pipeline.storage.manifest import read_json
    from rlhf_pipeline.storage.selection import MANIFEST_NAME

    manifest = read_json(selection / MANIFEST_NAME, what="saved selection")
    if _switched(manifest):  # a kill before step 3
        return int(manifest["rows"])
    partial = own.with_name(own.name + PARTIAL_SUFFIX)
    if partial.exists():
        shutil.rmtree(partial)  # a copy a kill interrupted
    if own.exists():  # complete (renamed only then), but the switch did not happen: check it is whole
        with open_buffer(own, mode="r") as copied:
            if len(copied) != int(manifest["rows"]):
                shutil.rmtree(own)
    if not own.exists():
        _copy_rows(selection, partial)
        partial.replace(own)
    staged = selection.with_name(selection.name + ".detaching")  # the new selection, written whole, then moved in
    switched = _selection_over(own, staged, manifest)
    switched["source"]["relative"] = f"../{OWN_ROWS}"
    for part in switched["parts"]:
        part["relative"] = f"../{OWN_ROWS}"
    publish_json(selection / MANIFEST_NAME, switched)  # the switch: one rename
    shutil.rmtree(staged)
    return int(switched["rows"])


def _selection_over(own: str | Path, staged: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest of the selection of every row of the copy ``own`` (written at ``staged``, a
    scratch directory): one range of ids, marked as the switch, keeping the identity of the rows
    first selected (``manifest``'s), which resumed checkpoints check."""
    from rlhf_pipeline.storage import open_buffer
    from rlhf_pipeline.storage.manifest import read_json
    from rlhf_pipeline.storage.selection import MANIFEST_NAME, write_range_selection

    if staged.exists():
        shutil.rmtree(staged)
    with open_buffer(own, mode="r") as copied:
        write_range_selection(staged, copied, {0: (copied.first_row, copied.next_row)},
                              where=f"{manifest.get('where', '')} (detached: the branch's own copy)",
                              source_location=str(own))
    switched = read_json(staged / MANIFEST_NAME, what="saved selection")
    switched.update({SWITCHED: OWN_ROWS, "rows_identity_crc32": int(
        manifest.get("rows_identity_crc32", manifest["rows_crc32"]))})
    return switched


def _switched(manifest: dict[str, Any]) -> bool:
    """Whether ``parent-rows/``'s manifest already names the branch's own copy (either form)."""
    return manifest.get(SWITCHED) == OWN_ROWS or manifest.get("rows_file") == OWN_IDS


def _copy_rows(selection: Path | str, target: Path | str, backend: str = "memmap", rows_per_step: int = 4096) -> None:
    """The selection's rows, in its order, into a new store, a bounded slice at a time."""
    from rlhf_pipeline.storage import create_store, open_buffer

    with open_buffer(str(selection), mode="r") as source, \
            create_store(target, backend, schema=source.schema, segment_rows=rows_per_step) as copy:
        for start in range(0, len(source), rows_per_step):
            import torch

            copy.append(source.read(torch.arange(start, min(len(source), start + rows_per_step))))


def _forget_parent_ids(selection: Path) -> None:
    from rlhf_pipeline.storage.selection import PARTS_NAME, ROWS_NAME

    for name in (ROWS_NAME, PARTS_NAME):
        (selection / name).unlink(missing_ok=True)
    staged = selection.with_name(selection.name + ".detaching")
    if staged.exists():
        shutil.rmtree(staged)


def _detach_at_url(url: str) -> dict[str, Any]:
    """At a URL: the same three steps, with a Zarr store ``own-rows/`` at the branch's URL (whole or
    deleted and copied again: no rename there), the switch one PUT of ``parent-rows/selection.json``."""
    from rlhf_pipeline.files.object_run_store import ObjectRunStore
    from rlhf_pipeline.runs.lineage_url import read_parent_at_url

    try:
        lineage = read_parent_at_url(url)
    except ValueError as exc:
        raise BranchError(str(exc)) from None
    if lineage is None:
        raise BranchError(f"{url} is no branch (no {BRANCH_FILE}); detach takes a run made by `rlhf-pipeline branch`")
    store = ObjectRunStore(url)
    if not lineage.get("detached"):
        _refuse_source_in_parent(lineage, url, str(lineage["parent"]).rstrip("/"))
        rows = _own_selection_at_url(url, store) if store.exists(f"{PARENT_ROWS}/selection.json") else 0
        lineage["detached"] = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows_copied": rows,
                               "rows_in": f"{url}/{OWN_ROWS}" if rows else None}
        store.write(BRANCH_FILE, json.dumps(lineage, indent=2, sort_keys=True).encode())
    for name in ("rows.npy", "parts.npy"):  # the parent's ids: nothing names them any more
        store.delete(f"{PARENT_ROWS}/{name}")
    return lineage["detached"]


def _own_selection_at_url(url: str, store) -> int:
    import tempfile

    from rlhf_pipeline.runs.branch_url import walk
    from rlhf_pipeline.storage import open_buffer

    manifest = json.loads(store.read(f"{PARENT_ROWS}/selection.json"))
    if _switched(manifest):  # a kill before branch.json
        return int(manifest["rows"])
    own = f"{url}/{OWN_ROWS}"
    leftover = walk(store, OWN_ROWS)
    if leftover:
        try:
            with open_buffer(own, mode="r") as copied:
                whole = len(copied) == int(manifest["rows"])
        except Exception:  # a copy a kill interrupted before it was a store
            whole = False
        if not whole:
            for key in leftover:
                store.delete(key)
    if not leftover or not whole:
        _copy_rows(f"{url}/{PARENT_ROWS}", own, backend="zarr")
    with tempfile.TemporaryDirectory() as scratch:
        switched = _selection_over(own, Path(scratch) / "selection", manifest)
    store.write(f"{PARENT_ROWS}/selection.json", json.dumps(switched, sort_keys=True).encode(), fence=False)
    return int(switched["rows"])
