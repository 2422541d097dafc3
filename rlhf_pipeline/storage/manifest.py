"""Atomic publish and checked reads of a store's small JSON metadata files.

A local store becomes visible through one small JSON file (the *manifest*). Writers
never edit it in place: :func:`publish_json` writes ``<name>.partial``, fsyncs it,
``os.replace``-s it over the old file and fsyncs the directory, so a reader (or a
writer reopening after ``kill -9``) sees either the old or the new manifest, whole.

Readers use :class:`ManifestWatcher` to notice a new publish with one ``fstat``:
it keeps the file it last read open, and ``os.replace`` leaves that inode with no
links (``st_nlink == 0``). Holding the old inode open also means its number cannot
be reused, so the check has no false negatives, unlike comparing mtimes.

Used by the memmap backend and by any backend with a local directory (Zarr on
local disk). API: :func:`publish_json`, :func:`read_json`, :func:`check_header`,
:func:`fsync_dir`, :func:`save_torch_atomic` (the same publish for small ``torch.save``
state files: pending groups, collector positions), :class:`ManifestWatcher`, :class:`StateSlots` (frequent publishes without
a rename), :class:`IncompatibleStoreError`.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path
from typing import Any

from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage.base import NotAStoreError, StoreCorruptedError, StoreError

PARTIAL_SUFFIX = ".partial"


class IncompatibleStoreError(StoreError):
    """The store was written by a different backend or an incompatible format version."""


def fsync_dir(directory: str | os.PathLike) -> None:
    """Makes renames and file creations inside ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_json(path: str | os.PathLike, data: dict[str, Any], *, durable: bool = True) -> None:
    """Atomically replaces ``path`` with ``data`` as JSON.

    ``durable=True`` fsyncs the file before the rename and the directory after it,
    so the new content survives a power loss once this returns. ``durable=False``
    still never exposes a partial file to readers or to a crash of this process
    (the rename is atomic); only a machine crash may roll back to the old content.
    """
    path = Path(path)
    partial = path.with_name(path.name + PARTIAL_SUFFIX)
    payload = json.dumps(data, separators=(",", ":"), sort_keys=True).encode()
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, payload)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(partial, path)
    if durable:
        fsync_dir(path.parent)


def save_torch_atomic(obj: Any, path: str | os.PathLike, *, durable: bool = True) -> None:
    """Atomically replaces ``path`` with ``torch.save(obj)``, with :func:`publish_json`'s
    steps and its meaning of ``durable``."""
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + PARTIAL_SUFFIX)
    with open(partial, "wb") as f:
        torch.save(obj, f)
        f.flush()
        if durable:
            os.fsync(f.fileno())
    os.replace(partial, path)
    if durable:
        fsync_dir(path.parent)


def _parse(raw: bytes, path: Path) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StoreCorruptedError(
            f"{path} is not valid JSON ({exc}); the file was damaged outside this library. "
            f"Restore it from a snapshot, or delete the store."
        ) from None
    if not isinstance(data, dict):
        raise StoreCorruptedError(f"{path} holds a JSON {type(data).__name__}, expected an object")
    return data


