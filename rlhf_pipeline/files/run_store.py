"""Where a run's small state objects are kept: a directory (:class:`LocalRunStore`) or a URL
(:class:`~rlhf_pipeline.files.object_run_store.ObjectRunStore`), behind one contract (:class:`RunStore`).

Every module that keeps run state (weights, checkpoints, collector positions, pending groups, pacing,
metrics, ``settings.json``, the pipeline copy, ``STOP``) names its objects by a key relative to the run
(``weights/policy_00000003.safetensors``) and reads and writes them through a store: atomic, fenced,
loaded without running code, copied as the store can, tagged with etags.
Design: docs/object-storage.md#a-whole-run-at-a-url.
"""

from __future__ import annotations

import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import IO

from rlhf_pipeline.files.atomic import PARTIAL_SUFFIX, write_atomic

Content = bytes | Callable[[IO[bytes]], None]
"""What a write takes: the bytes, or a callback that writes them into a file (a local store
streams a large checkpoint straight to disk; an object store collects it in memory first)."""


class StaleWriterError(RuntimeError):
    """A write refused because another writer replaced the object since this one last wrote it
    (this process lost its lease or was superseded by a restart elsewhere), or a version that
    exists already with other contents. The message names the object."""


class RunStoreError(OSError):
    """An object store request that failed for good (retries spent, access denied, no bucket);
    the message names the object, what was tried and why it gave up."""


class RunStore(ABC):
    """A run's state objects by relative key (``/``-separated, no leading ``/``).

    For every key: atomic (a reader sees the old or the new content, never a part); fenced
    (``write(..., fence=True)``, :meth:`create`: a writer whose key another writer replaced since it
    last wrote it gets :class:`StaleWriterError`; a version is created once, never overwritten; the
    local store keeps file semantics, its run directory's ``flock`` keeping a second writer out);
    read as bytes, decoded without running code (``files/state_files.py``, or JSON); copied as the
    store can (:meth:`copy`); tagged with an etag (:meth:`list_etags`, :meth:`read_with_etag`)."""

    location: str
    """The run's root as a user gives it: a directory path or a URL (for messages)."""

    @property
    @abstractmethod
    def is_local(self) -> bool:
        """True for a directory on a (possibly shared) file system."""

    @property
    @abstractmethod
    def supports_link(self) -> bool:
        """:meth:`copy` may share the bytes with the source (a hard link): free at any size, and
        safe because no object is changed in place (a write replaces it by a new one)."""

    @property
    @abstractmethod
    def supports_rename(self) -> bool:
        """A whole prefix can be moved in one atomic step (a directory rename), so a new run can be
        made aside and appear whole; without it a run is made in place and finished by a marker."""

    @property
    @abstractmethod
    def supports_server_copy(self) -> bool:
        """:meth:`copy` between objects of this cloud happens on the server: the bytes never travel
        through this machine (S3's CopyObject)."""

    def describe(self, key: str) -> str:
        """Where ``key`` lives, for messages: a path or a URL."""
        return f"{self.location.rstrip('/')}/{key}"

    @abstractmethod
    def read(self, key: str) -> bytes | None:
        """The content of ``key``, or None when it does not exist."""

    @abstractmethod
    def write(self, key: str, content: Content, *, fence: bool = True, durable: bool = True,
              partial_name: str | None = None) -> None:
        """Replaces ``key`` atomically. ``fence``: refuse (:class:`StaleWriterError`) when another
        writer replaced it since this store last wrote or read it. ``durable`` and
        ``partial_name`` are the local file's (:func:`~rlhf_pipeline.files.atomic.write_atomic`)."""

    @abstractmethod
    def create(self, key: str, content: Content, *, partial_name: str | None = None) -> None:
        """Writes a new version ``key``: an object store refuses to replace an existing one with
        other contents (:class:`StaleWriterError`); the same contents count as written (a retried
        request whose first answer was lost)."""

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Names of the objects and "directories" directly under ``prefix`` (a "directory" key), unsorted."""

    @abstractmethod
    def list_etags(self, prefix: str) -> dict[str, str]:
        """The objects directly under ``prefix`` (no "directories"), each with its etag: one
        listing, as :meth:`list`."""

    @abstractmethod
    def read_with_etag(self, key: str) -> tuple[bytes, str] | None:
        """``(content, etag)`` of ``key`` as read (the etag of these bytes, whatever a listing
        before said), or None when it does not exist."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Removes ``key``; a missing key is fine."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether ``key`` exists now."""

    def copy(self, src_key: str, dst_key: str, *, source: RunStore | None = None) -> None:
        """Puts ``source``'s ``src_key`` (``source``: another run's store; None: this one) at
        ``dst_key`` here, unfenced: linked, server-copied or read and written, as the two stores
        can. ``FileNotFoundError`` naming the source when it is gone (a running parent pruned it)."""
        source = self if source is None else source
        body = source.read(src_key)
        if body is None:
            raise FileNotFoundError(2, "no such object", source.describe(src_key))
        self.write(dst_key, body, fence=False)

    def delete_prefix(self, prefix: str = "") -> None:
        """Removes every object under ``prefix`` (``""``: the whole run); nothing there is fine."""
        for key in self.walk(prefix):
            self.delete(key)

    def walk(self, prefix: str = "") -> list[str]:
        """Every object key under ``prefix`` (``""``: the whole run) at any depth, unsorted."""
        found, pending = [], [prefix.strip("/")]
        while pending:
            here = pending.pop()
            objects = self.list_etags(here)
            for name in self.list(here):
                key = f"{here}/{name}" if here else name
                (found if name in objects else pending).append(key)
        return found


class LocalRunStore(RunStore):
    """A run directory on a file system: atomic file writes through
    :func:`~rlhf_pipeline.files.atomic.write_atomic` (``*.partial`` + rename, the same temporary names
    and fsyncs as every state file); an etag is a file's inode, size and modification time."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.location = str(self.root)

    @property
    def is_local(self) -> bool:
        return True

    @property
    def supports_link(self) -> bool:
        return True

    @property
    def supports_rename(self) -> bool:
        return True

    @property
    def supports_server_copy(self) -> bool:
        return False

    def path(self, key: str) -> Path:
        return self.root / key if key else self.root

    def describe(self, key: str) -> str:
        return str(self.path(key))

    def read(self, key: str) -> bytes | None:
        try:
            return self.path(key).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def write(self, key: str, content: Content, *, fence: bool = True, durable: bool = True,
              partial_name: str | None = None) -> None:
        write_atomic(self.path(key), _writer(content), durable=durable, partial_name=partial_name)

    def create(self, key: str, content: Content, *, partial_name: str | None = None) -> None:
        # writers that may race for one name give each process its own temporary file
        name = partial_name or f"{Path(key).name}.{os.getpid()}{PARTIAL_SUFFIX}"
        write_atomic(self.path(key), _writer(content), partial_name=name)

    def list(self, prefix: str) -> list[str]:
        directory = self.path(prefix)
        if not directory.is_dir():
            return []
        return [p.name for p in directory.iterdir()]

    def list_etags(self, prefix: str) -> dict[str, str]:
        directory = self.path(prefix)
        if not directory.is_dir():
            return {}
        found = {}
        for entry in os.scandir(directory):
            try:
                if entry.is_file():
                    found[entry.name] = _file_etag(entry.stat())
            except FileNotFoundError:  # removed since the listing
                pass
        return found

    def read_with_etag(self, key: str) -> tuple[bytes, str] | None:
        try:
            with open(self.path(key), "rb") as f:
                # the open file's own: a rename over the key after this open changes the name's
                return f.read(), _file_etag(os.fstat(f.fileno()))
        except (FileNotFoundError, NotADirectoryError):
            return None

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def exists(self, key: str) -> bool:
        return self.path(key).exists()

    def delete_prefix(self, prefix: str = "") -> None:
        path = self.path(prefix)
        if path.is_dir():
            shutil.rmtree(path)  # its directories too
        else:
            path.unlink(missing_ok=True)

    def copy(self, src_key: str, dst_key: str, *, source: RunStore | None = None) -> None:
        source = self if source is None else source
        if not isinstance(source, LocalRunStore):
            return super().copy(src_key, dst_key, source=source)
        origin, target = source.path(src_key), self.path(dst_key)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.unlink(missing_ok=True)
        try:
            os.link(origin, target)
        except FileNotFoundError:
            raise
        except OSError:  # another file system, or one without hard links: copied whole, then renamed in,
            partial = target.with_name(target.name + ".partial")  # so a kill mid-copy leaves no torn object
            shutil.copyfile(origin, partial)
            os.replace(partial, target)


