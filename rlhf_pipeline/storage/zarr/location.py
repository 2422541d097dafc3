"""Where a Zarr trajectory store lives, and raw key/value access to it.

A local directory (files, ``flock``, atomic rename), a zip file (read-only, ``zarr.storage.ZipStore``) or any
fsspec URL (``zarr.storage.FsspecStore``; ``file://`` also gets the local lock and rename, ``s3://`` and
``az://`` conditional writes and a leased lock: :mod:`.object_store`). The store reads and writes whole
chunks here as key/value pairs, batched, not through Zarr arrays (one Zarr array call costs ~1 ms).

Why one file: the three kinds of location answer the same questions (open, read the commit record,
take the writer lock, publish) and the store asks them without knowing which kind it has.
Design: docs/zarr-layout.md#where-a-store-lives."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_pipeline.files.atomic import PARTIAL_SUFFIX, fsync_dir, publish_json, write_all
from rlhf_pipeline.files.cloud_objects import cloud_for
from rlhf_pipeline.storage.errors import (
    IncompatibleStoreError,
    NotAStoreError,
    ReadOnlyStoreError,
    StoreBeingCreatedError,
    StoreCorruptedError,
    StoreNotFoundError,
)
from rlhf_pipeline.storage.locking import LOCK_FILE_NAME, WriterLock
from rlhf_pipeline.storage.zarr.layout import ATTRS_KEY, READABLE_FORMATS, UNITS_PREFIX
from rlhf_pipeline.storage.zarr.store_kv import ZarrStoreKV
from rlhf_pipeline.storage.zarr.units import ROOT_META


# ======================================================================== key/value I/O
class LocalKV:
    """Keys as files under a directory; every put is atomic (temp file + rename)."""

    def __init__(self, root: str | os.PathLike, *, read_only: bool):
        self.root = Path(root)
        self.read_only = read_only
        self._pool = None

    def get(self, key: str) -> bytes | None:
        try:
            return (self.root / key).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def get_many(self, keys: Iterable[str]) -> list[bytes | None]:
        return [self.get(k) for k in keys]

    def put_many(self, items: Iterable[tuple[str, bytes]], *, durable: bool = False, threaded: bool = True,
                 defer_sync: bool = False) -> Pending | None:
        """Writes new keys of a unit nobody reads yet: plain writes, no temp file and rename.

        Units are immutable and only become visible through the commit record, so a
        crash mid-way leaves an orphan (deleted by the next writer), never a torn read.
        ``items`` may be a generator that encodes lazily: with ``threaded`` files are
        written on a worker thread meanwhile, so the file system's latency overlaps the
        compression. ``durable`` makes the bytes and the new names survive power loss
        before return; with ``defer_sync`` it returns what still needs syncing instead,
        for :func:`publish` to flush together with the commit record (one ``syncfs``).
        """
        if threaded and self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zarr-store-io")
        made: set[Path] = set()
        written: list[Path] = []

        def write(path: Path, value) -> None:
            if path.parent not in made:
                path.parent.mkdir(parents=True, exist_ok=True)
                made.add(path.parent)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                write_all(fd, value, path)  # a list: the buffers of one file, one writev
            finally:
                os.close(fd)

        futures = []
        for key, value in items.items() if isinstance(items, Mapping) else items:
            path = self.root / key
            written.append(path)
            if threaded:
                futures.append(self._pool.submit(write, path, value))
            else:
                write(path, value)
        for future in futures:
            future.result()
        if not (durable and written):
            return None
        if defer_sync:
            return Pending(written, made)
        _sync_paths(self.root, [Pending(written, made)])
        return None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def list_dir(self, prefix: str) -> list[str]:
        try:
            return sorted(p.name for p in (self.root / prefix).iterdir())
        except FileNotFoundError:
            return []

    def delete_prefix(self, prefix: str) -> None:
        import shutil

        shutil.rmtree(self.root / prefix, ignore_errors=True)

    def delete_unit(self, prefix: str, keys: list[str]) -> None:
        self.delete_prefix(prefix)  # its directory

    def size_of(self, prefix: str) -> int:
        total = 0
        for dirpath, _, files in os.walk(self.root / prefix):
            for name in files:
                try:
                    total += os.stat(os.path.join(dirpath, name)).st_size
                except FileNotFoundError:
                    pass
        return total


def _syncfs():
    """``syncfs(2)`` when the C library has it (Linux): one call flushes a whole unit's files."""
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int]
    return fn