def read_json(path: str | os.PathLike, *, what: str = "store") -> dict[str, Any]:
    """Reads a metadata file; ``NotAStoreError`` when it is missing, ``StoreCorruptedError`` when damaged."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise NotAStoreError(
            f"{path.parent} is not a {what}: {path.name} is missing. Create one first, or check the path."
        ) from None
    return _parse(raw, path)


def check_header(data: dict[str, Any], path: str | os.PathLike, *, backend: str, format_version: int) -> None:
    """Checks the ``backend`` and ``format_version`` keys every manifest carries."""
    found_backend = data.get("backend")
    if found_backend != backend:
        raise IncompatibleStoreError(
            f"{path} belongs to a {found_backend!r} store, not {backend!r}; open it with "
            f"rlhf_pipeline.storage.open_store(), which picks the backend itself"
        )
    found_version = data.get("format_version")
    if found_version != format_version:
        raise IncompatibleStoreError(
            f"{path} has {backend} format version {found_version}; this rlhf_pipeline reads version "
            f"{format_version}. Use a matching release, or convert the store with `rlhf-pipeline convert`."
        )


def schema_from_manifest(data: dict[str, Any], path: str | os.PathLike) -> StoreSchema:
    """The ``StoreSchema`` recorded under ``data["schema"]``, with errors naming ``path``."""
    try:
        return StoreSchema.from_json(data["schema"])
    except KeyError:
        raise StoreCorruptedError(f"{path} has no 'schema' entry") from None
    except ValueError as exc:
        raise IncompatibleStoreError(f"{path}: {exc}") from None


class ManifestWatcher:
    """Reads a manifest and tells, with one ``fstat``, whether a newer one was published."""

    def __init__(self, path: str | os.PathLike, *, what: str = "store"):
        self.path = Path(path)
        self._what = what
        self._fd: int | None = None

    def changed(self) -> bool:
        """True when nothing was read yet or the file read last was replaced since."""
        if self._fd is None:
            return True
        return os.fstat(self._fd).st_nlink == 0

    def read(self) -> dict[str, Any]:
        """Reads the current manifest and remembers it for :meth:`changed`."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise NotAStoreError(
                f"{self.path.parent} is not a {self._what}: {self.path.name} is missing. "
                f"Create one first, or check the path."
            ) from None
        try:
            size = os.fstat(fd).st_size
            chunks, got = [], 0
            while got < size:  # a published manifest never changes, so its size is final
                chunk = os.read(fd, size - got)
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
            data = _parse(b"".join(chunks), self.path)
        except BaseException:
            os.close(fd)
            raise
        self.close()
        self._fd = fd
        return data

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# ============================================================================ state slots
class StateSlots:
    """Publishes a JSON state many times a second without a rename: two slots, written in turn.

    Renaming a file over another costs 0.5-5 ms on ext4 here (the rename forces the new
    file's delayed blocks out), which is most of an append's cost. Instead, publish ``k``
    overwrites slot ``k % 2`` in place with ``[magic][crc32][seq][length][json]``; the
    other slot still holds publish ``k - 1``. A reader takes the valid slot with the
    highest sequence number, so a torn slot (a writer killed mid-write, or a read that
    raced the write) fails its CRC and the previous publish is used instead. Readers
    never go back: :meth:`latest` only returns sequence numbers above ``after``.

    Files: ``<stem>.0`` and ``<stem>.1`` next to the manifest.
    """

    _MAGIC = b"RLS1"
    _HEADER = struct.Struct("<4sIQQ")  # magic, crc32 of the payload, sequence number, payload length

    def __init__(self, directory: str | os.PathLike, stem: str = "state"):
        self.paths = tuple(Path(directory) / f"{stem}.{i}" for i in (0, 1))
        self._fds: list[int | None] = [None, None]
        self._writable = [False, False]

    def _fd(self, slot: int, *, create: bool) -> int | None:
        """The slot's open file; ``create=True`` (writers) opens it writable, creating it."""
        if create and not self._writable[slot] and self._fds[slot] is not None:
            os.close(self._fds[slot])  # opened read-only by latest(); reopen for writing
            self._fds[slot] = None
        if self._fds[slot] is None:
            try:
                flags = os.O_RDWR | os.O_CREAT if create else os.O_RDONLY
                self._fds[slot] = os.open(self.paths[slot], flags, 0o644)
            except FileNotFoundError:
                return None
            self._writable[slot] = create
        return self._fds[slot]

    def publish(self, seq: int, data: dict[str, Any], *, durable: bool = True) -> None:
        """Writes publish number ``seq`` (> every earlier one) into slot ``seq % 2``."""
        payload = json.dumps(data, separators=(",", ":"), sort_keys=True).encode()
        record = self._HEADER.pack(self._MAGIC, zlib.crc32(payload), seq, len(payload)) + payload
        slot = seq % 2
        new_file = self._fds[slot] is None and not self.paths[slot].exists()
        fd = self._fd(slot, create=True)
        view = memoryview(record)
        offset = 0
        while offset < len(record):
            offset += os.pwrite(fd, view[offset:], offset)
        if durable:
            os.fdatasync(fd)
            if new_file:
                fsync_dir(self.paths[slot].parent)

    def latest(self, after: int = 0) -> tuple[int, dict[str, Any]] | None:
        """``(seq, state)`` of the newest intact publish with ``seq > after``, or None."""
        candidates = []
        for slot in (0, 1):
            fd = self._fd(slot, create=False)
            if fd is None:
                continue
            header = os.pread(fd, self._HEADER.size, 0)
            if len(header) < self._HEADER.size:
                continue
            magic, crc, seq, length = self._HEADER.unpack(header)
            if magic == self._MAGIC and seq > after:
                candidates.append((seq, crc, length, fd))
        for seq, crc, length, fd in sorted(candidates, reverse=True):
            payload = os.pread(fd, length, self._HEADER.size)
            # re-read the header: a slot rewritten between the two reads must not pass
            if (len(payload) == length and zlib.crc32(payload) == crc
                    and self._HEADER.unpack(os.pread(fd, self._HEADER.size, 0))[2] == seq):
                try:
                    return seq, json.loads(payload)
                except ValueError:
                    continue
        return None

    def remove(self) -> None:
        self.close()
        for path in self.paths:
            path.unlink(missing_ok=True)

    def close(self) -> None:
        for slot, fd in enumerate(self._fds):
            if fd is not None:
                os.close(fd)
                self._fds[slot] = None
