"""Zarr v3 trajectory store: the memmap contract on local directories, zip files and fsspec URLs.

Why one file: the store class keeps the ``TrajectoryStore`` contract in one place; layout, units,
unit cache, writer, location, padded reads, snapshots and repair are already modules of their own
in this folder.

Layout and codecs are in :mod:`rlhf_pipeline.storage.zarr.layout` (and
``docs/zarr-layout.md``). How it stays consistent without a synchronizer:

* **Write, then publish.** An append writes a new *unit* (new keys only), then
  replaces the root ``zarr.json`` whose attributes are the commit record (row
  count and the list of units). A local store replaces it with an atomic rename
  (``manifest.publish_json``); a remote store with a single PUT. A reader sees
  the old or the new record, and every unit either record names is complete.
* **Append fragments, compact into segments.** An append cuts its batch at segment
  boundaries: a whole segment is written sealed; any other piece becomes a *packed
  fragment* (all its arrays in one raw chunk: two files, one ``writev``). The append
  that completes a segment hands it to a background thread (:mod:`.writer`),
  which writes the segment, publishes, and only then deletes the fragments; publishes
  are serialized by a lock. A crash in between leaves orphans that the next writer
  deletes when it opens the store, and complete fragments it seals again. ``close``
  merges the open segment's fragments into one.
* **Checked reads.** Every chunk of a format 2 unit ends with a CRC32C checked when it is
  decoded (cheap next to decompression), and every chunk must decode to exactly the size
  the record implies: damage raises ``StoreCorruptedError`` naming the chunk, never wrong
  rows, and only the damaged unit's rows are unreadable.
* **One sync per durable publish.** The unit's files and ``zarr.json.partial`` are
  flushed together (their fsyncs at once for a small unit, ``syncfs`` for a big one),
  then the rename and an fsync of the directory.
* **One writer.** ``mode="a"`` takes the ``flock`` in ``writer.lock`` for a local
  path or ``file://`` URL, and a leased lock object for ``s3://`` (whose units are
  created only and whose record is compare-and-swapped: :mod:`.object_store`). Other
  URLs cannot be locked: one writer per store is then the caller's duty.
* **Read from decoded units.** One Zarr read costs ~1 ms, so rows are served from
  whole decoded units held in a byte-bounded LRU (:mod:`.unit_cache`); a read of fields the record
  knows to be constant in a unit is answered without it (:mod:`.unit_constants`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from rlhf_pipeline.schema import StoreSchema, TrajectoryBatch
from rlhf_pipeline.storage.base import (
    IncompatibleStoreError,
    NotAStoreError,
    ReadOnlyStoreError,
    StoreClosedError,
    StoreCorruptedError,
    StoreNotFoundError,
    StoreStats,
)
from rlhf_pipeline.storage.locking import WriterLock
from rlhf_pipeline.storage.manifest import ManifestWatcher
from rlhf_pipeline.storage.padded_rows import LocatedRows
from rlhf_pipeline.storage.segmented import (
    DroppedSegment,
    SegmentedTrajectoryStore,
    check_reopened_layout,
    check_segment_layout,
    require_new_directory,
)
from rlhf_pipeline.storage.zarr.layout import (
    CHECKSUM,
    DEFAULT_CODEC,
    FORMAT_VERSION,
    FRAGMENT_CODEC,
    GROUP_METADATA,
    UNITS_PREFIX,
    arrays_json,
    arrays_of,
    field_layout,
    resolve_codec,
    unit_arrays,
)
from rlhf_pipeline.storage.zarr.location import (
    ROOT_META,
    Location,
    check_writable_dir,
    lock_for,
    parse_record,
    publish,
    resolve,
)
from rlhf_pipeline.storage.zarr.object_store import default_refresh_interval_s
from rlhf_pipeline.storage.zarr.padded import locate_rows
from rlhf_pipeline.storage.zarr.unit_constants import (RECORD_KEY, answerable, constants_of, parse_constants,
                                                      record_entry, unit_from_record, unit_key)
from rlhf_pipeline.storage.zarr.unit_cache import (
    DecodedUnit,
    SegmentCache,
    concat_arrays,
    encode_columns,
    gather_rows,
    slice_arrays,
)
from rlhf_pipeline.storage.zarr.units import (
    PACKED_FRAGMENT,
    SEALED_PACKED,
    UnitCodecs,
    UnitGone,
    UnitIO,
    UnitRef,
)
from rlhf_pipeline.storage.zarr.writer import Collector, Sealer, complete_segments, plan_pieces

DEFAULT_SEGMENT_ROWS = 4096
DEFAULT_CACHE_BYTES = 512 * 2**20


# ======================================================================== the store
class ZarrTrajectoryStore(SegmentedTrajectoryStore):
    """Ragged trajectory rows in a Zarr v3 hierarchy; see the module docstring for guarantees."""

    backend_name = "zarr"
    supports_field_subset = True
    supports_fused_padding = True

    def __init__(self, location: str, loc: Location, record: dict[str, Any], *, writable: bool,
                 cache_bytes: int, durable: bool, lock: WriterLock | None, watcher: ManifestWatcher | None):
        try:
            schema = StoreSchema.from_json(record["schema"])
        except ValueError as exc:
            raise IncompatibleStoreError(f"{location}: {exc}") from None
        capacity = record.get("capacity_rows")
        super().__init__(max_size=capacity)
        self._location = location
        self._loc = loc
        self._schema = schema
        self._arrays = arrays_of(record, location)
        if self._arrays != unit_arrays(schema):
            raise StoreCorruptedError(f"{location}/zarr.json: its 'arrays' do not match its schema")
        if writable and record.get("format_version") != FORMAT_VERSION:
            # a format 1 store: its units stay as they are (still read), new units are format 2
            record = dict(record, format_version=FORMAT_VERSION, arrays=arrays_json(self._arrays),
                          chunk_checksum=CHECKSUM)
        codecs = UnitCodecs(record["codec"], record.get("fragment_codec", record["codec"]))
        self.unit_io = UnitIO(loc, self._arrays, codecs, durable=durable)  # public: snapshots copy through it
        self._segment_rows = int(record["segment_rows"])
        self._capacity_rows = None if capacity is None else int(capacity)
        self._writable = writable
        self._durable = durable
        self._lock = lock
        self._watcher = watcher
        self._cache = SegmentCache(cache_bytes)
        self._collector = Collector(loc.kv)
        self._sealer = Sealer(self._seal)
        self._publish_lock = threading.Lock()  # the append path and the background sealer publish
        self._closed = False
        self.refresh_interval_s = 0.0
        self._refreshed_at = time.monotonic()  # the record was just read
        self._apply(record)

    # ---------------------------------------------------------------- construction
    @classmethod
    def create(cls, location: str, schema: StoreSchema | None = None, *, capacity_rows: int | None = None,
               segment_rows: int = DEFAULT_SEGMENT_ROWS, codec: str | dict = DEFAULT_CODEC,
               cache_bytes: int = DEFAULT_CACHE_BYTES, storage_options: dict | None = None,
               durable: bool = True, exist_ok: bool = False,
               lock_lease_s: float | None = None, lock_wait_s: float = 0.0) -> ZarrTrajectoryStore:
        """Creates an empty store at ``location`` and opens it for appending.

        ``segment_rows`` rows make a sealed segment (the unit of caching and eviction);
        ``capacity_rows`` bounds the rows held (oldest sealed segments are dropped);
        ``codec`` is a preset name (``blosc-zstd``, ``blosc-lz4``, ``zstd``, ``none``) or a
        dict such as ``{"name": "blosc", "cname": "zstd", "clevel": 5, "shuffle": "bitshuffle"}``;
        ``cache_bytes`` bounds the decoded segments held in memory; ``durable`` fsyncs data
        and the commit record so a publish survives power loss (a killed process loses
        nothing published either way). ``exist_ok=True`` reopens an existing Zarr store
        with the same schema, segment size and capacity instead of failing. ``storage_options``
        go to fsspec (for ``s3://``: s3fs's ``key``, ``secret``, ``endpoint_url``, ...);
        ``lock_lease_s`` is the lease of an ``s3://`` store's writer lock (30 s by default);
        ``lock_wait_s`` how long to wait for that lock while another writer holds it (0: fail
        at once with :class:`StoreLockedError`), logging whose lease it is and until when: a
        writer restarted on another machine waits out its dead predecessor's lease this way.
        """
        location = str(location)
        schema = schema or StoreSchema()
        check_segment_layout(segment_rows, capacity_rows)
        codec_config = resolve_codec(codec)
        loc = resolve(location, read_only=False, storage_options=storage_options)
        if loc.local_root is not None:
            check_writable_dir(loc.local_root, location)
        if loc.kv.get(ROOT_META) is not None:
            if not exist_ok:
                raise FileExistsError(
                    f"{location} already holds a Zarr node; open it with ZarrTrajectoryStore.open("
                    f"{location!r}, mode='a'), or pass exist_ok=True"
                )
            store = cls.open(location, "a", cache_bytes=cache_bytes, storage_options=storage_options,
                             durable=durable, lock_lease_s=lock_lease_s, lock_wait_s=lock_wait_s)
            return check_reopened_layout(store, schema, segment_rows, capacity_rows)
        if loc.local_root is not None:
            require_new_directory(loc.local_root, location)
        if hasattr(loc.kv, "mark_creating"):  # no rename at a URL: an object says "being made" until published
            loc.kv.mark_creating()
        lock = lock_for(loc, location, lease_s=lock_lease_s, wait_s=lock_wait_s)
        try:
            existing = loc.kv.get(ROOT_META)
            if existing is not None:
                # Another creator published between the check above and this lock (on S3 the lock
                # may have been waited for): "new or existing" is decided again under the lock, or
                # an empty record would replace its acknowledged rows.
                if not exist_ok:
                    raise FileExistsError(
                        f"{location} was created by another process meanwhile; open it with "
                        f"ZarrTrajectoryStore.open({location!r}, mode='a'), or pass exist_ok=True"
                    )
                store = cls._resume_writer(location, loc, parse_record(existing, location, loc), lock=lock,
                                           cache_bytes=cache_bytes, durable=durable)
                return check_reopened_layout(store, schema, segment_rows, capacity_rows)
            record = {
                "backend": "zarr", "format_version": FORMAT_VERSION, "schema": schema.to_json(),
                "codec": codec_config, "segment_rows": int(segment_rows), "capacity_rows": capacity_rows,
                "fragment_codec": codec_config if codec_config["name"] == "none" else FRAGMENT_CODEC,
                "first_row": 0, "next_row": 0, "units": [], "fields": field_layout(schema),
                "arrays": arrays_json(unit_arrays(schema)), "chunk_checksum": CHECKSUM,
            }
            loc.kv.put_many({f"{UNITS_PREFIX}/{ROOT_META}": GROUP_METADATA}, durable=durable)
            publish(loc, record, durable=durable)
            return cls(location, loc, record, writable=True, cache_bytes=cache_bytes, durable=durable,
                       lock=lock, watcher=None)
        except BaseException:
            if lock is not None:
                lock.release()
            raise

    @classmethod
    def open(cls, location: str, mode: str = "r", *, cache_bytes: int = DEFAULT_CACHE_BYTES,
             storage_options: dict | None = None, durable: bool = True,
             lock_lease_s: float | None = None, lock_wait_s: float = 0.0,
             refresh_interval_s: float | None = None) -> ZarrTrajectoryStore:
        """Opens an existing store: ``mode="r"`` reads (no lock), ``mode="a"`` appends.

        ``durable`` (a writer's: fsync before each publish) defaults to True, as everywhere;
        ``storage_options``, ``lock_lease_s`` and ``lock_wait_s`` as for :meth:`create`.
        ``refresh_interval_s`` (a reader's): re-read the commit record at most this often,
        however often ``refresh()``/``len()`` are called; by default 1 s on an object store
        (a GET each) and 0 elsewhere (a local refresh costs one ``fstat``).
        """
        location = str(location)
        if mode not in ("r", "a"):
            raise ValueError(f"mode must be 'r' or 'a', got {mode!r}")
        if refresh_interval_s is None:
            refresh_interval_s = default_refresh_interval_s(location)
        if not refresh_interval_s >= 0:
            raise ValueError(f"refresh_interval_s must be >= 0 seconds, got {refresh_interval_s!r}")
        writable = mode == "a"
        if writable and location.endswith(".zip") and "://" not in location:
            raise ReadOnlyStoreError(
                f"{location} is a zip file, which this library only reads; open it with mode='r', or "
                f"convert it to a directory store to append"
            )
        loc = resolve(location, read_only=not writable, storage_options=storage_options)
        if loc.local_root is not None and not loc.local_root.is_dir():
            loc.kv.close()
            if not loc.local_root.exists():
                raise StoreNotFoundError(f"{location} does not exist")
            raise NotAStoreError(f"{location} is not a replay buffer: it is a file, not a directory")
        watcher = None
        if loc.local_root is not None and not writable:
            watcher = ManifestWatcher(loc.local_root / ROOT_META, what="Zarr replay buffer")
            try:
                record = parse_record(_read_watched(watcher), location, loc)
            except BaseException:
                watcher.close()
                raise
        else:
            record = parse_record(loc.kv.get(ROOT_META), location, loc)
        lock = None
        if writable:
            if loc.local_root is not None:
                check_writable_dir(loc.local_root, location)
            lock = lock_for(loc, location, lease_s=lock_lease_s, wait_s=lock_wait_s)
        try:
            if writable:
                record = parse_record(loc.kv.get(ROOT_META), location, loc)  # the lock holder's last publish
                store = cls._resume_writer(location, loc, record, lock=lock, cache_bytes=cache_bytes,
                                           durable=durable)
            else:
                store = cls(location, loc, record, writable=False, cache_bytes=cache_bytes, durable=durable,
                            lock=None, watcher=watcher)
            store.refresh_interval_s = float(refresh_interval_s)
            return store
        except BaseException:
            if lock is not None:
                lock.release(remove_if_created=True)
            if watcher is not None:
                watcher.close()
            raise

    @classmethod
    def _resume_writer(cls, location: str, loc: Location, record: dict[str, Any], *, lock: WriterLock | None,
                       cache_bytes: int, durable: bool) -> ZarrTrajectoryStore:
        """The lock holder's store over its last publish: what a killed writer left unpublished is
        deleted, and the fragments it did not seal yet are sealed."""
        store = cls(location, loc, record, writable=True, cache_bytes=cache_bytes, durable=durable,
                    lock=lock, watcher=None)
        store._delete_orphans()
        for first_row in complete_segments(store._units, store._segment_rows):
            store._sealer.submit(first_row)
        return store

    @classmethod
    def detect(cls, location: str) -> bool:
        """True when ``location`` holds a Zarr replay buffer, or a damaged one; never raises."""
        from rlhf_pipeline.storage.zarr.inspection import detect

        return detect(location)

    # ---------------------------------------------------------------- published state
    def _apply(self, record: dict[str, Any]) -> None:
        try:
            units = [UnitRef(int(a), int(b), int(c)) for a, b, c in record["units"]]
            first_row, next_row = int(record["first_row"]), int(record["next_row"])
            if any(u.kind not in (0, 1, 2, 3, 4) for u in units):
                raise ValueError("unknown unit kind")
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreCorruptedError(f"{self._location}/zarr.json has a malformed commit record: {exc!r}") from None
        constants = parse_constants(record, self._location)
        self._record = record
        self._view = (units, np.array([u.first_row for u in units], dtype=np.int64))  # read as one
        self._constants = constants  # by unit identity, so any view's units may look theirs up
        self._units = units
        self._first_row = first_row
        self._next_row = next_row

    @property
    def writable(self) -> bool:
        return self._writable

    @property
    def cache(self) -> SegmentCache:
        return self._cache

    @property
    def writer_lease_s(self) -> float | None:
        """The lease of this writer's lock on an object store; None for a reader or a local store."""
        return getattr(self._lock, "lease_s", None)

    @property
    def published_record(self) -> dict[str, Any]:
        """The commit record this store's view follows (a reader's last refresh)."""
        return self._record

    def adopt_record(self, record: dict[str, Any]) -> None:
        """A reader takes ``record``, read by another process's refresh, as its own view without a
        request (data-parallel ranks share rank 0's refresh: ``learn/distributed.py``)."""
        if self._writable:
            raise ReadOnlyStoreError(f"{self._location}: a writer's view is its own publishes; only a reader adopts")
        self._apply(record)
        self._refreshed_at = time.monotonic()
        self._cache.retain({u.name for u in self._units})

    def refresh(self, *, force: bool = False) -> int:
        """A reader re-reads the commit record, unless it did less than ``refresh_interval_s``
        ago (``force`` reads it anyway); returns the rows held."""
        self._check_open()
        if not self._writable:
            now = time.monotonic()
            if not force and now - self._refreshed_at < self.refresh_interval_s:
                return self._published_len()
            self._refreshed_at = now
            if self._watcher is not None:
                if self._watcher.changed():
                    self._apply(parse_record(_read_watched(self._watcher), self._location, self._loc))
            else:
                self._apply(parse_record(self._loc.kv.get(ROOT_META), self._location, self._loc))
            self._cache.retain({u.name for u in self._units})
        return self._published_len()

    def flush(self) -> None:
        """Waits for background seals and deletions (appends are published already)."""
        self._sealer.wait()
        self._collector.wait()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._sealer.shutdown()
            if self._writable:
                self._merge_tail()
        except Exception as exc:  # noqa: BLE001 - the fragments stay published; the next writer seals them
            import logging

            logging.getLogger(__name__).warning("%s", exc)
        self._collector.wait()
        self._cache.clear()
        if self._watcher is not None:
            self._watcher.close()
        if self._lock is not None:
            self._lock.release()
        self._loc.kv.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"{self._location} was closed; open it again to use it")

    # ---------------------------------------------------------------- writing
    def _append_validated(self, batch: TrajectoryBatch) -> None:
        self._check_open()
        self._sealer.check()
        n, start = len(batch), self._next_row  # only this thread moves next_row
        arrays = encode_columns(batch, self._schema)
        pieces, complete, constants = [], [], {}
        for pos, rows, whole, completes in plan_pieces(start, n, self._segment_rows):
            part = arrays if rows == n else slice_arrays(arrays, self._arrays, pos, pos + rows)
            unit = UnitRef(start + pos, rows, SEALED_PACKED if whole else PACKED_FRAGMENT)
            pieces.append((unit, part))
            constants[unit_key(unit)] = constants_of(part)
            if completes:
                complete.append(start + pos + rows - self._segment_rows)
        written = [unit for unit, _ in pieces]
        try:
            pending = [self.unit_io.write(unit, part) for unit, part in pieces]
        except BaseException:  # a full disk: nothing published, and the space the units took is back
            self.unit_io.discard(written, published={u.name for u in self._units})
            raise
        try:
            with self._publish_lock:
                self._publish(self._units + written, start + n, pending, constants)
        except BaseException:
            self._resync_with_the_record(written)
            raise
        for unit, part in pieces:
            self._cache.put(unit.name, DecodedUnit(unit.first_row, unit.rows, part))
        for first_row in complete:
            self._sealer.submit(first_row)
        if complete and self._capacity_rows is not None:
            self._sealer.wait()  # eviction drops sealed segments only: keep the bound exact

    def _resync_with_the_record(self, written: list[UnitRef]) -> None:
        """After a publish that raised (Ctrl-C, a failed request, a full disk) the writer takes its state
        from the record, which may or may not have landed (else it would reuse published row ids), and
        discards the ``written`` units it does not name."""
        try:
            record = parse_record(self._loc.kv.get(ROOT_META), self._location, self._loc)
        except Exception:  # noqa: BLE001 - unreadable now: appending on could overwrite, so stop
            self._closed = True
            if self._lock is not None:
                self._lock.release()
            return
        with self._publish_lock:
            self._apply(record)
            self.unit_io.discard(written, published={u.name for u in self._units})

    def _publish(self, units: list[UnitRef], next_row: int, pending, constants=None) -> None:
        """Publishes ``units`` (caller holds the publish lock), then drops what fell out; ``constants``:
        the new units' constant fields (:mod:`.unit_constants`)."""
        names = {u.name for u in units}
        dropped = [u for u in self._units if u.name not in names]
        if self._capacity_rows is not None:
            # as memmap: drop the oldest sealed segments while more than capacity rows are held
            while units[0].sealed and next_row - units[0].first_row > self._capacity_rows:
                dropped.append(units.pop(0))
        record = dict(self._record, first_row=units[0].first_row, next_row=next_row,
                      units=[[u.first_row, u.rows, u.kind] for u in units])
        record[RECORD_KEY] = record_entry(units, {**self._constants, **(constants or {})})
        publish(self._loc, record, durable=self._durable, pending=pending)
        self._apply(record)
        self._cache.retain({u.name for u in units})
        for unit in dropped:
            self._collector.delete(unit.prefix)

    def _drop_sealed_before(self, global_row: int) -> list[DroppedSegment]:
        """Retention's drop: the sealed segments wholly before ``global_row`` leave the commit record
        in one publish; their objects (files) are deleted right after, as evicted ones are."""
        self._check_open()
        self._sealer.wait()  # a completed segment is sealed first: only sealed segments are dropped
        with self._publish_lock:
            units, dropped = list(self._units), []
            while len(units) > 1 and units[0].sealed and units[0].first_row + units[0].rows <= global_row:
                dropped.append(units.pop(0))
            if not dropped:
                return []
            sizes = [DroppedSegment(u.first_row, u.rows, self._loc.kv.size_of(u.prefix)) for u in dropped]
            self._publish(units, self._next_row, [])
        self._collector.wait()  # the space is free when this returns
        return sizes

    def _seal(self, first_row: int) -> None:
        """Background: rewrites the fragments of segment ``first_row`` as one sealed segment."""
        size = self._segment_rows
        with self._publish_lock:
            fragments = [u for u in self._units if not u.sealed and first_row <= u.first_row < first_row + size]
        if sum(u.rows for u in fragments) != size:
            return  # sealed already
        rows = concat_arrays([self._unit(u).arrays for u in fragments], self._arrays)
        segment = UnitRef(first_row, size, SEALED_PACKED)
        pending = self.unit_io.write(segment, rows, threaded=False)
        with self._publish_lock:
            replaced = {u.name for u in fragments}
            units = [u for u in self._units if u.name not in replaced]
            at = next((i for i, u in enumerate(units) if u.first_row > first_row), len(units))
            self._publish(units[:at] + [segment] + units[at:], self._next_row, [pending],
                          {unit_key(segment): constants_of(rows)})
        self._cache.put(segment.name, DecodedUnit(first_row, size, rows))

    def _merge_tail(self) -> None:
        """On close: the open segment's fragments become one, so a closed store holds at most
        one fragment (two files) besides its sealed segments."""
        open_start = self._next_row - self._next_row % self._segment_rows
        tail = [u for u in self._units if not u.sealed and u.first_row >= open_start]
        if len(tail) < 2 and all(u.kind == PACKED_FRAGMENT for u in tail):
            return
        rows = concat_arrays([self._unit(u).arrays for u in tail], self._arrays)
        unit = UnitRef(tail[0].first_row, sum(u.rows for u in tail), PACKED_FRAGMENT)
        pending = self.unit_io.write(unit, rows)
        with self._publish_lock:
            replaced = {u.name for u in tail}
            self._publish([u for u in self._units if u.name not in replaced] + [unit], self._next_row, [pending],
                          {unit_key(unit): constants_of(rows)})

    def _delete_orphans(self) -> None:
        """Deletes units no commit record names: left by a writer that died before publishing."""
        published = {u.name for u in self._units}
        for name in self._loc.kv.list_dir(UNITS_PREFIX):
            if name != ROOT_META and name not in published and not name.endswith(".partial"):
                self._loc.kv.delete_prefix(f"{UNITS_PREFIX}/{name}")

    # ---------------------------------------------------------------- reading
    def unit_bounds(self) -> list[tuple[int, int]]:
        """One range per published unit (sealed segment or tail fragment): a read decodes whole units."""
        units, _ = self._view
        first, stop = self._first_row, self._next_row
        return [(max(u.first_row, first) - first, min(u.first_row + u.rows, stop) - first)
                for u in units if min(u.first_row + u.rows, stop) > max(u.first_row, first)]

    def _read_global(self, global_ids: torch.Tensor, fields: tuple[str, ...] | None = None) -> TrajectoryBatch:
        names = self._schema.field_names if fields is None else fields
        return self._with_current_units(global_ids.numpy(), lambda ids, view: self._gather(ids, names, view))

    def _locate_rows(self, global_ids: torch.Tensor) -> LocatedRows:
        return self._with_current_units(global_ids.numpy(), lambda ids, view: locate_rows(self, ids, view))

    def _with_current_units(self, ids: np.ndarray, read: Callable[[np.ndarray, Any], Any]) -> Any:
        """``read(ids, units view)``, retried on a newer view when a unit was deleted under it."""
        self._check_open()
        view = self._view
        for _ in range(16):
            try:
                return read(ids, view)
            except UnitGone as gone:
                missing = gone
            # compacted or evicted after the record we read (a reader's last refresh, or a seal on
            # this writer's background thread): the rows live on in a unit the newer record names
            if not self._writable:
                self.refresh(force=True)
                if ids.size and int(ids.min()) < self._first_row:
                    raise IndexError(
                        f"rows from {int(ids.min())} were evicted while being read; the store now holds "
                        f"[{self._first_row}, {self._next_row})"
                    ) from None
            if self._view is view:
                break
            view = self._view
        raise StoreCorruptedError(
            f"{self._location}: chunk {missing} of a published unit is missing; the store was "
            f"damaged outside this library. The store's other units still read; "
            f"`rlhf-pipeline repair {self._location}` reports what is lost."
        ) from None

    def _gather(self, ids: np.ndarray, names: tuple[str, ...], view) -> TrajectoryBatch:
        units, starts = view
        which = np.searchsorted(starts, ids, side="right") - 1
        constants = self._constants if answerable(names) else {}

        def parts():
            for k in np.unique(which).tolist():
                positions = np.flatnonzero(which == k)
                unit = units[k]
                known = unit_from_record(unit, constants, names) if constants else None
                if known is not None:  # the record holds these fields' one value: no GET, no decode
                    yield positions, np.zeros(positions.size, dtype=np.int64), lambda known=known: known
                    continue
                yield positions, ids[positions] - unit.first_row, lambda unit=unit: self._unit(unit)

        return gather_rows(self._schema, names, ids.size, parts())

    def _unit(self, unit: UnitRef) -> DecodedUnit:
        return self._cache.get(unit.name, lambda: self._load_unit(unit))

    def _load_unit(self, unit: UnitRef) -> DecodedUnit:
        return DecodedUnit(unit.first_row, unit.rows, self.unit_io.read(unit))

    # ---------------------------------------------------------------- summary and copies
    def stats(self) -> StoreStats:
        """Summary from the units' small arrays (``rlhf-pipeline inspect`` computes the same without torch)."""
        from rlhf_pipeline.storage.zarr.inspection import summarize

        self.flush()
        self.refresh(force=True)
        stats = summarize(self._loc, self._record, self._location)
        stats.extra.update(cache_bytes=self._cache.capacity_bytes, cached_bytes=self._cache.nbytes)
        return stats

    @property
    def units(self) -> list[UnitRef]:
        """The published units, once background seals are done."""
        self._sealer.wait()
        return list(self._units)

    def snapshot_to(self, path: str) -> None:
        """Copies the published units byte for byte into a new Zarr store at ``path`` (:mod:`.snapshot`)."""
        from rlhf_pipeline.storage.zarr.snapshot import write_snapshot

        write_snapshot(self, path)


# ======================================================================== helpers
def _read_watched(watcher: ManifestWatcher) -> dict | None:
    try:
        return watcher.read()
    except NotAStoreError:
        return None
