"""The memory-mapped trajectory store: ragged columnar segments in a local directory.

Why one file: the store class keeps the ``TrajectoryStore`` contract in one place; its layout,
segments, row index, checksums, gather and repair are already modules of their own in this folder.

On disk::

    <path>/
      manifest.json        what the store is (backend, format, schema, segment size, capacity)
                           and its state when created or snapshotted
      state.0, state.1     the published state, rewritten in turn by every append (both
                           created with the store: a missing one is damage)
      writer.lock          flock'ed by the one writer; records its pid
      seg-00000000/        rows [0, S) -- sealed, immutable
        prompt_tokens.values  prompt_tokens.ends  ...  reward.col  ...  prompt_text.values ...
        checksums.json     size and CRC32C of every file, written when the segment was sealed
      seg-00000001/        rows [S, 2S) -- the open tail segment, appended to

Segment ``k`` holds global rows ``[k*S, (k+1)*S)`` (``S = segment_rows``). File
formats are in :mod:`rlhf_pipeline.storage.memmap.segments`. The published state
records ``first_row``, ``next_row`` and, per held segment, its row count and value
counts; it is a CRC-checked record in one of two slots
(:class:`~rlhf_pipeline.storage.memmap.state_slots.StateSlots`), so publishing needs no rename.

An append writes bytes past the published lengths, fsyncs them (``durable=True``),
then publishes the new state. Readers see only what a publish covers, so they never
see a partial row, and a writer killed at any moment leaves the previous publish
intact (the slot it was rewriting keeps its old header); reopening for append
truncates the unpublished bytes and carries on at ``next_row``.

Damage (:mod:`.layout`, :mod:`.checksums`): a newest slot that fails its check was
damaged at rest, never torn by a crash. If the segment files hold rows beyond the intact
older slot, readers open there with a ``StoreDamageWarning`` naming the rows rolled back,
and a writer refuses (truncating the tail would destroy them); with no intact slot at all, or a
lost one (:func:`.layout.lost_slot`), every open raises ``StoreCorruptedError`` naming the files.
``rlhf-pipeline repair`` rebuilds the state from the segment files (:mod:`.repair`). Missing or
damaged segment files raise ``StoreCorruptedError`` naming the segment and field when read; the
other segments keep reading. No byte is read before it was checked against the CRC32C recorded
for it: a sealed segment's checksums, the open segment's published prefixes (:mod:`.views`).

``durable=False`` skips the fsyncs: a killed *process* still loses nothing that was
published (the page cache holds it), but a power loss may roll back recent appends.
FACTS.md measured fsync-per-batch at ~8.5x the cost of a plain memmap append; here
the fsyncs of a batch's files are issued in parallel, which cuts most of that.

With ``capacity_rows`` set, after each append the oldest *sealed* segments are
dropped while more than ``capacity_rows`` rows are held, so the store holds between
``capacity_rows - S + 1`` and ``capacity_rows`` rows once full. The files of a dropped
segment are deleted ``evict_grace_s`` seconds later, so readers that opened the store
before the eviction can still map them.
"""

from __future__ import annotations