_SYNCFS = _syncfs()


@dataclass
class Pending:
    """Files written (and directories created) whose durability is still owed."""

    files: list[Path]
    directories: set[Path]


def _syncfs_root(root: Path) -> bool:
    if _SYNCFS is None:
        return False
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return _SYNCFS(fd) == 0
    finally:
        os.close(fd)


def _sync_paths(root: Path, pending: Iterable[Pending]) -> None:

    pending = list(pending)
    if not pending or _syncfs_root(root):
        return
    for item in pending:  # portable fallback: every file, then every directory that got a new name
        for path in item.files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        for directory in sorted(item.directories, key=lambda d: len(d.parts), reverse=True):
            fsync_dir(directory)
            fsync_dir(directory.parent)


# ======================================================================== locations
@dataclass
class Location:
    kv: LocalKV | ZarrStoreKV
    local_root: Path | None  # set for local paths and file:// URLs: lock + atomic rename publish


def resolve(location: str, *, read_only: bool, storage_options: dict | None) -> Location:
    if "://" in location:
        from zarr.storage import FsspecStore

        from rlhf_pipeline.storage.zarr import object_store

        if object_store.is_object_store_url(location):  # conditional writes and a leased lock
            object_store.require_object_store_client(location)
            options = object_store.object_store_options(storage_options, location=location)
            try:
                store = FsspecStore.from_url(location, storage_options=options, read_only=read_only)
                kv = object_store.ObjectStoreKV(store, location, read_only=read_only)
            except Exception as exc:
                cloud = cloud_for(location)
                raise NotAStoreError(f"cannot open {location} on {cloud.name} ({type(exc).__name__}: {exc}); "
                                     f"check its credentials and endpoint: {cloud.credentials_hint}") from None
            return Location(kv, None)
        options = dict(storage_options or {})
        if location.startswith("file://"):
            options.setdefault("auto_mkdir", True)  # local fsspec does not create parents by itself
        try:
            store = FsspecStore.from_url(location, storage_options=options or None, read_only=read_only)
        except Exception as exc:
            raise NotAStoreError(f"cannot open {location} through fsspec ({type(exc).__name__}: {exc})") from None
        local = Path(location.removeprefix("file://")) if location.startswith("file://") else None
        return Location(ZarrStoreKV(store, read_only=read_only), local)
    if location.endswith(".zip"):
        if not read_only:
            raise ReadOnlyStoreError(
                f"{location} is a zip file, which this library only reads; convert it to a directory "
                f"store (rlhf-pipeline convert) or unzip it to append"
            )
        if not os.path.isfile(location):
            raise StoreNotFoundError(f"{location} does not exist")
        from zarr.core.sync import sync
        from zarr.storage import ZipStore

        try:
            store = sync(ZipStore.open(location, mode="r"))
        except Exception as exc:
            raise NotAStoreError(f"{location} is not a replay buffer: not a readable zip file ({exc})") from None
        return Location(ZarrStoreKV(store, read_only=True), None)
    return Location(LocalKV(location, read_only=read_only), Path(location))


