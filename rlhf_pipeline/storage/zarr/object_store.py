"""Zarr stores on object storage (S3 and S3-compatible servers, Azure Blob Storage): create-only unit
writes, a compare-and-swap commit record and a leased writer lock; no torch.

Why one file: the protocol is one piece: its parts share the conditional writes and their error handling
and are only correct together (which cloud answers them is :mod:`rlhf_pipeline.files.cloud_objects`').

Units are PUT with ``If-None-Match: *``, ``zarr.json`` with ``If-Match`` on the etag this writer last wrote;
``writer.lock`` (:class:`ObjectStoreLock`) is renewed every ``lease_s / 3`` and taken over once its lease ran
out. Design: docs/object-storage.md#how-the-guarantees-hold-without-a-file-system and
docs/zarr-layout.md#on-object-storage (what it rests on)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from rlhf_pipeline.files.cloud_objects import (
    CLOUDS,
    CloudAccessError,
    CloudObjects,
    ConditionFailed,
    ContainerNotFoundError,
    ObjectVersion,
    RetryPolicy,
    UnreachableError,
    cloud_for,
    through_outages,
)
from rlhf_pipeline.storage.errors import (
    StorageExtraMissingError,
    StoreError,
    StoreLockedError,
    StoreNotFoundError,
    StoreUnreachableError,
)
from rlhf_pipeline.storage.locking import LOCK_FILE_NAME, pid_running
from rlhf_pipeline.storage.zarr.layout import ATTRS_KEY
from rlhf_pipeline.storage.zarr.store_kv import ZarrStoreKV
from rlhf_pipeline.storage.zarr.units import ROOT_META

log = logging.getLogger(__name__)

OBJECT_STORE_SCHEMES = tuple(scheme for cloud in CLOUDS for scheme in cloud.schemes)
# a store being made under this prefix: PUT before any other object of it, deleted once its first
# commit record is published. Object storage has no rename, so this object is what a local
# `shard-NNNN.creating` directory is: a reader tells a store still being made from a damaged one
CREATING_KEY = "creating"
DEFAULT_LEASE_S = 30.0
# a reader asked to refresh more often (a learner: before every batch) GETs the record at most this often
DEFAULT_REFRESH_INTERVAL_S = 1.0
_CONFLICT_RETRIES = 5  # the commit record changed under a new writer lock: read it again this often


class ObjectLockWarning(UserWarning):
    """The object store ignores conditional writes: the writer lock cannot keep a second writer out."""


def default_refresh_interval_s(location: str) -> float:
    """1 s on an object store (each refresh is a GET), 0 elsewhere (a refresh is an ``fstat``)."""
    return DEFAULT_REFRESH_INTERVAL_S if is_object_store_url(location) else 0.0


def is_object_store_url(location: str) -> bool:
    """True for a URL on a cloud this library writes to with conditional writes (``s3://``, ``az://``)."""
    return cloud_for(location) is not None


def require_object_store_client(location: str) -> None:
    """Raises :class:`StorageExtraMissingError` naming the extra when ``location``'s cloud client is missing."""
    cloud = cloud_for(location)
    missing = cloud.missing_packages() if cloud is not None else []
    if missing:
        names = " and ".join(repr(name) for name in missing)
        raise StorageExtraMissingError(
            f"{location} is on {cloud.name}, which needs the optional package{'s' * (len(missing) > 1)} {names}; "
            f"install {'them' if len(missing) > 1 else 'it'} with `pip install -e '.[{cloud.extra}]'` (from a "
            f"checkout) or `pip install 'rlhf-pipeline[{cloud.extra}]'`"
        )


def object_store_options(options: Mapping[str, Any] | None, *, location: str) -> dict[str, Any]:
    """``storage_options`` for ``location``'s fsspec file system with our defaults. Credentials and
    endpoint come from ``options`` or the client's usual sources: on S3 (s3fs) ``key``, ``secret``,
    ``endpoint_url`` or ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``,
    profiles; on Azure (adlfs) ``connection_string``, ``account_name`` with ``account_key`` or
    ``AZURE_STORAGE_CONNECTION_STRING``, ``AZURE_STORAGE_ACCOUNT_NAME``, ..."""
    cloud = cloud_for(location)
    if cloud is None:
        raise ValueError(f"{location} is not an object-store URL ({', '.join(OBJECT_STORE_SCHEMES)})")
    return cloud.fsspec_options(options)


# ======================================================================== key/value I/O
class ObjectStoreKV(ZarrStoreKV):
    """An object-store URL's keys: reads through Zarr's ``FsspecStore``, writes through
    :class:`~rlhf_pipeline.files.cloud_objects.CloudObjects` (conditional writes), on Zarr's loop.

    Every request is retried while it gets no answer (refused, reset, timed out) for up to
    ``outage_policy.budget_s`` (60 s), with backoff: an outage shorter than that delays an append
    or a refresh, it does not stop a collector or a learner. Faults the server answers (throttling,
    server errors) are the client's own retries' (botocore's, azure-core's). A retry is safe: units
    are created only (the same bytes already there count as written), the record replaces only the
    version this writer holds, and either settles a lost answer by reading the object back."""

    outage_policy = RetryPolicy()

    def __init__(self, store, location: str, *, read_only: bool):
        super().__init__(store, read_only=read_only)
        self.location = location
        self.objects: CloudObjects = cloud_for(location)(store.fs, store.path)
        self._writer_token: str | None = None
        self._record_etag: str | None = None  # of the record this writer last read or wrote

    def _through_outages(self, what: str, call):
        try:
            return through_outages(call, self.objects.unanswered, f"{self.location}: {what}", self.outage_policy)
        except UnreachableError as exc:
            raise StoreUnreachableError(f"{exc}; nothing published was lost: retry once it answers") from exc

    async def _answered(self, request):
        """``request``'s answer, with the cloud's errors as the store errors users act on."""
        try:
            return await request
        except ContainerNotFoundError as exc:
            raise StoreNotFoundError(f"{self.location}: {exc}") from None
        except CloudAccessError as exc:
            raise StoreError(f"{self.location}: {exc}") from None

    async def _read(self, key: str) -> ObjectVersion | None:
        return await self._answered(self.objects.read(key))

    def get_many(self, keys: Iterable[str]) -> list[bytes | None]:
        keys = list(keys)
        try:
            return self._through_outages(f"GET {keys[0] if len(keys) == 1 else f'{len(keys)} keys'}",
                                         lambda: super(ObjectStoreKV, self).get_many(keys))
        except StoreError:
            raise
        except Exception as exc:
            denied = self.objects.access_error(exc)  # else the client's own error type and words
            if denied is None:
                raise
            raise StoreError(f"{self.location}: {denied}") from None

    def list_dir(self, prefix: str) -> list[str]:
        return self._through_outages(f"LIST {prefix or '/'}", lambda: super(ObjectStoreKV, self).list_dir(prefix))

    def delete_prefix(self, prefix: str) -> None:
        self._through_outages(f"DELETE {prefix}/", lambda: super(ObjectStoreKV, self).delete_prefix(prefix))

    def delete_unit(self, prefix: str, keys: list[str]) -> None:
        """The unit's own keys in one batch (S3: one request), not a LIST of ``prefix`` and then a
        delete: a replaced fragment cost two requests on every append. A key the unit does not hold
        (an empty array has no chunk) is fine to delete; anything else under ``prefix`` the next
        writer's orphan sweep deletes."""
        self._through_outages(f"DELETE {prefix}/", lambda: self._sync(self._answered(self.objects.remove_many(keys))))

    def size_of(self, prefix: str) -> int:
        return self._through_outages(f"LIST {prefix}/", lambda: super(ObjectStoreKV, self).size_of(prefix))

    def create_object(self, key: str, body: bytes) -> str:
        return self._through_outages(f"PUT {key}", lambda: self._sync(self._answered(self.objects.create(key, body))))

    def replace_object(self, key: str, body: bytes, etag: str) -> str:
        return self._through_outages(f"PUT {key}",
                                     lambda: self._sync(self._answered(self.objects.replace(key, body, etag))))

    def read_object(self, key: str) -> ObjectVersion | None:
        return self._through_outages(f"GET {key}", lambda: self._sync(self._read(key)))

    def delete_object(self, key: str, etag: str) -> None:
        self._through_outages(f"DELETE {key}", lambda: self._sync(self._answered(self.objects.delete(key, etag))))

    # ---------------------------------------------------------------- units: create only
    def put_many(self, items: Iterable[tuple[str, Any]] | Mapping[str, Any], *, durable: bool = False,
                 threaded: bool = True, defer_sync: bool = False) -> None:
        pairs = [(k, _as_bytes(v)) for k, v in (items.items() if isinstance(items, Mapping) else items)]

        async def create_all():
            # every create ends before this returns (a retry never races one still in flight)
            outcomes = await asyncio.gather(*(self._create(k, v) for k, v in pairs), return_exceptions=True)
            failed = [o for o in outcomes if isinstance(o, BaseException)]
            if failed:
                # an outage before the others: retried for a time; a refusal (StoreLockedError) first
                raise next((f for f in failed if not self.objects.unanswered(f)), failed[0])

        self._through_outages(f"PUT {pairs[0][0] if len(pairs) == 1 else f'{len(pairs)} keys'}",
                              lambda: self._sync(create_all()))

    async def _create(self, key: str, body: bytes) -> None:
        try:
            await self._answered(self.objects.create(key, body))
        except ConditionFailed:
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
            seen = self.read_object(ROOT_META)
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
                self._record_etag = self.replace_object(ROOT_META, _dump(document), seen.etag)
                self.unmark_creating()  # a creation killed between its first publish and deleting its marker
                return
            except ConditionFailed:
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
        first = self._record_etag is None
        try:
            if first:
                self._record_etag = self.create_object(ROOT_META, body)
            else:
                self._record_etag = self.replace_object(ROOT_META, body, self._record_etag)
        except ConditionFailed:
            current = self.read_object(ROOT_META)
            if current is not None and current.body == body:
                self._record_etag = current.etag  # our own PUT, retried after its answer was lost
                if first:
                    self.unmark_creating()
                return
            raise StoreLockedError(
                f"{self.location}: another writer replaced the commit record since this writer's last publish "
                f"(this writer's lock was taken over: its lease ran out, or the store was opened by a second "
                f"writer); nothing of this append was published. Open the store again (mode='a') to append."
            ) from None
        if first:
            self.unmark_creating()  # the store's first record: it is made

    def writer_lock(self, lease_s: float) -> ObjectStoreLock:
        return ObjectStoreLock(self, lease_s=lease_s)

    # ---------------------------------------------------------------- a store being made
    def mark_creating(self) -> None:
        """Says, before anything else is written, that a store is being made here (:data:`CREATING_KEY`)."""
        body = _dump({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()})
        self._through_outages(f"PUT {CREATING_KEY}",
                              lambda: self._sync(self._answered(self.objects.put(CREATING_KEY, body))))

    def unmark_creating(self) -> None:
        """Deletes the marker: the store has its commit record (a marker left beside one is ignored)."""
        self._through_outages(f"DELETE {CREATING_KEY}",
                              lambda: self._sync(self._answered(self.objects.remove(CREATING_KEY))))

    def being_created(self) -> str | None:
        """For a prefix with no commit record and no units: why it is a store still being made (its
        marker names the process and when it started), or one whose making stopped before its first
        record (a creation killed midway before the marker existed leaves only its writer lock and
        group metadata); None when other objects are there, which is no store of ours."""
        marker = self.read_object(CREATING_KEY)
        if marker is not None:
            maker = _holder(marker)
            started = maker.get("started")
            since = f" since {_clock(started)}" if isinstance(started, (int, float)) else ""
            return (f"{self.location} is being created by process {maker.get('pid')} on {maker.get('host')}{since}: "
                    f"no rows yet (a creation killed midway stays so until its writer starts again)")
        names = set(self.list_dir(""))
        if names and names <= {LOCK_FILE_NAME, CREATING_KEY, "units"} and set(self.list_dir("units")) <= {ROOT_META}:
            return (f"{self.location} holds only what a store's creation writes before its first commit record: no "
                    f"rows yet (a creation stopped midway; its writer makes it again when it starts)")
        return None


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
                self._etag = kv.create_object(LOCK_FILE_NAME, self._body())
                break
            except ConditionFailed:
                seen = kv.read_object(LOCK_FILE_NAME)
            if seen is None:
                changed_hands = self._changed_hands(changed_hands)  # released in between
                continue
            holder = _holder(seen)
            if holder.get("owner") == self._token:  # our create landed, its answer was lost: retried
                self._etag = seen.etag
                break
            if not self._abandoned(holder, seen):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    waited = f" (waited {wait_s:g} s for it: lock_wait_s)" if wait_s else ""
                    raise StoreLockedError(self._locked_message(holder, seen) + waited,
                                           holder=f"process {holder.get('pid')} on {holder.get('host')}")
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
                self._etag = kv.replace_object(LOCK_FILE_NAME, self._body(), seen.etag)
                log.warning("%s: took over the writer lock of process %s on %s (%s)", kv.location,
                            holder.get("pid"), holder.get("host"), self._why_abandoned(holder, seen))
                break
            except ConditionFailed:
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

    def _runs_out_in(self, holder: dict, seen: ObjectVersion) -> float:
        """Seconds until the holder's lease runs out if it is not renewed (server clock)."""
        age = seen.age_s if seen.age_s is not None else 0.0
        return max(0.0, self._lease_of(holder) - age)

    def _check_conditional_writes(self) -> None:
        kv = self._kv
        try:
            kv.create_object(LOCK_FILE_NAME, self._body())  # the same bytes: harmless
        except ConditionFailed:
            return
        warnings.warn(
            f"{kv.location}: this object store ignores conditional writes (If-None-Match), so its writer lock "
            f"cannot keep a second writer out; run exactly one writer per store (a shard per collector)",
            ObjectLockWarning, stacklevel=4)

    def _abandoned(self, holder: dict, seen: ObjectVersion) -> bool:
        return self._why_abandoned(holder, seen) is not None

    def _why_abandoned(self, holder: dict, seen: ObjectVersion) -> str | None:
        return _why_abandoned(holder, seen, self._lease_of(holder))

    def _locked_message(self, holder: dict, seen: ObjectVersion) -> str:
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
                self._etag = kv.replace_object(LOCK_FILE_NAME, self._body(), self._etag)
            except ConditionFailed:
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
            kv.delete_object(LOCK_FILE_NAME, etag)
        except ConditionFailed:
            pass  # taken over (or released by its new holder) meanwhile: not ours to delete
        except Exception as exc:  # noqa: BLE001 - the lease runs out instead
            log.warning("%s: could not delete the writer lock (%r); the next writer takes it over after "
                        "%g s", kv.location, exc, self._lease_s)

    def __enter__(self) -> ObjectStoreLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _why_abandoned(holder: dict, seen: ObjectVersion, lease: float) -> str | None:
    pid, host = holder.get("pid"), holder.get("host")
    if host == socket.gethostname() and isinstance(pid, int) and not pid_running(pid):
        return "that process is no longer running"
    if seen.age_s is not None and seen.age_s > lease:
        return f"not renewed for {seen.age_s:.0f} s, lease {lease:g} s"
    return None


def live_writer(kv: ObjectStoreKV) -> str | None:
    """Who holds the store's writer lock (``"process 4242 on node-7"``) while its lease runs, else
    None (no lock object, or one its holder abandoned); reads the lock, takes nothing."""
    seen = kv.read_object(LOCK_FILE_NAME)
    if seen is None:
        return None
    holder = _holder(seen)
    try:
        lease = float(holder.get("lease_s", DEFAULT_LEASE_S))
    except (TypeError, ValueError):
        lease = DEFAULT_LEASE_S
    if _why_abandoned(holder, seen, lease) is not None:
        return None
    return f"process {holder.get('pid')} on {holder.get('host')}"


def _clock(epoch_s: float) -> str:
    """A moment as ``HH:MM:SS UTC`` (this host's clock), for the lines of a writer waiting for a lock."""
    import datetime

    return datetime.datetime.fromtimestamp(epoch_s, datetime.timezone.utc).strftime("%H:%M:%S UTC")


def _holder(seen: ObjectVersion) -> dict:
    try:
        holder = json.loads(seen.body)
        return holder if isinstance(holder, dict) else {}
    except ValueError:
        return {}


__all__ = [
    "CREATING_KEY",
    "DEFAULT_LEASE_S",
    "DEFAULT_REFRESH_INTERVAL_S",
    "OBJECT_STORE_SCHEMES",
    "ObjectLockWarning",
    "ObjectStoreKV",
    "ObjectStoreLock",
    "is_object_store_url",
    "live_writer",
    "object_store_options",
    "require_object_store_client",
]
