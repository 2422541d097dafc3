"""The range form of a saved selection (storage/selection.py): rows named as, per part, one
range ``[first, end)`` of global ids, kept in ``selection.json`` itself, instead of one id per row.

Why: a branch of a run with collectors (runs/branch.py) names, per shard, every row published by
the branch step, and those are a prefix of the shard: a range. Written per row they cost 8 bytes
(and their share of writing, reading and checking a file) per row, so branching grew with the
buffer; as ranges the selection is O(parts) bytes at any size. A selection whose rows are not
ranges (a ``filter`` output) keeps the per-row files.

In the manifest: ``"row_ranges": [[part index, first, end], ...]`` (in the parts' order), no rows
files (``rows_file`` and ``parts_file`` are null), and ``rows_crc32`` the CRC32 of those triples
as int64: what a saved state checks (same rows, same order), as the CRC of ``rows.npy`` is for
the per-row form.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

RANGES_KEY = "row_ranges"


def ranges_crc32(ranges: list[list[int]]) -> int:
    """The identity of the rows ``ranges`` name (the triples' bytes, in order)."""
    return zlib.crc32(np.asarray(ranges, dtype=np.int64).reshape(-1, 3).tobytes())


def probe_ids(first: int, end: int, probes: int) -> np.ndarray:
    """The global ids probed of the range ``[first, end)``: the same rows the per-row form
    probes of ``np.arange(first, end)`` (first, last and evenly between)."""
    if end <= first:
        return np.zeros(0, dtype=np.int64)
    return np.unique(first + np.linspace(0, end - first - 1, probes).round().astype(np.int64))


def expand_ranges(manifest: dict[str, Any], where: str) -> tuple[np.ndarray, np.ndarray | None]:
    """``(global ids, part of each row or None for a one-store source)`` of a range-form
    manifest, in selection order; ``ValueError`` naming ``where`` when the ranges disagree with
    the parts or the row count (a hand-edited or damaged manifest)."""
    ranges = manifest[RANGES_KEY]
    parts = manifest["parts"]
    if int(manifest["rows_crc32"]) != ranges_crc32(ranges):
        raise ValueError(f"{where}: {RANGES_KEY} does not match its rows_crc32")
    if [int(r[0]) for r in ranges] != [int(p["index"]) for p in parts] or any(
            int(end) - int(first) != int(p["rows"]) or int(end) < int(first)
            for (_, first, end), p in zip(ranges, parts)):
        raise ValueError(f"{where}: {RANGES_KEY} do not match the parts' row counts")
    ids = [np.arange(int(first), int(end), dtype=np.int64) for _, first, end in ranges]
    rows = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    if rows.size != int(manifest["rows"]):
        raise ValueError(f"{where}: {RANGES_KEY} name {rows.size} rows, the manifest says {manifest['rows']}")
    if manifest["source"].get("layout") != "sharded":
        return rows, None
    part_of = [np.full(int(end) - int(first), int(index), dtype=np.int64) for index, first, end in ranges]
    return rows, (np.concatenate(part_of) if part_of else np.zeros(0, dtype=np.int64))
