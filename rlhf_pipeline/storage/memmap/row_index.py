"""Locating sampled rows of a memmap store for the fused reads (``store.read_padded``, ``read_ragged``).

:func:`locate_rows` answers, per sampled row, its segment's mapped value arrays, the start and length of
its prompt and response in them, and its row-field values (a :class:`~.padded_rows.LocatedRows`, which
:func:`~.padded_rows.fill_padded` copies into the padded tensors). The per-row facts come from a
:class:`RowIndex`, flat in-memory arrays over every held row indexed by global id, so a lookup costs one
``take`` per column however many segments a batch touches; each lookup first catches up with the store.
Design: docs/storage.md#reading-segments."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from rlhf_pipeline.schema import FIELDS_BY_NAME, NUMPY_DTYPES, StoreSchema
from rlhf_pipeline.storage.errors import StoreCorruptedError
from rlhf_pipeline.storage.memmap.segments import ENDS_DTYPE, SegmentState, check_spans
from rlhf_pipeline.storage.padded_rows import LocatedRows, UnitSource, field_plan, unit_source

if TYPE_CHECKING:
    from rlhf_pipeline.storage.memmap import MemmapTrajectoryStore

__all__ = ["PaddedReadCache", "RowIndex", "locate_rows"]

# ragged field -> (index column of its rows' first value, of their end)
_SPANS = {"prompt_tokens": ("prompt_start", "prompt_stop"), "response_tokens": ("response_start", "response_stop")}
_MIN_CAPACITY = 1024


class RowIndex:
    """Per held row of one store: value spans within its segment and row-field values.

    Slots ``[lo, hi)`` of every column hold global rows ``[first, first + hi - lo)``.
    """

    def __init__(self, schema: StoreSchema) -> None:
        _, row_fields = field_plan(schema)
        dtypes = {name: ENDS_DTYPE for pair in _SPANS.values() for name in pair}
        dtypes.update(row_fields)
        self.columns: dict[str, np.ndarray] = {name: np.empty(0, dtype=dtype) for name, dtype in dtypes.items()}
        self.row_fields = tuple(name for name, _ in row_fields)
        self.first = 0
        self.lo = self.hi = 0
        # segments whose files could not be indexed (missing, damaged): their rows hold zeros here,
        # and a batch that samples one of them raises the error instead of reading wrong rows
        self.unreadable: dict[int, Exception] = {}

    @property
    def next_row(self) -> int:
        return self.first + self.hi - self.lo

    def slots(self, global_ids: np.ndarray) -> np.ndarray:
        """Slots of rows held by the index (call :meth:`sync` first)."""
        return global_ids - (self.first - self.lo)

    def sync(self, store: MemmapTrajectoryStore) -> None:
        """Covers exactly the store's published rows ``[first_row, next_row)``."""
        first, next_row = store.first_row, store.next_row
        if first < self.first or next_row < self.next_row or first > self.next_row:
            # not a later state of what the index saw (a fresh index, or every row evicted)
            self.first, self.lo, self.hi = first, 0, 0
            self.unreadable.clear()
        self.lo += first - self.first
        self.first = first
        for seg_id in [i for i in self.unreadable if (i + 1) * store.segment_rows <= first]:
            del self.unreadable[seg_id]  # evicted
        if next_row > self.next_row:
            self._append(store, self.next_row, next_row)

    def _append(self, store: MemmapTrajectoryStore, start: int, stop: int) -> None:
        self._reserve(stop - start)
        per_segment = store.segment_rows
        for seg_id in range(start // per_segment, (stop - 1) // per_segment + 1):
            state: SegmentState = store._segments[seg_id]
            base = seg_id * per_segment
            lo, hi = max(start, base) - base, min(stop, base + state.rows) - base
            slots = slice(self.hi, self.hi + hi - lo)
            try:
                self._fill(store, seg_id, state, lo, hi, slots)
            except (FileNotFoundError, StoreCorruptedError) as exc:
                for column in self.columns.values():
                    column[slots] = 0
                self.unreadable[seg_id] = exc
            self.hi += hi - lo

    def _fill(self, store: MemmapTrajectoryStore, seg_id: int, state: SegmentState, lo: int, hi: int,
              slots: slice) -> None:
        """Index rows ``[lo, hi)`` of segment ``seg_id`` into ``slots``; checks their end offsets."""
        view = store._view(seg_id)
        for field, (start_name, stop_name) in _SPANS.items():
            ends = view.array(f"{field}.ends", ENDS_DTYPE, state.rows)  # row i is [ends[i-1], ends[i])
            stops = ends[lo:hi]
            starts = self.columns[start_name][slots]
            starts[0] = ends[lo - 1] if lo else 0
            starts[1:] = stops[:-1]
            check_spans(view.directory, field, starts, stops, state.elements[field], np.arange(lo, hi))
            self.columns[stop_name][slots] = stops
        for name in self.row_fields:
            column = self.columns[name]
            column[slots] = view.array(f"{name}.col", column.dtype, state.rows)[lo:hi]

    def _reserve(self, extra: int) -> None:
        capacity = len(self.columns["prompt_start"])
        if self.hi + extra <= capacity:
            return
        live = self.hi - self.lo
        capacity = max(2 * (live + extra), _MIN_CAPACITY)  # amortised growth; drops evicted slots
        for name, column in self.columns.items():
            grown = np.empty(capacity, dtype=column.dtype)
            grown[:live] = column[self.lo : self.hi]
            self.columns[name] = grown
        self.lo, self.hi = 0, live


class PaddedReadCache:
    """What a store keeps between fused padded reads: the row index and mapped segment values."""

    def __init__(self, schema: StoreSchema) -> None:
        self.float_names, _ = field_plan(schema)
        self.index = RowIndex(schema)
        self._sources: dict[int, tuple[SegmentState, UnitSource]] = {}
        self._first_row = -1

    def source(self, store: MemmapTrajectoryStore, seg_id: int) -> UnitSource:
        """Segment ``seg_id``'s value arrays, mapped at least to its published length."""
        state = store._segments[seg_id]
        cached = self._sources.get(seg_id)
        if cached is not None and cached[0] is state:  # every publish makes new state objects
            return cached[1]
        view = store._view(seg_id)
        arrays = [view.array(f"{name}.values", NUMPY_DTYPES[FIELDS_BY_NAME[name].dtype], state.elements[name])
                  for name in ("prompt_tokens", "response_tokens", *self.float_names)]
        source = unit_source(arrays[0], arrays[1], arrays[2:])
        self._sources[seg_id] = (state, source)
        return source

    def forget(self, seg_id: int) -> None:
        """Drops a segment's arrays (the store unmapped it): the mapping goes with the last of them."""
        self._sources.pop(seg_id, None)

    def sync(self, store: MemmapTrajectoryStore) -> None:
        self.index.sync(store)
        if store.first_row != self._first_row:
            # evicted segments' mappings hold their (deleted) files' disk space: let them go
            for seg_id in [i for i in self._sources if i not in store._segments]:
                del self._sources[seg_id]
            self._first_row = store.first_row


def locate_rows(store: MemmapTrajectoryStore, cache: PaddedReadCache, global_ids: np.ndarray) -> LocatedRows:
    """Where the rows ``global_ids`` (published and held) are, in that order."""
    cache.sync(store)
    index = cache.index
    slots = index.slots(global_ids)
    columns = index.columns
    prompt_start, response_start = columns["prompt_start"].take(slots), columns["response_start"].take(slots)
    # a row's source is its segment id less the batch's lowest: sources has a slot for every
    # segment in between, None where no row was sampled (cheaper than np.unique's inverse)
    segment_of = global_ids // store.segment_rows
    if index.unreadable:
        hit = [i for i in np.unique(segment_of).tolist() if i in index.unreadable]
        if hit:
            raise index.unreadable[hit[0]]
    lowest = int(segment_of.min())
    source = segment_of - lowest
    sources: list = [None] * (int(source.max()) + 1)
    for offset in np.flatnonzero(np.bincount(source)).tolist():
        sources[offset] = cache.source(store, lowest + offset)
    return LocatedRows(
        cache.float_names,
        source,
        prompt_start,
        columns["prompt_stop"].take(slots) - prompt_start,
        response_start,
        columns["response_stop"].take(slots) - response_start,
        {name: columns[name].take(slots) for name in index.row_fields},
        sources,
    )