def _file_etag(stat: os.stat_result) -> str:
    # every write here is a new file renamed over the key: a new inode while the old file exists. A
    # deleted file's inode may be reused within one tick of a coarse mtime clock, with the same size:
    # good enough for a directory, whose files are read in place and never copied by etag
    return f"{stat.st_ino:x}-{stat.st_size:x}-{stat.st_mtime_ns:x}"


def _writer(content: Content) -> Callable[[IO[bytes]], None]:
    if isinstance(content, (bytes, bytearray, memoryview)):
        data = bytes(content)
        return lambda f: f.write(data)
    return content


def content_bytes(content: Content) -> bytes:
    """``content`` as bytes (a callback writes into memory)."""
    if isinstance(content, (bytes, bytearray, memoryview)):
        return bytes(content)
    import io

    buffer = io.BytesIO()
    content(buffer)
    return buffer.getvalue()


def as_run_store(run: str | os.PathLike | RunStore) -> RunStore:
    """``run`` as a store: a store as it is; a directory path as a :class:`LocalRunStore`."""
    if isinstance(run, RunStore):
        return run
    return LocalRunStore(run)


def state_store_and_key(where: str | os.PathLike, store: RunStore | None) -> tuple[RunStore, str]:
    """``(store, key)`` of one state object as ``RunPaths.state_object`` gives it: a file ``where`` in
    its directory (``store`` None), or the key ``where`` in ``store`` (a run at a URL)."""
    if store is None:
        return LocalRunStore(Path(where).parent), Path(where).name
    return store, str(where)
