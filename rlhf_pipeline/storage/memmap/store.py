"""The memory-mapped trajectory store (``MemmapTrajectoryStore``): creating and opening one, its published
state, closing it.

The class is assembled from one module per job: this one creates and opens the store and keeps its
published state (``manifest.json`` and the state slots of :mod:`.state_slots`); appending and publishing
are in :mod:`.appending`, eviction and retention's drop in :mod:`.eviction`, reads in :mod:`.reading`.
Segment ``k`` holds global rows ``[k*S, (k+1)*S)``. Design: docs/storage.md#inside-the-memmap-store;
what opening does with a damaged store: docs/guarantees.md#storage-both-backends."""

from __future__ import annotations

import os
import re
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

from rlhf_pipeline.files.atomic import publish_json
from rlhf_pipeline.schema import StoreSchema
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
from rlhf_pipeline.storage.memmap.appending import MemmapAppending
from rlhf_pipeline.storage.memmap.eviction import MemmapEviction
from rlhf_pipeline.storage.memmap.layout import (
    CHECKSUMS_FROM,
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
from rlhf_pipeline.storage.memmap.reading import MemmapReading
from rlhf_pipeline.storage.memmap.row_index import PaddedReadCache
from rlhf_pipeline.storage.memmap.segments import (
    SegmentState,
    SegmentWriter,
    copy_segment,
    segment_dir_name,
)
from rlhf_pipeline.storage.memmap.state_slots import StateSlots
from rlhf_pipeline.storage.memmap.views import SegmentView
from rlhf_pipeline.storage.segmented import (
    SegmentedTrajectoryStore,
    check_reopened_layout,
    check_segment_layout,
    require_new_directory,
    writer_state_entry,
    writer_state_of,
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


class MemmapTrajectoryStore(MemmapAppending, MemmapEviction, MemmapReading, SegmentedTrajectoryStore):
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
        self._writer_state = writer_state_of(manifest, str(path))
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
        return writer_state_entry(state, self._writer_state)

    # ================================================================ contract properties
    @property
    def writable(self) -> bool:
        return self._lock is not None and not self._closed

    def _segment_dir(self, seg_id: int) -> Path:
        return self._path / segment_dir_name(seg_id)

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
