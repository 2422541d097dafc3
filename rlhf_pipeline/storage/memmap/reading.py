"""A memmap store's reader side (``MemmapReading``): mapping segments on demand, gathering rows, following
publishes.

Reads map the segments they touch and keep at most ``mapped_segments`` mapped (least recently read
unmapped first). Every byte is checked against the CRC32C recorded for it before it is used
(:mod:`.views`). A segment evicted and deleted under a reader gives an ``IndexError`` naming the rows; a
held segment's missing file a ``StoreCorruptedError`` naming it. Design: docs/storage.md#reading-segments."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlhf_pipeline.schema import TrajectoryBatch
from rlhf_pipeline.storage.memmap import layout
from rlhf_pipeline.storage.memmap.gather import gather_rows
from rlhf_pipeline.storage.memmap.layout import read_published
from rlhf_pipeline.storage.memmap.row_index import PaddedReadCache, locate_rows
from rlhf_pipeline.storage.memmap.segments import missing_segment_file
from rlhf_pipeline.storage.memmap.views import RecordedChecksums, SegmentView
from rlhf_pipeline.storage.padded_rows import LocatedRows


class MemmapReading:
    """The read path of :class:`~rlhf_pipeline.storage.memmap.store.MemmapTrajectoryStore`, which
    holds the published state it reads against and the mapped segments' views."""

    def refresh(self) -> int:
        self._check_open()
        if self._lock is None:
            self._apply_latest_publish()
        return self._published_len()

    def _apply_latest_publish(self) -> None:
        manifest = {"segment_rows": self._segment_rows}
        self._apply_published(read_published(self._path, self._slots, manifest, self._fields, after=self._seq,
                                             seen=self._seen_damage))

    def _view(self, seg_id: int) -> SegmentView:
        view = self._views.get(seg_id)
        if view is not None:
            self._views.move_to_end(seg_id)
            return view
        view = self._views[seg_id] = SegmentView(self._segment_dir(seg_id), partial(self._recorded_checksums, seg_id),
                                                 verified=self._verified)
        while len(self._views) > self._mapped_segments:
            self._unmap(next(iter(self._views)))
        return view

    def _recorded_checksums(self, seg_id: int) -> RecordedChecksums:
        """What the published state says segment ``seg_id``'s files are checked against on read."""
        return RecordedChecksums.of(self._segments.get(seg_id), self._segment_rows, self._checksums_from,
                                    self._published_open_checksums)

    def _unmap(self, seg_id: int) -> None:
        """Lets a segment's mappings go (they unmap once no array read from them is referenced)."""
        self._views.pop(seg_id).close()
        if self._padded_cache is not None:
            self._padded_cache.forget(seg_id)

    def unit_bounds(self) -> list[tuple[int, int]]:
        """One range per held segment (segment ``k`` holds global rows ``[k*S, k*S + rows)``)."""
        bounds = []
        for seg_id in sorted(self._segments):
            start = max(seg_id * self._segment_rows, self._first_row)
            stop = min(seg_id * self._segment_rows + self._segments[seg_id].rows, self._next_row)
            if stop > start:
                bounds.append((start - self._first_row, stop - self._first_row))
        return bounds

    def _read_global(self, global_ids: torch.Tensor, fields: Sequence[str] | None = None) -> TrajectoryBatch:
        return self._unless_evicted(global_ids, lambda: self._gather(global_ids, fields))

    def _locate_rows(self, global_ids: torch.Tensor) -> LocatedRows:
        if self._padded_cache is None:
            self._padded_cache = PaddedReadCache(self._schema)
        cache = self._padded_cache
        return self._unless_evicted(global_ids, lambda: locate_rows(self, cache, global_ids.numpy()))

    def _unless_evicted(self, global_ids: torch.Tensor, read: Callable[[], Any]) -> Any:
        """``read()``; an IndexError naming the rows when a segment was evicted and deleted under
        this reader, a StoreCorruptedError naming the file when a held segment's file is missing."""
        self._check_open()
        for attempt in range(2):
            try:
                return read()
            except FileNotFoundError as exc:
                # a segment was evicted and deleted before this reader mapped it, or deleted by hand
                self.refresh()
                if global_ids.numel() and int(global_ids.min()) < self._first_row:
                    raise IndexError(
                        f"rows from global id {int(global_ids.min())} were evicted while being read "
                        f"(the store now starts at {self._first_row}); sample again"
                    ) from None
                missing = _segment_of_path(exc.filename)
                if attempt == 0 and missing is not None and missing not in self._segments:
                    continue  # an evicted segment none of these rows needs: read again
                raise missing_segment_file(self._path, exc.filename) from None
        raise AssertionError("unreachable")

    def _gather(self, global_ids: torch.Tensor, fields: Sequence[str] | None) -> TrajectoryBatch:
        ids = global_ids.numpy().astype(np.int64, copy=False)
        names = self._schema.field_names if fields is None else tuple(fields)
        return gather_rows(ids, names, self._segment_rows, lambda seg_id: (self._view(seg_id), self._segments[seg_id]))


def _segment_of_path(filename: str | None) -> int | None:
    if not filename:
        return None
    path = Path(filename)
    for part in (path.parent.name, path.name):
        seg_id = layout.segment_id_of(part)
        if seg_id is not None:
            return seg_id
    return None