def parse_root(raw: bytes | dict | None, location: str, *, units_exist: bool = False) -> dict[str, Any]:
    """The commit record in a root ``zarr.json``. ``units_exist`` tells that the location holds
    units, so a missing root document is damage (``StoreCorruptedError``), not "no store here"."""
    if raw is None:
        if units_exist:
            raise StoreCorruptedError(
                f"{location}/zarr.json is missing, but {location} holds units of a replay buffer: the store was "
                f"damaged outside this library. `rlhf-pipeline repair {location}` rebuilds it from the units."
            )
        raise NotAStoreError(
            f"{location} is not a replay buffer: it has no zarr.json. Check the path, or create one "
            f"with ZarrTrajectoryStore.create()."
        )
    try:
        doc = raw if isinstance(raw, dict) else json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        what = "is empty" if not raw else f"is not valid JSON ({exc})"
        raise StoreCorruptedError(
            f"{location}/zarr.json {what}: the store's commit record was damaged outside this library. "
            f"`rlhf-pipeline repair {location}` rebuilds it from the units."
        ) from None
    record = doc.get("attributes", {}).get(ATTRS_KEY) if isinstance(doc, dict) else None
    if not isinstance(record, dict):
        if units_exist:
            raise StoreCorruptedError(
                f"{location}/zarr.json holds no '{ATTRS_KEY}' commit record, but {location} holds units of a "
                f"replay buffer: the record was damaged. `rlhf-pipeline repair {location}` rebuilds it."
            )
        raise NotAStoreError(
            f"{location} is a Zarr node but not an rlhf_pipeline replay buffer (no '{ATTRS_KEY}' "
            f"attribute in zarr.json); check the path"
        )
    if record.get("backend") != "zarr":
        raise IncompatibleStoreError(f"{location} belongs to a {record.get('backend')!r} store, not 'zarr'")
    if record.get("format_version") not in READABLE_FORMATS:
        raise IncompatibleStoreError(
            f"{location} has zarr format version {record.get('format_version')}; this rlhf_pipeline "
            f"reads versions {', '.join(map(str, READABLE_FORMATS))}. Use a matching release, or convert the store."
        )
    return record


def parse_record(raw, location: str, loc: Location) -> dict[str, Any]:
    """The commit record; a missing or foreign root document is damage when units exist, and at an
    object-store URL a store being made when only its creation's objects are there."""
    try:
        return parse_root(raw, location)
    except NotAStoreError:
        if has_units(loc):
            return parse_root(raw, location, units_exist=True)  # raises StoreCorruptedError
        if raw is None:
            raise_if_being_created(loc)
        raise


def raise_if_being_created(loc: Location) -> None:
    """:class:`StoreBeingCreatedError` when ``loc`` (no record, no units) is a store being made at
    an object-store URL; a local one is made under another name and renamed, so never seen so."""
    being_created = getattr(loc.kv, "being_created", None)
    reason = being_created() if being_created is not None else None
    if reason is not None:
        raise StoreBeingCreatedError(reason)


def has_units(loc: Location) -> bool:
    """True when the location holds unit directories (a store, even one whose zarr.json is lost)."""
    try:
        return any(name != ROOT_META for name in loc.kv.list_dir(UNITS_PREFIX))
    except Exception:  # noqa: BLE001 - a listing that fails proves nothing either way
        return False


def _root_document(record: dict[str, Any]) -> dict[str, Any]:
    return {"zarr_format": 3, "node_type": "group", "attributes": {ATTRS_KEY: record}}


def publish(loc: Location, record: dict[str, Any], *, durable: bool, pending: Iterable[Pending | None] = ()) -> None:
    """Replaces the commit record; ``pending`` units' files are made durable first.

    Locally with ``syncfs``, one call flushes the units and ``zarr.json.partial``
    together before the rename (then the directory is fsynced), instead of a sync
    for the data and another for the record.
    """
    document = _root_document(record)
    if loc.local_root is None:
        loc.kv.publish_record(document)
        return
    pending = [p for p in pending if p is not None]
    if durable and sum(len(p.files) for p in pending) <= _TARGETED_FILES:
        _publish_targeted(loc.local_root, document, pending)
        return
    if durable and _SYNCFS is not None:

        path = loc.local_root / ROOT_META
        partial = path.with_name(path.name + PARTIAL_SUFFIX)
        fd = _write_partial_record(partial, document)
        try:
            if not _syncfs_root(loc.local_root):
                os.fsync(fd)
                _sync_paths(loc.local_root, pending)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        os.replace(partial, path)
        fsync_dir(loc.local_root)
        return
    if durable:
        _sync_paths(loc.local_root, pending)
    publish_json(loc.local_root / ROOT_META, document, durable=durable)


