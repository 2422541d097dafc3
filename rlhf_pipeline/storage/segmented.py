"""What the segment-based backends (memmap, Zarr) share: rows in fixed-size segments, an
optional row capacity that evicts the oldest sealed segments, and the same create checks.

:class:`SegmentedTrajectoryStore` implements the contract's read-only properties from a
few attributes its subclasses set (``_schema``, ``_location``, ``_first_row``, ``_next_row``,
``_segment_rows``, ``_capacity_rows``) and :meth:`~SegmentedTrajectoryStore.drop_rows_before`
(retention) from each one's ``_drop_sealed_before``; :func:`check_segment_layout` and
:func:`check_reopened_layout` are the checks both ``create`` methods make.

Design: docs/storage.md#adding-a-backend.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any, NamedTuple

from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage.base import ReadOnlyStoreError, StoreClosedError, StoreCorruptedError, TrajectoryStore


WRITER_STATE_KEY = "writer_state"
"""Where a segmented store's published record (memmap's state slot, Zarr's commit record) keeps the
last append's ``writer_state``, base64 text."""


def writer_state_entry(record: dict[str, Any], writer_state: bytes | None) -> dict[str, Any]:
    """``record`` carrying ``writer_state`` (None: as it is, the last one staying)."""
    if writer_state is None:
        return record
    return {**record, WRITER_STATE_KEY: base64.b64encode(writer_state).decode("ascii")}


def writer_state_of(record: dict[str, Any], where: str) -> bytes | None:
    """The ``writer_state`` a published record carries, or None."""
    text = record.get(WRITER_STATE_KEY)
    if text is None:
        return None
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (AttributeError, ValueError) as exc:
        raise StoreCorruptedError(f"{where}: its published writer_state is not base64 text: {exc!r}") from None


class DroppedSegment(NamedTuple):
    """A sealed segment a writer dropped: its global rows ``[first_row, first_row + rows)`` and the
    bytes its files took (freed at once on an object store, after ``evict_grace_s`` for memmap)."""

    first_row: int
    rows: int
    bytes: int


class SegmentedTrajectoryStore(TrajectoryStore):
    """A store of segments of ``segment_rows`` rows, holding at most ``capacity_rows`` rows."""

    _schema: StoreSchema
    _location: str
    _first_row: int
    _next_row: int
    _segment_rows: int
    _capacity_rows: int | None
    _writer_state: bytes | None = None

    @property
    def writer_state(self) -> bytes | None:
        return self._writer_state

    @property
    def schema(self) -> StoreSchema:
        return self._schema

    @property
    def location(self) -> str:
        return self._location

    @property
    def first_row(self) -> int:
        return self._first_row

    @property
    def next_row(self) -> int:
        return self._next_row

    @property
    def supports_eviction(self) -> bool:
        return self._capacity_rows is not None

    @property
    def segment_rows(self) -> int:
        """Rows per sealed segment: the unit of sealing, caching and eviction."""
        return self._segment_rows

    @property
    def capacity_rows(self) -> int | None:
        """The most rows held (oldest sealed segments are evicted beyond it); None: unbounded."""
        return self._capacity_rows

    def drop_rows_before(self, global_row: int) -> list[DroppedSegment]:
        """Drops the oldest sealed segments whose rows all lie before ``global_row``, as eviction
        does (published in one step; a reader sees all of a segment or none of it), and returns
        them, oldest first. The open segment is never dropped, so fewer rows than asked may go:
        retention (``storage/retention.py``) chooses ``global_row``; this only obeys it."""
        if self.closed:
            raise StoreClosedError(f"{self.location} was closed; open it again with mode='a' to drop rows")
        if not self.writable:
            raise ReadOnlyStoreError(f"{self.location} was opened read-only; only its writer (mode='a') drops rows")
        if global_row <= self.first_row:
            return []
        return self._drop_sealed_before(int(global_row))

    def _drop_sealed_before(self, global_row: int) -> list[DroppedSegment]:
        raise NotImplementedError


def check_segment_layout(segment_rows: int, capacity_rows: int | None) -> None:
    """The options every segmented store's ``create`` takes, checked the same way."""
    if segment_rows < 1:
        raise ValueError(f"segment_rows must be >= 1, got {segment_rows}")
    if capacity_rows is not None and capacity_rows < segment_rows:
        raise ValueError(
            f"capacity_rows ({capacity_rows}) must be >= segment_rows ({segment_rows}): eviction "
            f"drops whole sealed segments; lower segment_rows or raise capacity_rows"
        )


def check_reopened_layout(store: SegmentedTrajectoryStore, schema: StoreSchema, segment_rows: int,
                          capacity_rows: int | None) -> SegmentedTrajectoryStore:
    """``create(..., exist_ok=True)`` on an existing store: returns it when it was created with
    the same schema, segment size and capacity; otherwise closes it and raises ValueError."""
    wanted = (schema, segment_rows, capacity_rows)
    found = (store.schema, store.segment_rows, store.capacity_rows)
    if wanted != found:
        store.close()
        raise ValueError(
            f"{store.location} exists with (schema fields, segment_rows, capacity_rows) = "
            f"({found[0].field_names}, {found[1]}, {found[2]}), not the requested "
            f"({wanted[0].field_names}, {wanted[1]}, {wanted[2]})"
        )
    return store


def require_new_directory(path: Path, location: str) -> None:
    """A new store goes into a missing or empty directory, never over other files."""
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{location} is a file, not a directory: a store is a directory; choose a new path")
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"{location} exists and is not an empty directory; choose a new path")