import os
import re
import shutil
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlhf_pipeline.files.atomic import publish_json
from rlhf_pipeline.schema import StoreSchema, TrajectoryBatch
from rlhf_pipeline.storage.base import (
    UNBOUNDED_ROWS,
    StoreClosedError,
    StoreCorruptedError,
    StoreStats,
)
from rlhf_pipeline.storage.errors import LocalOnlyStoreError, StoreDamageWarning
from rlhf_pipeline.storage.locking import LOCK_FILE_NAME, WriterLock
from rlhf_pipeline.storage.manifest import check_header, schema_from_manifest
from rlhf_pipeline.storage.memmap import checksums, layout
from rlhf_pipeline.storage.memmap.gather import gather_rows
from rlhf_pipeline.storage.memmap.layout import (
    CHECKSUMS_FROM,
    CHECKSUMS_NAME,
    MANIFEST_NAME,
    OPEN_SEGMENT_CHECKSUMS,
    SLOT_FILES_CREATED,
    STATE_STEM,
    FieldFiles,
    Published,
    field_files,
    fields_json,
    open_segment_checksums,
    read_manifest,
    read_published,
)
from rlhf_pipeline.storage.memmap.row_index import PaddedReadCache, locate_rows
from rlhf_pipeline.storage.memmap.segments import (
    SegmentState,
    SegmentWriter,
    copy_segment,
    empty_segment,
    missing_segment_file,
    segment_dir_name,
)
from rlhf_pipeline.storage.memmap.state_slots import StateSlots
from rlhf_pipeline.storage.memmap.views import RecordedChecksums, SegmentView
from rlhf_pipeline.storage.padded_rows import LocatedRows
from rlhf_pipeline.storage.segmented import (
    DroppedSegment,
    SegmentedTrajectoryStore,
    check_reopened_layout,
    check_segment_layout,
    require_new_directory,
)

BACKEND = layout.BACKEND
FORMAT_VERSION = layout.FORMAT_VERSION
DEFAULT_SEGMENT_ROWS = 4096
DEFAULT_EVICT_GRACE_S = 60.0
# Segments a store object keeps mapped (least recently read unmapped first): 18 mappings per
# segment of the default schema, so 256 segments stay far below Linux's default limit of 65530
# mappings per process (vm.max_map_count) even with several shards, and a sampler over up to
# 256 segments (1M rows at the default segment size) never maps a segment twice.
DEFAULT_MAPPED_SEGMENTS = 256

_URL_TURNED_PATH = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:/(?!/)")  # Path("s3://b/k") is "s3:/b/k"; "C:/" is a drive


def _local_directory(location: str | os.PathLike) -> Path:
    """``location`` as a local directory; a URL (or a URL that went through ``Path``, which drops one
    ``/``) is refused, since it would silently become a local directory named ``s3:``."""
    text = os.fspath(location)
    if "://" in text or _URL_TURNED_PATH.match(text):
        raise LocalOnlyStoreError(f"{text!r} is a URL, but a memmap store is a directory on a local or shared file system: "
                         f"keep a buffer at a URL in a Zarr store (create_store(url, 'zarr'); in a pipeline, "
                         f"create_buffer making a Zarr store, --set buffer_backend=zarr where the pipeline has it), "
                         f"or give a local path")
    return Path(text)


