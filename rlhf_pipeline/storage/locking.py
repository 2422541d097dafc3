"""One writer per store: an exclusive ``fcntl.flock`` on a lock file inside the store.

The lock belongs to the open file, so the kernel drops it when the holder exits,
even on ``kill -9``: a crashed writer never leaves a stale lock behind. The file
records the holder's pid and host so the second writer's error can name them.
Readers take no lock. ``flock`` is local to one machine (and unreliable on some
network filesystems); a store shared between hosts needs one writer by design.

API: ``lock = WriterLock(path); lock.acquire(); ...; lock.release()`` or
``with WriterLock(path): ...``; a held lock raises :class:`StoreLockedError`.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from rlhf_pipeline.storage.base import StoreLockedError

LOCK_FILE_NAME = "writer.lock"


class WriterLock:
    """Exclusive, non-blocking writer lock on ``path`` (created if missing)."""

    def __init__(self, path: str | os.PathLike, *, store: str | None = None):
        self.path = Path(path)
        self._store = store or str(self.path.parent)
        self._fd: int | None = None
        self._owner_pid = os.getpid()

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> WriterLock:
        if self._fd is not None:
            return self
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise StoreLockedError(
                f"{self._store} is already open for writing by {holder}; a store takes one writer "
                f"at a time. Close that writer, open this one with mode='r', or write to another "
                f"shard."
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        self._owner_pid = os.getpid()
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        if os.getpid() != self._owner_pid:
            # a forked child shares the parent's open file, and with it the lock: unlocking
            # here would unlock the parent, so the child only drops its descriptor
            os.close(fd)
            return
        try:
            os.ftruncate(fd, 0)  # a leftover pid would only mislead a later error message
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __enter__(self) -> WriterLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 256, 0).decode(errors="replace").split()
    except OSError:
        text = []
    if not text:
        return "another process (pid not recorded yet)"
    pid = text[0]
    host = f" on {text[1]}" if len(text) > 1 else ""
    return f"process {pid}{host}"