# A unit of this few files (a packed fragment: 2) is flushed file by file, all fsyncs at once,
# rather than with syncfs, which also waits for every other dirty file on the file system
# (a segment being sealed in the background, other processes' writes).
_TARGETED_FILES = 4
_fsync_pool_of: tuple[int, Any] | None = None


def _fsync_pool():
    global _fsync_pool_of
    if _fsync_pool_of is None or _fsync_pool_of[0] != os.getpid():  # threads do not survive a fork
        from concurrent.futures import ThreadPoolExecutor

        _fsync_pool_of = (os.getpid(), ThreadPoolExecutor(max_workers=8, thread_name_prefix="zarr-fsync"))
    return _fsync_pool_of[1]


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish_targeted(root: Path, document: dict[str, Any], pending: list[Pending]) -> None:
    """Durable publish of a few new files: their fsyncs (files, new directories and their parents,
    ``zarr.json.partial``) issued together, then the rename and an fsync of the root directory."""

    path = root / ROOT_META
    partial = path.with_name(path.name + PARTIAL_SUFFIX)
    os.close(_write_partial_record(partial, document))
    targets = {partial}
    for item in pending:
        targets.update(item.files)
        for directory in item.directories:
            targets.update((directory, directory.parent))
    try:
        list(_fsync_pool().map(_fsync_path, sorted(targets)))
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, path)
    _fsync_path(root)


def _write_partial_record(partial: Path, document: dict[str, Any]) -> int:
    """Writes the whole commit record to ``partial`` and returns the open descriptor; on a short
    write (a nearly full disk) removes it and raises, so that no torn record is ever renamed over
    the good one and the append that published it fails."""
    payload = json.dumps(document, separators=(",", ":"), sort_keys=True).encode()
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, payload, partial)
    except BaseException:
        os.close(fd)
        partial.unlink(missing_ok=True)
        raise
    return fd


def lock_for(loc: Location, location: str, *, lease_s: float | None = None, wait_s: float = 0.0) -> WriterLock | None:
    """The writer lock: an ``flock`` locally, a leased lock object on S3 and Azure (``lease_s``; a lock
    another writer holds is waited for up to ``wait_s``), none elsewhere."""
    if loc.local_root is None:
        if hasattr(loc.kv, "writer_lock"):
            from rlhf_pipeline.storage.zarr.object_store import DEFAULT_LEASE_S

            return loc.kv.writer_lock(lease_s or DEFAULT_LEASE_S).acquire(wait_s)
        return None  # other fsspec URLs: no cross-host lock (documented limitation)
    loc.local_root.mkdir(parents=True, exist_ok=True)
    return WriterLock(loc.local_root / LOCK_FILE_NAME, store=location).acquire()


def check_writable_dir(root: Path, location: str) -> None:
    if root.exists() and not root.is_dir():
        raise FileExistsError(f"{location} is a file, not a directory: a Zarr store is a directory; choose "
                              f"another path (or a path ending in .zip to read a zipped store)")
    probe = root if root.exists() else root.parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise FileExistsError(f"{location} cannot be created: {probe} is a file, not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ReadOnlyStoreError(
            f"{location} is not writable by this process (no write permission on {probe}); "
            f"open it with mode='r', or copy it somewhere writable"
        )
    if root.exists() and root.is_dir() and (root / ROOT_META).exists() and not os.access(root / ROOT_META, os.W_OK):
        raise ReadOnlyStoreError(f"{location}/zarr.json is not writable; open the store with mode='r'")
