"""One writer per store: an exclusive ``fcntl.flock`` on a lock file inside the store.

The kernel drops the lock when the last descriptor of it closes, even on ``kill -9``, so a crashed writer
leaves no stale lock; the file records the holder's pid and host for the refused writer's error, and a
writer refused by a holder that no longer runs (a child it forked still holds the file) waits up to
:data:`HANDOVER_WAIT_S` for the handover. Readers take no lock. API: :class:`WriterLock`.

Design: docs/storage.md#the-writer-lock.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

from rlhf_pipeline.files.processes import pid_running, processes_with_open
from rlhf_pipeline.storage.errors import StoreLockedError

LOCK_FILE_NAME = "writer.lock"
HANDOVER_WAIT_S = 2.0  # how long a lock whose recorded holder is gone may take to be released
_POLL_S = 0.005


class WriterLock:
    """Exclusive, non-blocking writer lock on ``path`` (created if missing).

    ``lock = WriterLock(path); lock.acquire(); ...; lock.release()`` or ``with WriterLock(path): ...``;
    a lock held by another process raises :class:`StoreLockedError` naming it.
    """

    def __init__(self, path: str | os.PathLike, *, store: str | None = None):
        self.path = Path(path)
        self._store = store or str(self.path.parent)
        self._fd: int | None = None
        self._owner_pid = os.getpid()
        self._created = False

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> WriterLock:
        if self._fd is not None:
            return self
        deadline = None
        while True:
            fd, created = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                if _being_handed_over(holder):
                    deadline = deadline or time.monotonic() + HANDOVER_WAIT_S
                    if time.monotonic() < deadline:
                        time.sleep(_POLL_S)
                        continue
                named = None if holder is None else f"process {holder[0]} on {holder[1]}"
                raise StoreLockedError(self._locked_message(holder), holder=named) from None
            except BaseException:
                os.close(fd)
                raise
            if not _is_current(fd, self.path):
                # the file was unlinked (a failed open cleaning up) between our open and flock:
                # its lock guards nothing any more, lock the file now at the path instead
                os.close(fd)
                continue
            break
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        self._created = created
        self._owner_pid = os.getpid()
        return self

    def _open(self) -> tuple[int, bool]:
        """The lock file opened read-write, and whether this call created it."""
        while True:
            try:
                return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
            except FileExistsError:
                pass
            try:
                return os.open(self.path, os.O_RDWR), False
            except FileNotFoundError:
                continue  # deleted between the two opens: create it

    def _locked_message(self, holder: tuple[int, str] | None) -> str:
        advice = ("a store takes one writer at a time. Close that writer, open this one with mode='r', or "
                  "write to another shard.")
        if holder is None:
            return f"{self._store} is already open for writing by another process (pid not recorded yet); {advice}"
        pid, host = holder
        if _being_handed_over(holder):
            others = processes_with_open(self.path)
            held_by = (f"process(es) {', '.join(map(str, others))}, which inherited the open lock file"
                       if others else "a process that inherited the open lock file")
            return (f"{self._store} is locked by {held_by}: the lock file names process {pid}, which is no "
                    f"longer running, and the lock was not released within {HANDOVER_WAIT_S:.0f} s. A process "
                    f"forked from that writer still holds its lock; stop it, then open the store again.")
        return f"{self._store} is already open for writing by process {pid} on {host}; {advice}"

    def release(self, *, remove_if_created: bool = False) -> None:
        """Unlocks. ``remove_if_created`` also deletes the lock file when ``acquire`` created it
        (a failed open leaves the directory as it found it)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        if os.getpid() != self._owner_pid:
            # a forked child shares the parent's open file, and with it the lock: unlocking
            # here would unlock the parent, so the child only drops its descriptor
            os.close(fd)
            return
        try:
            if remove_if_created and self._created:
                _unlink_if_same(self.path, fd)  # while still locked: no one can have locked it since
            else:
                os.ftruncate(fd, 0)  # a leftover pid would only mislead a later error message
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __enter__(self) -> WriterLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def writer_holding(path: str | os.PathLike) -> str | None:
    """Who holds the writer lock at ``path`` (``"process 4242 on node-7"``), or None when no live
    process does (no lock file, or its last holder is gone): what a dry run beside a store asks
    without taking the lock. A shared ``flock`` held for a moment is refused while a writer holds
    the lock; a writer starting in that moment finds no holder recorded and retries (the handover
    wait above), so the look never refuses a writer."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            return "a process (pid not recorded yet)" if holder is None else f"process {holder[0]} on {holder[1]}"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _read_holder(fd: int) -> tuple[int, str] | None:
    """``(pid, host)`` recorded in the lock file, or None when nothing (valid) is recorded."""
    try:
        text = os.pread(fd, 256, 0).decode(errors="replace").split()
        return int(text[0]), (text[1] if len(text) > 1 else "")
    except (OSError, ValueError, IndexError):
        return None


def _being_handed_over(holder: tuple[int, str] | None) -> bool:
    """True when the lock is refused but its recorded holder is not running it: no pid recorded
    yet, or a pid on this host that no longer runs (dead, or a zombie awaiting its parent)."""
    if holder is None:
        return True
    pid, host = holder
    return host in ("", socket.gethostname()) and not pid_running(pid)


def _is_current(fd: int, path: Path) -> bool:
    """True when ``fd`` is the file at ``path`` (not one unlinked or replaced since it was opened)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _unlink_if_same(path: Path, fd: int) -> None:
    """Unlinks ``path`` if it is still the file ``fd``. The caller holds the lock on ``fd``, and a
    process that opened the file meanwhile sees after its ``flock`` that it was unlinked."""
    try:
        if _is_current(fd, path):
            os.unlink(path)
    except FileNotFoundError:
        pass
