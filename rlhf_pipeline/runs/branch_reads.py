"""Which rows of a parent's shard a branch reads, from what the branch keeps: its ``parent-rows/``
selection (``storage/selection.py``: per part, the store's location and its first row then) and
its continues record (``storage/continues.py``, a branch continued online). Retention's branch
floors (``runs/retention.py``) read them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhf_pipeline.files.atomic import json_object

# the names runs/branch.py writes (PARENT_ROWS, BRANCH_MAKING), kept here so that
# retention and lineage read them without importing how a branch is made (which imports retention)
PARENT_ROWS_MANIFEST = "parent-rows/selection.json"
BRANCH_MAKING = "branch.making"  # what a branch being made is made of ({"parent", "step"}), written first


def resolved_location(location: str) -> str:
    """A store's location as selections record it: a URL as it is, a path made absolute."""
    return location if "://" in location else str(Path(location).resolve())


def is_inside(location: str, run: str) -> bool:
    """Whether ``location`` (a path or a URL) lies inside the run at ``run``."""
    return resolved_location(location).startswith(resolved_location(run).rstrip("/") + "/")


def first_row_read(parts: list[dict[str, Any]], shard: str) -> int | None:
    """The first row of the store at ``shard`` that a saved selection's ``parts`` name (None: none)."""
    shard = resolved_location(shard).rstrip("/")
    firsts = [int(part["first_row"]) for part in parts
              if part.get("rows") and resolved_location(str(part.get("location", ""))).rstrip("/") == shard]
    return min(firsts) if firsts else None


def continues_shard(continues: dict[str, Any] | None, shard: str) -> bool:
    """Whether a branch's continues record (``storage/continues.py``) reads rows of the parent
    shard at ``shard`` in place: its ``parent_buffer`` is that shard's buffer and names rows of it."""
    if continues is None:
        return False
    buffer, _, name = resolved_location(shard).rstrip("/").rpartition("/")
    same = resolved_location(str(continues["parent_buffer"])).rstrip("/") == buffer
    return same and int(continues["rows"].get(name, 0)) > 0


def making_record(raw: bytes | None) -> dict[str, Any] | None:
    """``branch.making``'s record (``{"parent": URL, "step": N}``); a damaged one names no parent."""
    return json_object(raw)
