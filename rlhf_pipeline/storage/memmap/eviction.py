"""Dropping a memmap store's oldest sealed segments (``MemmapEviction``): eviction over ``capacity_rows``
and retention's drop.

Both drop whole sealed segments, never the open one, in one publish; a full store holds between
``capacity_rows - S + 1`` and ``capacity_rows`` rows. A dropped segment's files are deleted
``evict_grace_s`` seconds later, so readers that opened the store before the drop can still map them.
Design: docs/storage.md#dropping-segments."""

from __future__ import annotations

import shutil
import time

from rlhf_pipeline.storage.segmented import DroppedSegment


class MemmapEviction:
    """Eviction and retention's drop for :class:`~rlhf_pipeline.storage.memmap.store.MemmapTrajectoryStore`,
    which holds the state they change (segments, first row, the evicted list) and publishes it."""

    def _evict_over_capacity(self) -> None:
        if self._capacity_rows is None:
            return
        now = time.time()
        while self._next_row - self._first_row > self._capacity_rows:
            oldest = self._segments[min(self._segments)]
            if oldest.rows < self._segment_rows:  # the open tail is never evicted
                break
            del self._segments[oldest.id]
            self._first_row += oldest.rows
            self._evicted.append([oldest.id, now])
            if oldest.id in self._views:
                self._unmap(oldest.id)

    def _drop_sealed_before(self, global_row: int) -> list[DroppedSegment]:
        """Retention's drop: the sealed segments wholly before ``global_row`` leave the published
        state in one publish, and their files go ``evict_grace_s`` later, as evicted ones do."""
        published = (self._first_row, self._next_row, dict(self._segments), list(self._evicted))
        now, dropped = time.time(), []
        while self._segments:
            oldest = self._segments[min(self._segments)]
            end = oldest.id * self._segment_rows + oldest.rows
            if oldest.rows < self._segment_rows or end > global_row:  # the open tail is never dropped
                break
            folder = self._segment_dir(oldest.id)
            size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file()) if folder.is_dir() else 0
            dropped.append(DroppedSegment(end - oldest.rows, oldest.rows, size))
            del self._segments[oldest.id]
            self._first_row = end
            self._evicted.append([oldest.id, now])
            if oldest.id in self._views:
                self._unmap(oldest.id)
        if not dropped:
            return []
        try:
            self._slots.publish(self._seq + 1, self._manifest(), durable=self._durable)
            self._seq += 1
        except BaseException:
            if self._publish_landed():
                self._seq += 1
            else:  # nothing published: the segments are still held
                self._first_row, self._next_row, self._segments, self._evicted = published
            raise
        self._delete_expired_segments()
        return dropped

    def _delete_expired_segments(self) -> None:
        now = time.time()
        keep = []
        for seg_id, evicted_at in self._evicted:
            if now - evicted_at >= self._evict_grace_s:
                shutil.rmtree(self._segment_dir(int(seg_id)), ignore_errors=True)
            else:
                keep.append([seg_id, evicted_at])
        # the shortened list is published with the next append; a deleted directory
        # that is still listed is simply skipped
        self._evicted = keep
