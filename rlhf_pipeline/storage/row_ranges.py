"""The range form of a saved selection (``selection.py``): per part, one range ``[first, end)`` of
global ids kept in ``selection.json`` itself instead of one id per row (a branch's ``parent-rows/``:
O(parts) bytes at any buffer size); and the two ways an open selection maps its positions to its
source's rows: :class:`RangeRows` for this form (a binary search over the ranges' ends, nothing
allocated per row) and :class:`ListedRows` for ``rows.npy``/``parts.npy``.

Design: docs/curation.md#a-selection-on-disk.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

RANGES_KEY = "row_ranges"


def ranges_crc32(ranges: list[list[int]]) -> int:
    """The identity of the rows ``ranges`` name (the triples' bytes, in order)."""
    return zlib.crc32(np.asarray(ranges, dtype=np.int64).reshape(-1, 3).tobytes())


def probe_positions(rows: int, probes: int) -> np.ndarray:
    """Which of ``rows`` rows a selection probes: first, last and evenly between (ascending, unique)."""
    if rows <= 0:
        return np.zeros(0, dtype=np.int64)
    return np.unique(np.linspace(0, rows - 1, probes).round().astype(np.int64))


def probe_ids(first: int, end: int, probes: int) -> np.ndarray:
    """The global ids probed of the range ``[first, end)``: the same rows the per-row form
    probes of ``np.arange(first, end)``."""
    return first + probe_positions(end - first, probes)


def _positions(positions: np.ndarray, size: int) -> np.ndarray:
    positions = np.asarray(positions, dtype=np.int64)
    if positions.size and (int(positions.min()) < 0 or int(positions.max()) >= size):
        raise IndexError(f"selection positions must lie in [0, {size}); got [{int(positions.min())}, "
                         f"{int(positions.max())}]")
    return positions


class RangeRows:
    """Positions ``[0, size)`` of a range-form selection: range k covers the positions
    ``[starts[k], ends[k])`` and names the global ids ``firsts[k] + (position - starts[k])`` of
    part ``parts[k]``. Nothing here grows with the rows."""

    def __init__(self, ranges: list[list[int]], sharded: bool) -> None:
        triples = np.asarray(ranges, dtype=np.int64).reshape(-1, 3)
        counts = triples[:, 2] - triples[:, 1]
        self._parts, self._firsts = triples[:, 0], triples[:, 1]
        self._ends = np.cumsum(counts)
        self._starts = self._ends - counts
        self._sharded = sharded
        self.size = int(self._ends[-1]) if self._ends.size else 0

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any], where: str) -> RangeRows:
        """The ranges of a range-form manifest; ``ValueError`` naming ``where`` when they disagree
        with the parts or the row count (a hand-edited or damaged manifest)."""
        ranges = manifest[RANGES_KEY]
        parts = manifest["parts"]
        if int(manifest["rows_crc32"]) != ranges_crc32(ranges):
            raise ValueError(f"{where}: {RANGES_KEY} does not match its rows_crc32")
        if [int(r[0]) for r in ranges] != [int(p["index"]) for p in parts] or any(
                int(end) - int(first) != int(p["rows"]) or int(end) < int(first)
                for (_, first, end), p in zip(ranges, parts)):
            raise ValueError(f"{where}: {RANGES_KEY} do not match the parts' row counts")
        rows = cls(ranges, sharded=manifest["source"].get("layout") == "sharded")
        if rows.size != int(manifest["rows"]):
            raise ValueError(f"{where}: {RANGES_KEY} name {rows.size} rows, the manifest says {manifest['rows']}")
        return rows

    def ids(self, positions: np.ndarray) -> np.ndarray:
        """The global id (in its part) of each of ``positions``."""
        positions = _positions(positions, self.size)
        slot = np.searchsorted(self._ends, positions, side="right")  # the range holding each position
        return self._firsts[slot] + (positions - self._starts[slot])

    def parts(self, positions: np.ndarray) -> np.ndarray:
        """The part index of each of ``positions`` (0 for a one-store source)."""
        positions = _positions(positions, self.size)
        if not self._sharded:
            return np.zeros(positions.shape, dtype=np.int64)
        return self._parts[np.searchsorted(self._ends, positions, side="right")]

    def unit_cuts(self, start: int, end: int, unit_starts: np.ndarray) -> list[int]:
        """Positions in ``(start, end)`` (one part's rows) where a new storage unit of the source
        begins, ``unit_starts`` being the global ids where its units begin."""
        if end - start < 2:
            return []
        first = int(self.ids(np.array([start]))[0])
        inside = unit_starts[(unit_starts > first) & (unit_starts < first + (end - start))]
        return (np.unique(inside) - first + start).tolist()


class ListedRows:
    """Positions of a per-row selection: ``rows[p]`` is the global id of position ``p``, ``part_of[p]``
    its part (None for a one-store source); ids ascend within a part (write_selection sorts them)."""

    def __init__(self, rows: np.ndarray, part_of: np.ndarray | None) -> None:
        self._rows, self._part_of = rows, part_of
        self.size = int(rows.size)

    def ids(self, positions: np.ndarray) -> np.ndarray:
        return self._rows[_positions(positions, self.size)]

    def parts(self, positions: np.ndarray) -> np.ndarray:
        positions = _positions(positions, self.size)
        if self._part_of is None:
            return np.zeros(positions.shape, dtype=np.int64)
        return self._part_of[positions]

    def unit_cuts(self, start: int, end: int, unit_starts: np.ndarray) -> list[int]:
        unit = np.searchsorted(unit_starts, self._rows[start:end], side="right")
        return (np.flatnonzero(np.diff(unit)) + 1 + start).tolist()
