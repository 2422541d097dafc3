"""A new buffer that appears at its path whole or not at all: what ``convert`` and ``filter`` write.

In a directory it is built under ``DST.partial``, held with an ``flock`` on that directory (the
kernel drops it when the writer dies, so what a killed one left is cleared by the next, and a live
one is never disturbed), and renamed to ``DST`` once complete. At a URL it is built at ``DST``
itself: an object store has no rename. Design: docs/curation.md#filter.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rlhf_pipeline.files.atomic import PARTIAL_SUFFIX, fsync_dir


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
                raise FileExistsError(f"{dst} exists (made meanwhile by another process); choose a new path") from None
            fsync_dir(Path(dst).resolve().parent)
        except BaseException:
            shutil.rmtree(build_at, ignore_errors=True)
            raise


def create_new(store_class, at: str, dst: str, schema, **options):
    """``store_class.create(at, schema, **options)`` for the new buffer ``dst`` built at ``at``; a store
    made there meanwhile (at a URL, where ``at`` is ``dst``) is a ``FileExistsError`` naming ``dst``."""
    try:
        return store_class.create(at, schema, **options)
    except FileExistsError:
        raise FileExistsError(f"{dst} exists (made meanwhile by another process); choose a new path") from None


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