class MemmapTrajectoryStore(SegmentedTrajectoryStore):
    """A :class:`TrajectoryStore` in a local directory of memory-mapped segment files.

    Build with :meth:`create` or :meth:`open`, not the constructor.
    """

    backend_name = BACKEND
    supports_field_subset = True
    supports_fused_padding = True

    # ================================================================ construction
    @classmethod
    def create(
        cls,
        path: str | os.PathLike,
        schema: StoreSchema | None = None,
        *,
        capacity_rows: int | None = None,
        segment_rows: int = DEFAULT_SEGMENT_ROWS,
        evict_grace_s: float = DEFAULT_EVICT_GRACE_S,
        durable: bool = True,
        exist_ok: bool = False,
        mapped_segments: int = DEFAULT_MAPPED_SEGMENTS,
    ) -> MemmapTrajectoryStore:
        """Creates an empty store at ``path`` and opens it for appending.

        ``exist_ok=True`` reopens an existing memmap store instead, provided it has
        the same schema, segment size and capacity. ``mapped_segments`` is as for :meth:`open`.
        """
        schema = schema or StoreSchema()
        path = _local_directory(path)
        check_segment_layout(segment_rows, capacity_rows)
        if (path / MANIFEST_NAME).exists():
            if not exist_ok:
                raise FileExistsError(
                    f"{path} already holds a store; open it with MemmapTrajectoryStore.open({str(path)!r}, "
                    f"mode='a'), or pass exist_ok=True"
                )
            return check_reopened_layout(cls.open(path, mode="a", durable=durable, mapped_segments=mapped_segments),
                                         schema, segment_rows, capacity_rows)
        require_new_directory(path, str(path))
        path.mkdir(parents=True, exist_ok=True)
        lock = WriterLock(path / LOCK_FILE_NAME).acquire()
        if (path / MANIFEST_NAME).exists():
            # Another creator published between the check above and this lock: "new or existing"
            # is decided again under the lock, or an empty manifest would replace its rows.
            if not exist_ok:
                lock.release()
                raise FileExistsError(f"{path} was created by another process meanwhile; open it with "
                                      f"MemmapTrajectoryStore.open({str(path)!r}, mode='a'), or pass exist_ok=True")
            try:
                store = cls(path, lock=lock, durable=durable, mapped_segments=mapped_segments)
            except BaseException:
                lock.release()
                raise
            return check_reopened_layout(store, schema, segment_rows, capacity_rows)
        manifest = {
            "backend": BACKEND,
            "format_version": FORMAT_VERSION,
            "schema": schema.to_json(),
            "fields": fields_json(field_files(schema)),
            SLOT_FILES_CREATED: True,
            "segment_rows": segment_rows,
            "capacity_rows": capacity_rows,
            "evict_grace_s": evict_grace_s,
            "first_row": 0,
            "next_row": 0,
            "segments": [],
            "evicted": [],
            CHECKSUMS_FROM: 0,
        }
        try:
            # the slot files first: a manifest that says they were created is never without them
            StateSlots(path, stem=STATE_STEM).create_files()
            publish_json(path / MANIFEST_NAME, manifest, durable=True)
            return cls(path, lock=lock, durable=durable, mapped_segments=mapped_segments)
        except BaseException:
            lock.release()
            raise

    @classmethod
    def open(cls, path: str | os.PathLike, mode: str = "r", *, durable: bool = True,
             mapped_segments: int = DEFAULT_MAPPED_SEGMENTS) -> MemmapTrajectoryStore:
        """Opens an existing store: ``mode="r"`` to read (no lock), ``"a"`` to append (writer lock).

        Reads map the segments they touch; at most ``mapped_segments`` stay mapped (the least
        recently read is unmapped, and mapped again when read again), which bounds the mappings
        and resident pages of a long-lived reader over a store that keeps growing. Mappings hold
        no file descriptors: a reader's descriptors do not grow with the segments it reads.

        A store whose newest state slot is damaged opens for reading at the older slot, with a
        :class:`~rlhf_pipeline.storage.errors.StoreDamageWarning` naming the rows rolled back;
        a writer refuses it (``StoreCorruptedError``), since appending would overwrite those
        rows: ``rlhf-pipeline repair`` republishes what the segment files hold.
        """
        if mode not in ("r", "a"):
            raise ValueError(f"mode must be 'r' (read) or 'a' (append), got {mode!r}")
        path = _local_directory(path)
        read_manifest(path)  # NotAStoreError before anything is created (a writer's lock file)
        if mode == "r":
            return cls(path, lock=None, durable=durable, mapped_segments=mapped_segments)
        lock = WriterLock(path / LOCK_FILE_NAME).acquire()
        try:
            return cls(path, lock=lock, durable=durable, mapped_segments=mapped_segments)
        except BaseException:
            lock.release(remove_if_created=True)  # a failed open leaves the directory as it was
            raise

    @classmethod
    def detect(cls, location: str) -> bool:
        return layout.detect(location)

    def __init__(self, path: Path, *, lock: WriterLock | None, durable: bool,
                 mapped_segments: int = DEFAULT_MAPPED_SEGMENTS):
        if mapped_segments < 1:
            raise ValueError(f"mapped_segments must be >= 1, got {mapped_segments}")
        self._path = path
        self._location = str(path)
        self._lock = lock
        self._durable = durable
        self._slots = StateSlots(path, stem=STATE_STEM)
        self._seq = 0  # number of the publish this object last saw (0: manifest.json itself)
        self._views: OrderedDict[int, SegmentView] = OrderedDict()  # least recently read first
        self._mapped_segments = mapped_segments
        self._verified: dict[tuple[str, str], tuple[int, int]] = {}  # file -> (bytes, CRC32C) checked on read
        self._padded_cache: PaddedReadCache | None = None  # read_padded's row index (memmap.row_index)
        self._tail_writer: SegmentWriter | None = None
        self._closed = False
        self._owner_pid = os.getpid()
        self._warned: set[str] = set()
        self._seen_damage: set = set()  # (slot path, claimed seq) of damaged slots looked into
        try:
            manifest = read_manifest(path)
            check_header(manifest, path / MANIFEST_NAME, backend=BACKEND, format_version=FORMAT_VERSION)
            self._fields: list[FieldFiles] = layout.fields_of(manifest, path)
            self._apply_manifest(manifest, path / MANIFEST_NAME)
            published = read_published(path, self._slots, manifest, self._fields, seen=self._seen_damage)
            if published is not None and published.rollback is not None and lock is not None:
                raise StoreCorruptedError(
                    f"{published.rollback.describe(path)}. A writer refuses to open this store: appending "
                    f"would overwrite the rolled-back rows"
                )
            self._apply_published(published)
        except BaseException:
            self._slots.close()
            raise
        super().__init__(max_size=self._capacity_rows or UNBOUNDED_ROWS)
        if lock is not None:
            if "fields" not in manifest or not manifest.get(SLOT_FILES_CREATED):
                # made before manifests recorded them (its state was found intact above): record them
                self._slots.create_files()
                publish_json(path / MANIFEST_NAME, {**manifest, "fields": fields_json(self._fields),
                                                    SLOT_FILES_CREATED: True}, durable=True)
            if self._checksums_from is None:  # a state from before it was recorded
                self._checksums_from = checksums.first_of_unbroken_checksums(path, self._segments, self._segment_rows)
            self._recover_tail()

    def _apply_published(self, published: Published | None) -> None:
        if published is None:
            return
        if published.rollback is not None:
            message = published.rollback.describe(self._path)
            if message not in self._warned:
                self._warned.add(message)
                warnings.warn(message, StoreDamageWarning, stacklevel=4)
        if published.seq:
            self._apply_manifest(published.state, published.source)
        self._seq = published.seq

    def _apply_manifest(self, manifest: dict, path: Path) -> None:
        check_header(manifest, path, backend=BACKEND, format_version=FORMAT_VERSION)
        self._schema = schema_from_manifest(manifest, path)
        try:
            self._segment_rows = int(manifest["segment_rows"])
            self._capacity_rows = manifest["capacity_rows"]
            self._evict_grace_s = float(manifest["evict_grace_s"])
            self._first_row = int(manifest["first_row"])
            self._next_row = int(manifest["next_row"])
            segments = [SegmentState.from_json(s) for s in manifest["segments"]]
            self._evicted: list[list] = [list(e) for e in manifest["evicted"]]
            self._published_open_checksums = open_segment_checksums(manifest)
            checksums_from = manifest.get(CHECKSUMS_FROM)
            self._checksums_from: int | None = None if checksums_from is None else int(checksums_from)
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreCorruptedError(f"{path} is missing or has a malformed entry: {exc!r}") from None
        self._segments = {s.id: s for s in segments}
        for seg_id in [i for i in self._views if i not in self._segments]:
            self._unmap(seg_id)

    def _manifest(self) -> dict[str, Any]:
        state = {
            "backend": BACKEND,
            "format_version": FORMAT_VERSION,
            "schema": self._schema.to_json(),
            "segment_rows": self._segment_rows,
            "capacity_rows": self._capacity_rows,
            "evict_grace_s": self._evict_grace_s,
            "first_row": self._first_row,
            "next_row": self._next_row,
            "segments": [s.to_json() for s in self._segments.values()],
            "evicted": self._evicted,
        }
        if self._checksums_from is not None:
            state[CHECKSUMS_FROM] = self._checksums_from
        if self._tail_writer is not None:
            # the open segment has no checksums.json until sealed: its published bytes' CRCs
            # travel with each publish instead (`inspect --verify` checks them)
            state[OPEN_SEGMENT_CHECKSUMS] = [max(self._segments), self._tail_writer.written_checksums()]
        return state

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

    # ================================================================ contract properties
    @property
    def writable(self) -> bool:
        return self._lock is not None and not self._closed

    def _segment_dir(self, seg_id: int) -> Path:
        return self._path / segment_dir_name(seg_id)

    # ================================================================ writing
    def _append_validated(self, batch: TrajectoryBatch) -> None:
        self._check_open()
        published = (self._first_row, self._next_row, dict(self._segments), list(self._evicted))
        try:
            self._write_rows(batch)
            self._evict_over_capacity()
            self._slots.publish(self._seq + 1, self._manifest(), durable=self._durable)
            self._seq += 1
            self._published_open_checksums = (None if self._tail_writer is None else
                                              (max(self._segments), self._tail_writer.written_sums()))
        except BaseException:
            if self._publish_landed():
                # interrupted (Ctrl-C) after the new state reached its slot: the rows are
                # committed, and rolling the files back would cut published bytes
                self._seq += 1
                raise
            # back to the last published state; the files drop the unpublished bytes
            self._first_row, self._next_row, self._segments, self._evicted = published
            if self._tail_writer is not None:
                self._tail_writer.close()
                self._tail_writer = None
            self._recover_tail()
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

    # ================================================================ reading
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

    # ================================================================ lifecycle
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._tail_writer is not None:
            if os.getpid() == self._owner_pid:
                # a forked child's view may be stale: only the opening process trims
                self._tail_writer.trim(self._segments[max(self._segments)])
            self._tail_writer.close()
            self._tail_writer = None
        for view in self._views.values():
            view.close()
        self._views.clear()
        self._padded_cache = None
        self._slots.close()
        if self._lock is not None:
            self._lock.release()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"{self.location} was closed; open it again to use it")

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # ================================================================ stats and snapshots
    def stats(self) -> StoreStats:
        """Summary from the files (``rlhf-pipeline inspect`` computes the same without torch)."""
        from rlhf_pipeline.storage.memmap.inspection import stats

        self.refresh()
        return stats(self._location)

    def snapshot_to(self, path: str) -> None:
        """Copies the published rows (same global ids) into a new store at ``path``."""
        self.refresh()
        target = Path(path)
        if target.exists() and (not target.is_dir() or any(target.iterdir())):
            raise FileExistsError(f"snapshot target {target} exists and is not an empty directory")
        target.mkdir(parents=True, exist_ok=True)
        for seg_id in sorted(self._segments):
            state = self._segments[seg_id]
            copy_segment(self._view(seg_id), self._schema, state, target / segment_dir_name(seg_id),
                         sealed=state.rows == self._segment_rows)
        manifest = self._manifest()
        manifest["evicted"] = []
        manifest["fields"] = fields_json(self._fields)
        manifest[SLOT_FILES_CREATED] = True
        StateSlots(target, stem=STATE_STEM).create_files()
        publish_json(target / MANIFEST_NAME, manifest, durable=True)


def _segment_of_path(filename: str | None) -> int | None:
    if not filename:
        return None
    path = Path(filename)
    for part in (path.parent.name, path.name):
        seg_id = layout.segment_id_of(part)
        if seg_id is not None:
            return seg_id
    return None
