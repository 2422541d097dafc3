"""Zarr v3 trajectory store: the memmap contract on local directories, zip files and fsspec URLs.

This module creates and opens the store (``ZarrTrajectoryStore``), follows its commit record and closes
it; the class takes its writer side from :mod:`.appending`, its reads from :mod:`.reading`, its layout and
codecs from :mod:`.layout`. ``mode="a"`` takes the writer lock (an ``flock`` for a local path or
``file://`` URL, a leased lock object on ``s3://`` and ``az://``: :mod:`.object_store`; other URLs cannot
be locked, so one writer per store is the caller's duty), deletes the units no record names and seals the
complete segments a killed writer left as fragments.
Design: docs/zarr-layout.md#consistency-rules-what-makes-it-safe-without-a-synchronizer."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from rlhf_pipeline.schema import StoreSchema
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
from rlhf_pipeline.storage.segmented import (
    SegmentedTrajectoryStore,
    check_reopened_layout,
    check_segment_layout,
    require_new_directory,
    writer_state_of,
)
from rlhf_pipeline.storage.zarr.appending import ZarrAppending
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
from rlhf_pipeline.storage.zarr.reading import ZarrReading
from rlhf_pipeline.storage.zarr.unit_cache import SegmentCache
from rlhf_pipeline.storage.zarr.unit_constants import parse_constants
from rlhf_pipeline.storage.zarr.units import UnitCodecs, UnitIO, UnitRef
from rlhf_pipeline.storage.zarr.writer import Collector, Sealer, complete_segments

DEFAULT_SEGMENT_ROWS = 4096
DEFAULT_CACHE_BYTES = 512 * 2**20


# ======================================================================== the store
class ZarrTrajectoryStore(ZarrAppending, ZarrReading, SegmentedTrajectoryStore):
    """Ragged trajectory rows in a Zarr v3 hierarchy; its guarantees and how they are kept are on
    docs/zarr-layout.md (consistency rules, the store inside) and docs/guarantees.md."""

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
        self._writer_state = writer_state_of(record, f"{self._location}/zarr.json")

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

            # said as what it is: a full disk's bare "[Errno 28] ... c.0" read as a second failure
            logging.getLogger(__name__).warning(
                "%s: merging the open segment's fragments at close failed (%s); they stay published and "
                "readable, and the next writer merges them", self._location, exc)
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
