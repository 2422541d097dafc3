"""Atomic file writes: a file is replaced whole or not at all, whatever the layer writing it.

Every small state file of a run (a store's manifest, pending groups, a collector's position, learner
checkpoints, published weights, ``settings.json``) goes through :func:`write_atomic` (``<name>.partial``,
then ``os.replace``; ``durable`` adds the fsyncs); :func:`publish_json` and :func:`save_torch_atomic` wrap
it, and :func:`write_all` is for code that writes with ``os.write`` and renames into place.
:func:`why_unwritable` tells, before any work, whether a path could be written at all; :func:`named`
(and :func:`naming`) make a failed write to an open file name its path, for a one-line error.

Design: docs/pipelines.md#the-run-directory.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

PARTIAL_SUFFIX = ".partial"


def why_unwritable(path: str | os.PathLike) -> str | None:
    """Why ``path`` (a file or a directory, with its missing parents) cannot be made or written in, in
    a phrase, or None: a part of it that is a file, a read-only file system, no permission, a place
    nothing can be made in. Where ``path`` does not exist, asked of the file system itself by making
    and removing an empty directory in its nearest part that exists (a root user passes every
    permission bit, and some file systems, ``/proc``, refuse what their modes allow); a directory
    that exists, which may be a store others read, gets nothing made in it and is judged by its
    modes. Whether a ``path`` that exists may be replaced is the caller's to say."""
    path = Path(path).absolute()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing != path and not existing.is_dir():
        return f"{existing} is a file, not a directory"
    if existing == path and path.is_dir():
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return f"{path} is on a read-only file system"
        return None if os.access(path, os.W_OK | os.X_OK) else f"no permission to write in {path}"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=existing if existing != path else path.parent))
    except OSError as exc:
        return f"nothing can be made in {existing} ({exc.strerror})"
    return None


def fsync_dir(directory: str | os.PathLike) -> None:
    """Makes renames and file creations inside ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data, path: str | os.PathLike) -> None:
    """Writes every byte of ``data`` to ``fd`` at its current position, or raises ``OSError``.

    Writes through a Python file object (``open(..., "wb")``, ``Path.write_bytes``, ``torch.save``)
    raise when the disk fills; a raw ``os.write`` does not: on a nearly full disk (or past a file size
    limit) it writes what fits and returns that count, and only the next call fails. Code that writes a
    file with ``os.write``/``os.writev`` and renames it into place uses this, so a torn file is never
    renamed over a good one.

    ``data`` is a bytes-like object, or a list of them written back to back (first with one
    ``writev``). A short write is continued where it stopped; the call that fails then (a full
    disk: ``ENOSPC``; a file size limit: ``EFBIG``) raises with ``path`` as the error's
    ``filename``, so a command can name the file in its one-line error.
    """
    try:
        if isinstance(data, Sequence) and not isinstance(data, (bytes, bytearray, memoryview)):
            done = os.writev(fd, data) if data else 0
            if done == sum(memoryview(b).nbytes for b in data):
                return
            view = memoryview(b"".join(data))[done:]  # a short writev: the rest as one buffer (rare)
        else:
            view = memoryview(data).cast("B")
        while view:
            written = os.write(fd, view)
            if written <= 0:  # no error and no progress: the file system gave up; never loop on it
                raise OSError(errno.EIO, f"the system wrote 0 of {len(view)} bytes")
            view = view[written:]
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror or str(exc), os.fspath(path)) from None


def named(exc: OSError, path: str | os.PathLike) -> OSError:
    """``exc`` naming ``path`` when it names no file: a write to an open file that fails (a full disk) names
    none, and a command's one-line error (cli/run_cmd.py) needs the path to say which disk to free."""
    if exc.filename is not None:
        return exc
    error = OSError(exc.errno, exc.strerror or str(exc), os.fspath(path))
    error.__cause__ = exc
    return error


@contextlib.contextmanager
def naming(path: str | os.PathLike) -> Iterator[None]:
    """Re-raises an ``OSError`` that names no file as one naming ``path`` (:func:`named`)."""
    try:
        yield
    except OSError as exc:
        raise named(exc, path)  # noqa: B904 - chained in named(), or exc itself


def write_atomic(path: str | os.PathLike, write: Callable[[IO[bytes]], None], *, durable: bool = True,
                 partial_name: str | None = None) -> Path:
    """Replaces ``path`` with what ``write(file)`` writes, atomically: the content goes to
    ``<name>.partial``, is flushed and ``os.replace``-d over the old file, so a reader, or a process
    restarting after ``kill -9``, sees the old or the new file, never a torn one.

    ``durable=True`` also fsyncs the file before the rename and its directory after it, so the new
    content survives a power loss once the call returns; ``durable=False`` keeps the atomicity (a
    process crash never exposes a partial file), but a machine crash may roll back to the old content.

    ``partial_name`` names the temporary file (default ``<name>.partial``); writers that may
    race each other for the same final name give each process its own. The parent directory
    is created when missing.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(partial_name or path.name + PARTIAL_SUFFIX)
    try:
        with open(partial, "wb") as f:
            write(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(partial, path)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise named(exc, partial)  # noqa: B904 - a failed write or flush says which file (chained in named())
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)
    return path


def publish_json(path: str | os.PathLike, data: dict[str, Any], *, durable: bool = True) -> None:
    """Atomically replaces ``path`` with ``data`` as compact, key-sorted JSON."""
    payload = json.dumps(data, separators=(",", ":"), sort_keys=True).encode()
    write_atomic(path, lambda f: f.write(payload), durable=durable)


def json_object(raw: bytes | None) -> dict[str, Any] | None:
    """What :func:`publish_json` wrote, read back: the JSON object in ``raw``; None for no file
    (``raw`` None), bytes that are not JSON, or JSON that is not an object. A record a caller needs
    is refused by the caller, naming the file (each says what wrote it and how to restore it)."""
    if raw is None:
        return None
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def save_torch_atomic(obj: Any, path: str | os.PathLike, *, durable: bool = True,
                      partial_name: str | None = None) -> Path:
    """Atomically replaces ``path`` with ``torch.save(obj)``."""
    import torch

    return write_atomic(path, lambda f: torch.save(obj, f), durable=durable, partial_name=partial_name)
