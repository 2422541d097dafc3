"""A lease object at a URL (:class:`ObjectLease`): the one command that holds a run at a URL (``run.lock``),
as ``flock`` holds a run directory on disk. Object storage has no ``flock`` and nothing that notices a
dead holder, so the lock is an object with a lease, as the buffer's writer lock
(``storage/zarr/object_store.py``) but on the run's own store: conditional creates, renewals and
takeovers, measured on the server's clock.

Design: docs/object-storage.md#a-whole-run-at-a-url.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from rlhf_pipeline.files.object_run_store import ObjectRunStore
from rlhf_pipeline.files.processes import pid_running

log = logging.getLogger(__name__)

DEFAULT_LEASE_S = 30.0


class LeaseHeldError(RuntimeError):
    """Another live holder has the lease; the message names it."""


class ObjectLease:
    """``key`` in ``store`` held by this process while :meth:`acquire` ... :meth:`release`.

    Created with ``If-None-Match: *``, naming its holder (a random token, host and pid, and what
    ``record`` adds: the command, its start time); renewed with ``If-Match`` every ``lease_s / 3`` on a
    daemon thread; taken over with ``If-Match`` on the version seen (so one of several contenders wins)
    once not renewed for ``lease_s`` on the server's clock, or at once when its holder was a process on
    this host that no longer runs. A holder whose renewal is refused has been taken over: :attr:`lost`
    is set and its owner stops."""

    def __init__(self, store: ObjectRunStore, key: str, *, record: dict[str, Any] | None = None,
                 lease_s: float = DEFAULT_LEASE_S) -> None:
        if not lease_s > 0:
            raise ValueError(f"lease_s must be positive, got {lease_s!r}")
        self.store = store
        self.key = key
        self.lease_s = float(lease_s)
        self._record = {"token": uuid.uuid4().hex, "pid": os.getpid(), "host": socket.gethostname(),
                        "lease_s": self.lease_s, **(record or {})}
        self._renewals = 0
        self._etag: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = threading.Event()

    @property
    def held(self) -> bool:
        return self._etag is not None and not self.lost.is_set()

    def _body(self) -> bytes:
        return json.dumps({**self._record, "renewal": self._renewals}, sort_keys=True).encode()

    def acquire(self, wait_s: float = 0.0) -> ObjectLease:
        """Takes the lease, waiting up to ``wait_s`` for a live holder's to run out; else raises
        :class:`LeaseHeldError` describing the holder."""
        deadline = time.monotonic() + wait_s
        for _ in range(1000):
            etag = self.store.put_if(self.key, self._body(), etag=None)
            if etag is not None:
                self._etag = etag
                break
            seen = self.store.read_with_age(self.key)
            if seen is None:
                continue  # released in between
            body, seen_etag, age = seen
            holder = holder_record(body)
            why = abandoned(holder, age, default_lease_s=self.lease_s)
            if why is None:
                if time.monotonic() >= deadline:
                    raise LeaseHeldError(describe_holder(holder, age))
                time.sleep(min(1.0, max(0.05, deadline - time.monotonic())))
                continue
            etag = self.store.put_if(self.key, self._body(), etag=seen_etag)
            if etag is not None:
                log.warning("%s: took over from %s (%s)", self.store.describe(self.key), describe_holder(holder, age),
                            why)
                self._etag = etag
                break
        else:  # pragma: no cover - a thousand contenders in a row
            raise LeaseHeldError(f"{self.store.describe(self.key)} keeps changing hands; start one holder at a time")
        self._thread = threading.Thread(target=self._renew_until_released, name="run-lease", daemon=True)
        self._thread.start()
        return self

    def _renew_until_released(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            self._renewals += 1
            try:
                etag = self.store.put_if(self.key, self._body(), etag=self._etag)
            except Exception as exc:  # noqa: BLE001 - the store already retried; the next period tries again
                log.warning("%s: renewing the lease failed (%s); retrying in %.0f s", self.store.describe(self.key),
                            exc, self.lease_s / 3)
                continue
            if etag is None:
                self.lost.set()
                log.warning("%s: this lease was taken over by another holder", self.store.describe(self.key))
                return
            self._etag = etag

    def release(self) -> None:
        """Stops renewing and deletes the object if it is still this holder's."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None
        etag, self._etag = self._etag, None
        if etag is None or self.lost.is_set() or os.getpid() != self._record["pid"]:
            return
        try:
            self.store.delete_if(self.key, etag)
        except Exception as exc:  # noqa: BLE001 - the lease runs out instead
            log.warning("%s: could not delete the lease (%s); the next holder takes it over after %g s",
                        self.store.describe(self.key), exc, self.lease_s)

    def __enter__(self) -> ObjectLease:  # noqa: PYI034 - as ObjectStoreLock
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def holder_record(body: bytes) -> dict:
    """A lease object's holder record (empty when unreadable)."""
    try:
        holder = json.loads(body)
        return holder if isinstance(holder, dict) else {}
    except ValueError:
        return {}


def abandoned(holder: dict, age: float | None, *, default_lease_s: float = DEFAULT_LEASE_S) -> str | None:
    """Why a lease held by ``holder`` (its record), last written ``age`` seconds ago on the server's
    clock, is abandoned: its process ended on this host, or it was not renewed within its lease;
    None while it is live."""
    pid, host = holder.get("pid"), holder.get("host")
    if host == socket.gethostname() and isinstance(pid, int) and not pid_running(pid):
        return "that process is no longer running"
    try:
        lease = float(holder.get("lease_s", default_lease_s))
    except (TypeError, ValueError):
        lease = default_lease_s
    if age is not None and age > lease:
        return f"not renewed for {age:.0f} s, lease {lease:g} s"
    return None


def describe_holder(holder: dict, age: float | None) -> str:
    renewed = "" if age is None else f", renewed {max(age, 0):.0f} s ago"
    return (f"`{holder.get('command', 'a command')}` (pid {holder.get('pid')} on host {holder.get('host')}, started "
            f"{holder.get('started', '?')}; lease {holder.get('lease_s', '?')} s{renewed})")


