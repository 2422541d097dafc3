"""Zarr stores on S3 and S3-compatible servers: create-only unit writes, a compare-and-swap
commit record and a leased writer lock; no torch.

Why one file: the S3 protocol is one piece: create-only unit writes, the compare-and-swap commit
record and the leased writer lock share the conditional-request helpers and their error handling,
and are only correct together.

Object storage has no rename, no ``flock`` and no ``fsync``. What it has: a PUT replaces a
whole object atomically, a read after a write sees it (AWS S3 since 2020, MinIO, moto), and
*conditional writes* (``If-None-Match: *`` creates only, ``If-Match: <etag>`` replaces only
the version that was read; AWS S3 since 2024, MinIO, Cloudflare R2, moto). A store at an
``s3://`` URL builds on those:

* **Units are created, never overwritten.** Every key of a unit is PUT with
  ``If-None-Match: *``. A key that exists with the same bytes counts as written (a retried
  PUT whose first answer was lost); with other bytes the append fails and publishes nothing.
* **The commit record is swapped, not overwritten.** ``zarr.json`` is PUT with ``If-Match``
  on the etag of the record this writer last wrote, so a publish never replaces a record it
  did not see: a writer whose lock was taken over gets :class:`StoreLockedError` and its
  rows stay unpublished.
* **The writer lock is an object with a lease.** ``writer.lock`` is created with
  ``If-None-Match: *`` and names its holder (a random token, host, pid); the holder rewrites
  it every ``lease_s / 3``. Another writer takes it over (``If-Match`` on the version it saw:
  one of several contenders wins) when its age on the server's clock (the response's
  ``Date`` minus its ``Last-Modified``) exceeds the lease, or at once when the holder was a
  process on this host that is no longer running. The new holder then rewrites the commit
  record with its token, which fences the old one (its next publish fails). The lease gives
  liveness; safety comes from the conditional writes alone, so a writer that was paused past
  its lease never publishes again instead of corrupting the store.
* **Listings decide nothing that is published.** Readers learn units from the record only;
  a listing is used to find a killed writer's leftovers to delete (with the listing cache
  off). A leftover a stale listing missed is never overwritten: its name is refused, the
  append fails, and reopening deletes it.

A PUT that returned is stored: ``durable`` changes nothing here. A server that ignores
conditional headers cannot keep a second writer out; the lock checks this once when it is
taken and warns (:class:`ObjectLockWarning`), and then only the one-writer-per-store rule
the caller keeps protects the store.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any

from rlhf_pipeline.storage.errors import (
    StorageExtraMissingError,
    StoreError,
    StoreLockedError,
    StoreNotFoundError,
)
from rlhf_pipeline.storage.locking import LOCK_FILE_NAME, pid_running
from rlhf_pipeline.storage.zarr.layout import ATTRS_KEY
from rlhf_pipeline.storage.zarr.store_kv import ZarrStoreKV
from rlhf_pipeline.storage.zarr.units import ROOT_META

log = logging.getLogger(__name__)

OBJECT_STORE_SCHEMES = ("s3://", "s3a://")
DEFAULT_LEASE_S = 30.0
# a reader asked to refresh more often (a learner: before every batch) GETs the record at most this often
DEFAULT_REFRESH_INTERVAL_S = 1.0
_CONFLICT_RETRIES = 5  # a 409 "conditional request conflict": another conditional PUT of that key is in flight


class ObjectLockWarning(UserWarning):
    """The object store ignores conditional writes: the writer lock cannot keep a second writer out."""


def default_refresh_interval_s(location: str) -> float:
    """1 s on an object store (each refresh is a GET), 0 elsewhere (a refresh is an ``fstat``)."""
    return DEFAULT_REFRESH_INTERVAL_S if is_object_store_url(location) else 0.0


def is_object_store_url(location: str) -> bool:
    return location.startswith(OBJECT_STORE_SCHEMES)


def require_s3fs(location: str) -> None:
    import importlib.util

    if importlib.util.find_spec("s3fs") is None:
        raise StorageExtraMissingError(
            f"{location} is on S3, which needs the optional package 's3fs'; install it with "
            f"`pip install -e '.[s3]'` (from a checkout) or `pip install 'rlhf-pipeline[s3]'`"
        )


def object_store_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """``storage_options`` for s3fs with our defaults: credentials and endpoint come from
    ``options`` (``key``, ``secret``, ``endpoint_url``, ...) or botocore's usual sources
    (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, profiles)."""
    merged = dict(options or {})
    # a cached listing could hide a killed writer's leftovers from the next writer
    merged.setdefault("use_listings_cache", False)
    # s3fs (since 2025) sends a HEAD before every whole-object GET, to split objects larger than its
    # block size (50 MiB) into concurrent ranged GETs. Ours (commit records, units of a few MB) never
    # are, so the HEAD only doubled every read's requests (counted on the server: a refresh of N
    # shards sent N HEADs beside its N GETs). Reads of several objects already go out together
    if _s3fs_takes("max_concurrency"):  # older s3fs has neither the option nor the HEAD
        merged.setdefault("max_concurrency", 1)
    return merged


@functools.cache  # one signature inspection per process, not one per store opened
def _s3fs_takes(option: str) -> bool:
    import inspect

    try:
        from s3fs import S3FileSystem
    except ImportError:  # require_s3fs says so where it matters
        return False
    return option in inspect.signature(S3FileSystem.__init__).parameters


def _error_response(exc: BaseException) -> dict:
    for candidate in (exc, exc.__cause__, exc.__context__):
        response = getattr(candidate, "response", None)
        if isinstance(response, dict):
            return response
    return {}


def _status(exc: BaseException) -> int | None:
    response = _error_response(exc)
    code = response.get("Error", {}).get("Code")
    if code == "PreconditionFailed":
        return 412
    if code == "ConditionalRequestConflict":
        return 409
    return response.get("ResponseMetadata", {}).get("HTTPStatusCode")


class _PreconditionFailed(Exception):
    """The server refused a conditional write (412): the key exists, or changed since it was read."""


@dataclass
class _Seen:
    body: bytes
    etag: str
    age_s: float | None  # seconds since the last write, on the server's clock


# ======================================================================== key/value I/O
class ObjectStoreKV(ZarrStoreKV):
    """An ``s3://`` store's keys: reads through Zarr's ``FsspecStore``, writes as conditional PUTs."""

    def __init__(self, store, location: str, *, read_only: bool):
        super().__init__(store, read_only=read_only)
        self.location = location
        self._fs = store.fs
        self._bucket, _, self._prefix = store.path.strip("/").partition("/")
        self._writer_token: str | None = None
        self._record_etag: str | None = None  # of the record this writer last read or wrote

    def _key(self, key: str) -> str:
        return f"{self._prefix}/{key}" if self._prefix else key

    async def _call(self, method: str, key: str, **kwargs) -> dict:
        for attempt in range(_CONFLICT_RETRIES):
            try:
                return await self._fs._call_s3(method, Bucket=self._bucket, Key=self._key(key), **kwargs)
            except FileNotFoundError as exc:
                if "bucket" in str(exc).lower():
                    raise StoreNotFoundError(
                        f"{self.location}: the bucket {self._bucket!r} does not exist on this endpoint; create "
                        f"it first, or check endpoint_url (storage_options or AWS_ENDPOINT_URL)"
                    ) from None
                raise
            except PermissionError as exc:
                raise StoreError(
                    f"{self.location}: access denied ({exc}); pass credentials as storage_options "
                    f"key=/secret= or set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
                ) from None
            except Exception as exc:  # noqa: BLE001 - s3fs maps the codes we need to generic OSErrors
                status = _status(exc)
                if status == 412:
                    raise _PreconditionFailed(key) from None
                if status != 409 or attempt == _CONFLICT_RETRIES - 1:
                    raise
            await asyncio.sleep(0.05 * 2**attempt)
        raise AssertionError("unreachable")

    async def _put(self, key: str, body: bytes, **condition) -> str:
        return (await self._call("put_object", key, Body=body, **condition))["ETag"]

    async def _read(self, key: str) -> _Seen | None:
        try:
            out = await self._call("get_object", key)
        except FileNotFoundError:
            return None
        async with out["Body"] as stream:
            body = await stream.read()
        date = out.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        age = None
        if date and out.get("LastModified") is not None:
            age = (parsedate_to_datetime(date) - out["LastModified"]).total_seconds()
        return _Seen(body, out["ETag"], age)

    def _sync(self, coro):
        from zarr.core.sync import sync

        return sync(coro)

    # ---------------------------------------------------------------- units: create only
    def put_many(self, items: Iterable[tuple[str, Any]] | Mapping[str, Any], *, durable: bool = False,
                 threaded: bool = True, defer_sync: bool = False) -> None:
        pairs = [(k, _as_bytes(v)) for k, v in (items.items() if isinstance(items, Mapping) else items)]

        async def create_all():
            await asyncio.gather(*(self._create(k, v) for k, v in pairs))

        self._sync(create_all())

    async def _create(self, key: str, body: bytes) -> None:
        try:
            await self._put(key, body, IfNoneMatch="*")
        except _PreconditionFailed:
            existing = await self._read(key)
            if existing is not None and existing.body == body:
                return  # our own PUT, retried after its answer was lost
            raise StoreLockedError(
                f"{self.location}: {key} already exists with other contents, so this append publishes nothing. "
                f"Either another writer is appending to this store, or a leftover of a killed writer was not "
                f"listed when this writer opened it; close this writer and open the store again (mode='a'), "
                f"which deletes leftovers."
            ) from None

    # ---------------------------------------------------------------- the commit record
    def take_record(self, token: str) -> None:
        """Fences earlier writers: rewrites the commit record (if any) stamped with ``token``,
        replacing only the version read. Called by the lock once it is held."""
        self._writer_token = token
        for _ in range(_CONFLICT_RETRIES):
            seen = self._sync(self._read(ROOT_META))
            if seen is None:
                self._record_etag = None  # a new store: its first publish creates the record
                return
            try:
                document = json.loads(seen.body)
                document["attributes"][ATTRS_KEY]["writer"] = token
            except (ValueError, KeyError, TypeError):
                self._record_etag = seen.etag  # damaged: opening reports it; never rewritten here
                return
            try:
                self._record_etag = self._sync(self._put(ROOT_META, _dump(document), IfMatch=seen.etag))
                return
            except _PreconditionFailed:
                continue  # a fenced writer's publish landed in between: read again
        raise StoreLockedError(f"{self.location}: the commit record keeps changing under a new writer lock; "
                               f"another writer is still publishing. Stop it, then open the store again.")

    def publish_record(self, document: dict[str, Any]) -> None:
        """Replaces the commit record, only if it is still the version this writer last wrote."""
        if self._writer_token is not None:  # the token that fences this writer's predecessors
            attributes = document["attributes"]
            document = dict(document, attributes=dict(
                attributes, **{ATTRS_KEY: dict(attributes[ATTRS_KEY], writer=self._writer_token)}))
        body = _dump(document)
        condition = {"IfNoneMatch": "*"} if self._record_etag is None else {"IfMatch": self._record_etag}
        try:
            self._record_etag = self._sync(self._put(ROOT_META, body, **condition))
        except _PreconditionFailed:
            current = self._sync(self._read(ROOT_META))
            if current is not None and current.body == body:
                self._record_etag = current.etag  # our own PUT, retried after its answer was lost
                return
            raise StoreLockedError(
                f"{self.location}: another writer replaced the commit record since this writer's last publish "
                f"(this writer's lock was taken over: its lease ran out, or the store was opened by a second "
                f"writer); nothing of this append was published. Open the store again (mode='a') to append."
            ) from None

    def writer_lock(self, lease_s: float) -> ObjectStoreLock:
        return ObjectStoreLock(self, lease_s=lease_s)


