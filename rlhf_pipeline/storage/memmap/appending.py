"""A memmap store's writer side (``MemmapAppending``): appending rows to the open segment, publishing them.

An append writes bytes past the published lengths, fsyncs them (``durable=True``; a batch's fsyncs run in
parallel), then publishes the new state with the append's ``writer_state`` in it
(:class:`~rlhf_pipeline.storage.memmap.state_slots.StateSlots`): readers see only what a publish covers,
and a writer killed at any moment leaves the previous publish intact. Reopening for append truncates the
unpublished bytes and carries on at ``next_row`` (:meth:`MemmapAppending._recover_tail`). A segment that
fills is sealed (its ``checksums.json`` written) and the next append opens the next one.
Design: docs/storage.md#appending-and-sealing."""

from __future__ import annotations

import shutil

from rlhf_pipeline.files.atomic import named
from rlhf_pipeline.schema import TrajectoryBatch
from rlhf_pipeline.storage.memmap.layout import CHECKSUMS_NAME, MANIFEST_NAME
from rlhf_pipeline.storage.memmap.segments import SegmentWriter, empty_segment


class MemmapAppending:
    """The append path of :class:`~rlhf_pipeline.storage.memmap.store.MemmapTrajectoryStore`, which
    holds the state it works on (segments, rows, slots, the open segment's writer)."""

    def _recover_tail(self) -> None:
        """After opening for append: drop what an interrupted writer left unpublished."""
        held = set(self._segments)
        last_id = max(held) if held else self._next_row // self._segment_rows - 1
        pending = {int(seg_id) for seg_id, _ in self._evicted}
        for entry in self._path.glob("seg-*"):
            try:
                seg_id = int(entry.name[4:])
            except ValueError:
                continue
            # beyond the last published segment: created by an append that never published
            if seg_id > last_id or (seg_id < min(held, default=last_id + 1) and seg_id not in pending):
                shutil.rmtree(entry, ignore_errors=True)
        (self._path / (MANIFEST_NAME + ".partial")).unlink(missing_ok=True)
        if held:
            tail = self._segments[last_id]
            recorded = self._published_open_checksums  # the CRCs this open segment was published with
            writer = SegmentWriter(self._segment_dir(last_id), self._schema, tail, durable=self._durable,
                                   written=recorded[1] if recorded is not None and recorded[0] == last_id else None)
            if tail.rows < self._segment_rows:
                # a seal whose publish never happened may have left checksums of rows now dropped
                for name in (CHECKSUMS_NAME, CHECKSUMS_NAME + ".partial"):
                    (self._segment_dir(last_id) / name).unlink(missing_ok=True)
                self._tail_writer = writer
            else:
                writer.close()
        self._delete_expired_segments()

    def _append_validated(self, batch: TrajectoryBatch | None, writer_state: bytes | None) -> None:
        self._check_open()
        published = (self._first_row, self._next_row, dict(self._segments), list(self._evicted), self._writer_state)
        try:
            if batch is not None:
                self._write_rows(batch)
            if writer_state is not None:
                self._writer_state = writer_state  # in the same slot publish as the rows
            self._evict_over_capacity()
            self._slots.publish(self._seq + 1, self._manifest(), durable=self._durable)
            self._seq += 1
            self._published_open_checksums = (None if self._tail_writer is None else
                                              (max(self._segments), self._tail_writer.written_sums()))
        except BaseException as exc:
            if self._publish_landed():
                # interrupted (Ctrl-C) after the new state reached its slot: the rows are
                # committed, and rolling the files back would cut published bytes
                self._seq += 1
                raise
            # back to the last published state; the files drop the unpublished bytes
            self._first_row, self._next_row, self._segments, self._evicted, self._writer_state = published
            if self._tail_writer is not None:
                self._tail_writer.close()
                self._tail_writer = None
            self._recover_tail()
            if isinstance(exc, OSError):
                raise named(exc, self._location)  # noqa: B904 - a write to an open file names none: the store
            raise
        self._delete_expired_segments()

    def _publish_landed(self) -> bool:
        """Whether the publish of an append that raised is on disk (the slot after ``_seq``)."""
        try:
            newer = self._slots.latest(after=self._seq)
        except Exception:  # noqa: BLE001 - unreadable: take it as not published, as a reopen would
            return False
        return newer is not None and newer[0] == self._seq + 1

    def _write_rows(self, batch: TrajectoryBatch) -> None:
        rows_per_segment = self._segment_rows
        start, n = 0, len(batch)
        while start < n:
            if self._tail_writer is None:
                seg_id = self._next_row // rows_per_segment
                state = empty_segment(seg_id, self._schema)
                self._tail_writer = SegmentWriter(
                    self._segment_dir(seg_id), self._schema, state, durable=self._durable
                )
                self._segments[seg_id] = state
            tail = self._segments[max(self._segments)]
            stop = min(n, start + rows_per_segment - tail.rows)
            tail = self._tail_writer.append(batch, start, stop, tail)
            self._segments[tail.id] = tail
            self._next_row += stop - start
            start = stop
            if tail.rows == rows_per_segment:
                self._tail_writer.seal(tail)
                self._tail_writer = None
        if self._durable and self._tail_writer is not None:
            self._tail_writer.sync()
