"""Objects of a run at a URL fetched once per machine (:class:`MachineCache`): the first process of this
machine that needs an object downloads it into a directory they all share; the others read that file.
Every collector loads each new weights version, so without it N collectors of a machine downloaded each
version N times.

Copies are named by etag (:meth:`MachineCache.path_for`), written to ``<copy>.<pid>.partial`` and renamed,
downloaded under one ``flock`` whose dead holder (``kill -9``, a fork that inherited it) blocks no one,
and pruned to the newest ``keep`` (2). Copies are only a cache: deleting the directory loses nothing.
Design: docs/object-storage.md#a-whole-run-at-a-url.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import socket
import time
from pathlib import Path

from rlhf_pipeline.files.atomic import PARTIAL_SUFFIX, write_atomic
from rlhf_pipeline.files.processes import pid_running
from rlhf_pipeline.files.run_store import RunStore

LOCK_NAME = "fetch.lock"
KEEP = 2  # the newest and the one before it: each copy is the model's size on local disk
_FIRST_WAIT_S = 0.001
_MAX_WAIT_S = 0.05  # a waiter notices the copy within this of its rename


class MachineCache:
    """The shared copies in ``directory`` (this machine's cache of a run at a URL, ``RunPaths.fetched_weights``)."""

    def __init__(self, directory: str | os.PathLike, *, keep: int = KEEP) -> None:
        if keep < 1:
            raise ValueError(f"a machine cache keeps at least 1 copy, got keep={keep}")
        self.directory = Path(directory)
        self.keep = keep
        self.downloads = 0  # GETs this process made (a cache hit is a file read)

    def path_for(self, key: str, etag: str) -> Path:
        """Where the copy of version ``etag`` of ``key`` is kept: ``<stem>.<digest of the etag><suffix>``
        (``policy_00000003.1f0c...e2.safetensors``), never named by the key alone, since a run started
        again at the same URL publishes the same keys anew, under new etags."""
        name = Path(key).name
        # one etag, however a server quotes it in a listing and in a response header
        digest = hashlib.sha256(etag.removeprefix("W/").strip('"').encode()).hexdigest()[:20]
        stem, dot, suffix = name.partition(".")
        return self.directory / f"{stem}.{digest}{dot}{suffix}"

    def fetch(self, store: RunStore, key: str, etag: str) -> Path:
        """A finished local copy of ``key`` at ``etag`` (as listed), downloaded by this call only
        when no process of this machine has it; FileNotFoundError when ``key`` is gone.

        The downloader holds an exclusive ``flock`` on ``fetch.lock``, its pid and host written in it;
        a process that finds it held waits for the copy to appear, or for the lock to come free (the
        holder failed: it downloads itself), or downloads at once when the recorded holder no longer
        runs (a forked child kept the lock alive: at worst one version is fetched twice). Copies of
        different objects queue behind the one lock: a machine's collectors all want the newest
        version anyway. The copy is named by the etag of the bytes the GET returned, so an object
        replaced since the listing is kept under its new etag. A caller that loses the race between
        this call and opening the file (the copy pruned by another download) gets
        ``FileNotFoundError``, as for a version pruned at the URL, and polls again; one that opened
        a copy keeps reading it after it is unlinked."""
        wanted = self.path_for(key, etag)
        if wanted.exists():
            return wanted
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            wait = _FIRST_WAIT_S
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    if _held_by_a_dead_process(fd):  # a forked child keeps the dead holder's lock
                        return self._download(store, key)
                    time.sleep(wait)
                    wait = min(wait * 2, _MAX_WAIT_S)
                    if wanted.exists():
                        return wanted
                    continue
                try:
                    if wanted.exists():  # downloaded by the holder this one waited for
                        return wanted
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
                    path = self._download(store, key)
                    self.prune()
                    return path
                finally:
                    os.ftruncate(fd, 0)  # a pid left behind would only mislead the next waiter
                    fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _download(self, store: RunStore, key: str) -> Path:
        found = store.read_with_etag(key)
        if found is None:
            raise FileNotFoundError(store.describe(key))
        body, etag = found
        # named by the etag this GET returned, not the listing's: an object replaced between the two is
        # kept under its own etag
        path = self.path_for(key, etag)
        write_atomic(path, lambda f: f.write(body), partial_name=f"{path.name}.{os.getpid()}{PARTIAL_SUFFIX}")
        self.downloads += 1
        return path

    def prune(self) -> None:
        """Keeps the newest ``keep`` copies and removes the partial copies of processes that no
        longer run; called by the lock's holder."""
        copies = []
        for entry in os.scandir(self.directory):
            if entry.name == LOCK_NAME:
                continue
            if entry.name.endswith(PARTIAL_SUFFIX):
                pid = entry.name.removesuffix(PARTIAL_SUFFIX).rpartition(".")[2]
                if pid.isdigit() and not pid_running(int(pid)):
                    _unlink(entry.path)
                continue
            try:
                copies.append((entry.stat().st_mtime_ns, entry.name))
            except FileNotFoundError:
                pass
        for _, name in sorted(copies)[:-self.keep]:
            _unlink(self.directory / name)


def _held_by_a_dead_process(fd: int) -> bool:
    """True when the lock file names a holder on this host that no longer runs. Nothing recorded
    (a new holder between its ``flock`` and its write) counts as alive."""
    try:
        words = os.pread(fd, 256, 0).decode(errors="replace").split()
        pid, host = int(words[0]), words[1]
    except (OSError, ValueError, IndexError):
        return False
    return host == socket.gethostname() and not pid_running(pid)


def _unlink(path: str | os.PathLike) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
