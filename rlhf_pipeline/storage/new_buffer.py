"""A new buffer that appears at its path whole or not at all: what ``convert`` and ``filter`` write.

In a directory it is built under ``DST.partial``, held with an ``flock`` on that directory (the
kernel drops it when the writer dies, so what a killed one left is cleared by the next, and a live
one is never disturbed), and renamed to ``DST`` once complete. A ``DST`` ending in ``.zip`` is a
Zarr store in one zip file, which stores read (read-only): built as a directory under the same
``DST.partial``, then zipped there and linked to ``DST``. At a URL it is built at ``DST`` itself: an
object store has no rename. Design: docs/curation.md#filter.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rlhf_pipeline.files.atomic import PARTIAL_SUFFIX, fsync_dir
from rlhf_pipeline.storage.locking import LOCK_FILE_NAME

ZIP_SUFFIX = ".zip"


@contextmanager
def new_buffer_at(dst: str, command: str) -> Iterator[str]:
    """Where to build the new buffer ``dst`` (``command``, ``"convert"`` or ``"filter"``, names the writer
    in refusals): locally ``DST.partial``, renamed to ``DST`` when the block ends and removed when it
    raises; at a URL, ``dst``. A ``dst`` that exists, or appears meanwhile, is a ``FileExistsError``."""
    if "://" in dst:
        yield dst
        return
    dst = os.path.normpath(dst)  # "DST/" is DST: its partial is "DST.partial", not "DST/.partial"
    with _held_partial(dst, command) as build_at:
        try:
            yield str(build_at)
            try:
                os.replace(build_at, dst)
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                    raise
                raise _made_meanwhile(dst) from None
            fsync_dir(Path(dst).resolve().parent)
        except BaseException:
            shutil.rmtree(build_at, ignore_errors=True)
            raise


@contextmanager
def new_store(store_class, dst: str, command: str, schema, **options) -> Iterator:
    """A new ``store_class`` store for ``dst`` (``new_buffer_at``), open for appends until the block ends;
    a ``dst`` ending in ``.zip`` is written as one zip file once the store is closed."""
    check_zip_destination(dst, store_class.backend_name)
    if not dst.rstrip("/").endswith(ZIP_SUFFIX):
        with new_buffer_at(dst, command) as build_at, _create_new(store_class, build_at, dst, schema,
                                                                  **options) as store:
            yield store
        return
    dst = os.path.normpath(dst)
    with _held_partial(dst, command) as build_at:
        try:
            with _create_new(store_class, str(build_at / "store"), dst, schema, **options) as store:
                yield store
            archive = build_at / f"store{ZIP_SUFFIX}"
            _zip_directory(build_at / "store", archive)
            try:  # a link, unlike a rename, never replaces a dst made meanwhile
                os.link(archive, dst)
            except FileExistsError:
                raise _made_meanwhile(dst) from None
            except OSError:  # a file system without hard links: renamed in, after one more look
                if os.path.lexists(dst):
                    raise _made_meanwhile(dst) from None
                os.replace(archive, dst)
            fsync_dir(Path(dst).resolve().parent)
        finally:
            shutil.rmtree(build_at, ignore_errors=True)


def check_zip_destination(dst: str, backend: str) -> None:
    """Refuses (``ValueError``) a ``dst`` ending in ``.zip`` that cannot be a zipped store of ``backend``;
    ``backend`` "sharded" is a buffer of several stores, a directory of them."""
    if not dst.rstrip("/").endswith(ZIP_SUFFIX):
        return
    if "://" in dst:
        raise ValueError(f"{dst}: a zipped store is written on local disk only; give a local path ending in "
                         f"{ZIP_SUFFIX}, or a URL without it (a store of objects)")
    if backend == "sharded":
        raise ValueError(f"{dst}: a {ZIP_SUFFIX} holds one store, and this buffer is several (a run's shards), "
                         f"written as a directory of them; give a path without {ZIP_SUFFIX}, or convert one shard "
                         f"(SRC/shard-NNNN) to a {ZIP_SUFFIX}")
    if backend != "zarr":
        raise ValueError(f"{dst}: a {ZIP_SUFFIX} holds a Zarr store, and this buffer would be {backend}; give "
                         f"--to zarr, or a path without {ZIP_SUFFIX} (a directory)")


def _zip_directory(directory: Path, archive: Path) -> None:
    """Every file of the store under ``directory`` into ``archive``, stored as is (its chunks are compressed
    already), but its writer's lock: a zip is never written again."""
    with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_STORED) as zipped:
        for path in sorted(directory.rglob("*")):
            if path.is_file() and path.name != LOCK_FILE_NAME:
                zipped.write(path, path.relative_to(directory).as_posix())
    with open(archive, "rb") as written:
        os.fsync(written.fileno())


def _made_meanwhile(dst: str) -> FileExistsError:
    return FileExistsError(f"{dst} exists (made meanwhile by another process); choose a new path")


def _create_new(store_class, at: str, dst: str, schema, **options):
    """``store_class.create(at, schema, **options)`` for the new buffer ``dst`` built at ``at``; a store
    made there meanwhile (at a URL, where ``at`` is ``dst``) is a ``FileExistsError`` naming ``dst``."""
    try:
        return store_class.create(at, schema, **options)
    except FileExistsError:
        raise _made_meanwhile(dst) from None


@contextmanager
def _held_partial(dst: str, command: str) -> Iterator[Path]:
    """``DST.partial``, empty and locked by this process until the block ends."""
    build_at = Path(dst + PARTIAL_SUFFIX)
    build_at.parent.mkdir(parents=True, exist_ok=True)
    while True:
        try:
            build_at.mkdir()
        except FileExistsError:
            pass
        fd = os.open(build_at, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            from rlhf_pipeline.storage.errors import StoreLockedError

            raise StoreLockedError(f"another {command} is writing {dst} right now (it holds {build_at}); wait for "
                                   f"it to finish, or choose another destination") from None
        if _same_directory(fd, build_at):
            break
        os.close(fd)  # renamed to DST (that writer finished) or cleared since it was opened: look again
    try:
        if Path(dst).exists():  # another writer finished it meanwhile
            shutil.rmtree(build_at, ignore_errors=True)
            raise FileExistsError(f"{dst} exists (written meanwhile by another {command}); choose a new path")
        for child in build_at.iterdir():  # left by a writer killed while building here
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
        yield build_at
    finally:
        os.close(fd)


def _same_directory(fd: int, path: Path) -> bool:
    try:
        here, held = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)