def _as_bytes(value) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, (list, tuple)):
        return b"".join(bytes(memoryview(v).cast("B")) for v in value)
    return bytes(memoryview(value).cast("B"))


def _dump(document: dict[str, Any]) -> bytes:
    return json.dumps(document, separators=(",", ":"), sort_keys=True).encode()


# ======================================================================== the writer lock
class ObjectStoreLock:
    """``writer.lock`` in the store: created exclusively, renewed every ``lease_s / 3`` on a
    daemon thread, taken over once its lease ran out; same ``acquire``/``release`` as
    :class:`~rlhf_pipeline.storage.locking.WriterLock`."""

    def __init__(self, kv: ObjectStoreKV, *, lease_s: float = DEFAULT_LEASE_S):
        if not lease_s > 0:
            raise ValueError(f"lock_lease_s must be positive, got {lease_s!r}")
        self._kv = kv
        self._lease_s = float(lease_s)
        self._token = uuid.uuid4().hex
        self._owner_pid = os.getpid()
        self._renewals = 0
        self._etag: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = False

    @property
    def held(self) -> bool:
        return self._etag is not None and not self.lost

    @property
    def lease_s(self) -> float:
        return self._lease_s

    def _body(self) -> bytes:
        return _dump({"owner": self._token, "pid": os.getpid(), "host": socket.gethostname(),
                      "lease_s": self._lease_s, "renewal": self._renewals})  # renewal: a new etag each time

    def acquire(self, wait_s: float = 0.0) -> ObjectStoreLock:
        """Takes the lock; while another live writer holds it, waits up to ``wait_s`` seconds for
        its lease to run out (or for it to let go), saying whose lease it is and until when."""
        if self._etag is not None:
            return self
        if not wait_s >= 0:
            raise ValueError(f"lock_wait_s must be >= 0 seconds, got {wait_s!r}")
        kv = self._kv
        deadline = time.monotonic() + wait_s
        changed_hands = 0
        announced: str | None = None  # the holder's version last reported as waited on
        while True:
            try:
                self._etag = kv._sync(kv._put(LOCK_FILE_NAME, self._body(), IfNoneMatch="*"))
                break
            except _PreconditionFailed:
                seen = kv._sync(kv._read(LOCK_FILE_NAME))
            if seen is None:
                changed_hands = self._changed_hands(changed_hands)  # released in between
                continue
            holder = _holder(seen)
            if not self._abandoned(holder, seen):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    waited = f" (waited {wait_s:g} s for it: lock_wait_s)" if wait_s else ""
                    raise StoreLockedError(self._locked_message(holder, seen) + waited)
                runs_out_in = self._runs_out_in(holder, seen)
                if announced != seen.etag:
                    announced = seen.etag
                    log.warning("%s: waiting for the writer lock of process %s on %s: its lease runs out at %s "
                                "unless renewed (lease %g s); waiting up to %.0f s more (lock_wait_s)",
                                kv.location, holder.get("pid"), holder.get("host"),
                                _clock(time.time() + runs_out_in), self._lease_of(holder), remaining)
                # poll at least every second: a holder that lets go deletes the object
                time.sleep(min(remaining, 1.0, max(0.1, runs_out_in + 0.1)))
                continue
            try:
                self._etag = kv._sync(kv._put(LOCK_FILE_NAME, self._body(), IfMatch=seen.etag))
                log.warning("%s: took over the writer lock of process %s on %s (%s)", kv.location,
                            holder.get("pid"), holder.get("host"), self._why_abandoned(holder, seen))
                break
            except _PreconditionFailed:
                changed_hands = self._changed_hands(changed_hands)  # renewed, or another contender won
        self._check_conditional_writes()
        try:
            kv.take_record(self._token)
        except BaseException:
            self.release()
            raise
        self._thread = threading.Thread(target=self._renew_until_released, name="zarr-lock-lease", daemon=True)
        self._thread.start()
        return self

    def _changed_hands(self, times: int) -> int:
        if times + 1 >= 8:
            raise StoreLockedError(
                f"{self._kv.location}: the writer lock changed hands 8 times while this writer tried to take it; "
                f"several writers are starting at once. Run one writer per store.")
        return times + 1

    def _lease_of(self, holder: dict) -> float:
        try:
            return float(holder.get("lease_s", self._lease_s))
        except (TypeError, ValueError):
            return self._lease_s

    def _runs_out_in(self, holder: dict, seen: _Seen) -> float:
        """Seconds until the holder's lease runs out if it is not renewed (server clock)."""
        age = seen.age_s if seen.age_s is not None else 0.0
        return max(0.0, self._lease_of(holder) - age)

    def _check_conditional_writes(self) -> None:
        kv = self._kv
        try:
            kv._sync(kv._put(LOCK_FILE_NAME, self._body(), IfNoneMatch="*"))  # the same bytes: harmless
        except _PreconditionFailed:
            return
        warnings.warn(
            f"{kv.location}: this object store ignores conditional writes (If-None-Match), so its writer lock "
            f"cannot keep a second writer out; run exactly one writer per store (a shard per collector)",
            ObjectLockWarning, stacklevel=4)

    def _abandoned(self, holder: dict, seen: _Seen) -> bool:
        return self._why_abandoned(holder, seen) is not None

    def _why_abandoned(self, holder: dict, seen: _Seen) -> str | None:
        pid, host = holder.get("pid"), holder.get("host")
        if host == socket.gethostname() and isinstance(pid, int) and not pid_running(pid):
            return "that process is no longer running"
        lease = self._lease_of(holder)
        if seen.age_s is not None and seen.age_s > lease:
            return f"not renewed for {seen.age_s:.0f} s, lease {lease:g} s"
        return None

    def _locked_message(self, holder: dict, seen: _Seen) -> str:
        lease = self._lease_of(holder)
        age = "" if seen.age_s is None else f", renewed {max(seen.age_s, 0):.0f} s ago"
        return (f"{self._kv.location} is already open for writing by process {holder.get('pid')} on "
                f"{holder.get('host')} (its lease: {lease:g} s{age}); a store takes one writer at a time. Close "
                f"that writer, open this one with mode='r', or write to another shard. If that writer is gone, "
                f"its lock can be taken once it has not been renewed for {lease:g} s: open with lock_wait_s= "
                f"(seconds) to wait for that.")

    def _renew_until_released(self) -> None:
        kv = self._kv
        while not self._stop.wait(self._lease_s / 3):
            self._renewals += 1
            try:
                self._etag = kv._sync(kv._put(LOCK_FILE_NAME, self._body(), IfMatch=self._etag))
            except _PreconditionFailed:
                self.lost = True
                log.warning("%s: the writer lock was taken over by another writer; this writer's next publish "
                            "fails", kv.location)
                return
            except Exception as exc:  # noqa: BLE001 - a network blip: the next period tries again
                log.warning("%s: renewing the writer lock failed (%r); retrying in %.0f s", kv.location, exc,
                            self._lease_s / 3)

    def release(self, *, remove_if_created: bool = False) -> None:
        """Stops renewing and deletes the lock object if it is still this writer's."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None
        etag, self._etag = self._etag, None
        if etag is None or self.lost or os.getpid() != self._owner_pid:
            return  # a forked child shares nothing to release
        kv = self._kv
        try:
            kv._sync(kv._call("delete_object", LOCK_FILE_NAME, IfMatch=etag))
        except (_PreconditionFailed, FileNotFoundError):
            pass  # taken over (or released by its new holder) meanwhile: not ours to delete
        except Exception as exc:  # noqa: BLE001 - the lease runs out instead
            log.warning("%s: could not delete the writer lock (%r); the next writer takes it over after "
                        "%g s", kv.location, exc, self._lease_s)

    def __enter__(self) -> ObjectStoreLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _clock(epoch_s: float) -> str:
    """A moment as ``HH:MM:SS UTC`` (this host's clock), for the lines of a writer waiting for a lock."""
    import datetime

    return datetime.datetime.fromtimestamp(epoch_s, datetime.timezone.utc).strftime("%H:%M:%S UTC")


def _holder(seen: _Seen) -> dict:
    try:
        holder = json.loads(seen.body)
        return holder if isinstance(holder, dict) else {}
    except ValueError:
        return {}


__all__ = [
    "DEFAULT_LEASE_S",
    "DEFAULT_REFRESH_INTERVAL_S",
    "OBJECT_STORE_SCHEMES",
    "ObjectLockWarning",
    "ObjectStoreKV",
    "ObjectStoreLock",
    "is_object_store_url",
    "object_store_options",
    "require_s3fs",
]
