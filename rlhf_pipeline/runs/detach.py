"""``rlhf-pipeline detach BRANCH``: copies the parent rows a branch reads into its own ``own-rows/`` and
switches ``parent-rows/`` to it, one crash-safe step at a time (copy, then one atomic switch of the
selection's manifest, then ``branch.json``). ``docs/branching.md#making-a-branch-self-contained``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from rlhf_pipeline.files.atomic import PARTIAL_SUFFIX
from rlhf_pipeline.runs.branch import BranchError
from rlhf_pipeline.runs.lineage import BRANCH_FILE, PARENT_ROWS, is_inside, read_parent, resolved_location, run_store_at

OWN_ROWS = "own-rows"
SELECTION_FILES = ("selection.json", "rows.npy", "parts.npy")  # storage/selection.py's MANIFEST_NAME, ROWS_NAME, PARTS_NAME
OWN_IDS = "own-rows.npy"  # the per-row ids of a copy, as detach wrote them before ranges
SWITCHED = "detached_into"  # in a switched selection's manifest: the copy it reads (OWN_ROWS)


def detach(branch: str | Path) -> tuple[dict[str, Any], bool]:
    """Makes ``branch`` (a directory or a URL) self-contained; returns the ``detached`` record and whether
    this call made it (False: an earlier detach had, and this one only finished what it may have left)."""
    location = resolved_location(str(branch)).rstrip("/")
    store = run_store_at(location)
    try:
        lineage = read_parent(store)
    except (ValueError, OSError) as exc:
        raise BranchError(str(exc)) from None
    if lineage is None:
        raise BranchError(f"{location} is no branch (no {BRANCH_FILE}); detach takes a run made by `rlhf-pipeline "
                          f"branch`")
    already = bool(lineage.get("detached"))
    if not already:
        source = lineage.get("replay_source")
        if source is not None and is_inside(str(source), str(lineage["parent"])):
            # a branch of a branch replayed over its own parent-rows/ reads that source at every start;
            # copying it would change the replay's --buffer
            raise BranchError(
                f"{location} replays {source}, which is part of its parent {lineage['parent']}: detach the parent "
                f"first (then its rows are its own), and keep the parent; the branch reads them at every start")
        rows = _own_selection(store, location) if store.exists(f"{PARENT_ROWS}/{SELECTION_FILES[0]}") else 0
        lineage["detached"] = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows_copied": rows,
                               "rows_in": f"{location}/{OWN_ROWS}" if rows else None}
        store.write(BRANCH_FILE, json.dumps(lineage, indent=2, sort_keys=True).encode())
    for name in SELECTION_FILES[1:]:  # the parent's ids of the old selection: nothing names them any more
        store.delete(f"{PARENT_ROWS}/{name}")
    return lineage["detached"], not already


def _own_selection(store: Any, location: str) -> int:
    """Steps 1 and 2: the selection's rows copied into ``own-rows``, and the selection switched to it."""
    from rlhf_pipeline.storage import open_buffer

    manifest = json.loads(store.read(f"{PARENT_ROWS}/{SELECTION_FILES[0]}"))
    if _switched(manifest):  # a kill before step 3
        return int(manifest["rows"])
    own = f"{location}/{OWN_ROWS}"
    copied_whole = False
    if store.walk(OWN_ROWS):  # a copy made before a kill: kept when it holds every row
        try:
            with open_buffer(own, mode="r") as copied:
                copied_whole = len(copied) == int(manifest["rows"])
        except Exception:  # a copy a kill interrupted before it was a store
            copied_whole = False
        if not copied_whole:
            store.delete_prefix(OWN_ROWS)
    if not copied_whole:
        if store.supports_rename:  # a memmap store beside, renamed into place when complete
            partial = f"{OWN_ROWS}{PARTIAL_SUFFIX}"
            store.delete_prefix(partial)
            _copy_rows(f"{location}/{PARENT_ROWS}", f"{location}/{partial}")
            Path(f"{location}/{partial}").replace(own)
        else:  # no rename: a Zarr store in place, whole once its rows are all there (checked above)
            _copy_rows(f"{location}/{PARENT_ROWS}", own, backend="zarr")
    with tempfile.TemporaryDirectory() as scratch:
        switched = _selection_over(own, Path(scratch) / "selection", manifest)
    switched["source"]["relative"] = f"../{OWN_ROWS}"  # in a directory the selection moves with its copy
    for part in switched["parts"]:
        part["relative"] = f"../{OWN_ROWS}"
    # the switch: one atomic replace of the manifest (a rename in a directory, one PUT at a URL)
    store.write(f"{PARENT_ROWS}/{SELECTION_FILES[0]}", json.dumps(switched, sort_keys=True).encode(), fence=False)
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


