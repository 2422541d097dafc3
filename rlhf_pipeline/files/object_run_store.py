"""A run's state objects at a URL (``s3://bucket/prefix``, ``az://container/prefix``):
:class:`ObjectRunStore`, the :class:`~rlhf_pipeline.files.run_store.RunStore` of a run at a URL.
Whole-object PUTs (a reader sees the old or the new object), fenced by ETag (``If-Match``; versions
created with ``If-None-Match: *``), every request through
:class:`~rlhf_pipeline.files.cloud_objects.CloudObjects` on the URL's fsspec file system (one set of
credentials with the buffer's), retried under a stated budget by this store's own loop, which settles a
write whose answer was lost by reading it back. What gives up raises
:class:`~rlhf_pipeline.files.run_store.RunStoreError` naming the object, the tries, the time and the error.
Design: docs/object-storage.md#a-whole-run-at-a-url.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from rlhf_pipeline.files.cloud_objects import (
    CloudAccessError,
    CloudObjects,
    ConditionFailed,
    ContainerNotFoundError,
    RetryPolicy,
    cloud_for,
)
from rlhf_pipeline.files.run_store import (
    Content,
    RunStore,
    RunStoreError,
    StaleWriterError,
    content_bytes,
)

SCHEMES = ("s3://", "az://")
T = TypeVar("T")


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b/`` -> ``("bucket", "a/b")`` (a container for ``az://``)."""
    rest = url.split("://", 1)[1].strip("/")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError(f"{url!r} names no bucket or container; give s3://BUCKET/PREFIX or az://CONTAINER/PREFIX")
    return bucket, prefix


class ObjectRunStore(RunStore):
    """A run's objects under ``s3://bucket/prefix`` or ``az://container/prefix``.

    It remembers the ETag of every key it last wrote or read. A fenced write replaces only that
    version (``If-Match``), or creates the key (``If-None-Match: *``) when it has never seen it and it
    does not exist; a key it has never seen that exists is read first (``HEAD``), so a restarted
    process takes over its predecessor's objects and the predecessor, if it still runs, gets
    :class:`~rlhf_pipeline.files.run_store.StaleWriterError` at its next write. Each request is retried
    under ``retry`` (:class:`RetryPolicy`) by this store's loop, the cloud client's own retries off."""

    def __init__(self, url: str, *, storage_options: dict[str, Any] | None = None,
                 retry: RetryPolicy = RetryPolicy()) -> None:
        cloud = cloud_for(url)
        if not url.startswith(SCHEMES) or cloud is None:
            raise ValueError(f"{url!r}: a run at a URL needs one of {', '.join(SCHEMES)}")
        missing = cloud.missing_packages()
        if missing:
            raise RunStoreError(
                f"a run at a {url.split('://')[0]}:// URL needs the optional package(s) {', '.join(missing)}; install "
                f"them with `pip install -e '.[{cloud.extra}]'` (from a checkout) or "
                f"`pip install 'rlhf-pipeline[{cloud.extra}]'`")
        self.location = url.rstrip("/")
        self.bucket, self.prefix = split_url(url)
        self.retry = retry
        self._etags: dict[str, str] = {}
        # threads of one process share a store (a learner and a collector in one process): each
        # ETag remembered bumps its key's count, and a read records its ETag only when nothing was
        # recorded for that key while it was in flight, so a late answer never replaces a newer one
        self._etag_lock = threading.RLock()
        self._etag_counts: dict[str, int] = {}
        self.objects: CloudObjects = cloud.without_client_retries(
            self.location, storage_options, connect_timeout_s=retry.connect_timeout_s,
            read_timeout_s=retry.read_timeout_s)
        self.requests = 0  # sent, retries included (what a benchmark or a test counts)

    @property
    def is_local(self) -> bool:
        return False

    @property
    def supports_link(self) -> bool:
        return False

    @property
    def supports_rename(self) -> bool:
        return False

    @property
    def supports_server_copy(self) -> bool:
        return self.objects.server_side_copy

    # ---------------------------------------------------------------- one request, retried
    def _call(self, what: str, key: str, operation: Callable[[], Awaitable[T]]) -> T:
        """``operation()`` (one request about ``key``), retried under :attr:`retry`; lets
        :class:`ConditionFailed` through, raises :class:`RunStoreError` for the rest."""
        from fsspec.asyn import sync

        started = time.monotonic()
        last: BaseException | None = None
        attempt = answered = 0
        while True:
            self.requests += 1
            try:
                return sync(self.objects.loop, operation)
            except ConditionFailed:
                raise
            except (ContainerNotFoundError, CloudAccessError) as exc:
                raise RunStoreError(f"{self.describe(key)}: {what} failed: {exc}") from exc
            except Exception as exc:
                if not self.objects.transient(exc):
                    raise RunStoreError(f"{self.describe(key)}: {what} failed: {_short(exc)}. Check the URL, the "
                                        f"endpoint and the credentials: {self.objects.credentials_hint}") from exc
                last = exc
                if not self.objects.unanswered(exc):  # an outage is retried for a time, not a count
                    answered += 1
            attempt += 1
            delay = self.retry.delay_s(attempt)
            spent = time.monotonic() - started
            if self.retry.gives_up(answered, spent, delay):
                raise RunStoreError(
                    f"{self.describe(key)}: {what} gave up after {attempt} tries in {spent:.1f} s (retry budget: "
                    f"{self.retry.describe()}); last error: {_short(last)}. The object store is throttling or "
                    f"unreachable; the run can be started again once it answers"
                ) from last
            time.sleep(delay)

    # ---------------------------------------------------------------- the contract
    def read(self, key: str) -> bytes | None:
        found = self._read(key)
        return None if found is None else found.body

    def read_with_etag(self, key: str) -> tuple[bytes, str] | None:
        found = self._read(key)
        return None if found is None else (found.body, found.etag)

    def _read(self, key: str) -> Any:
        count = self._etag_counts.get(key, 0)
        found = self._call("GET", key, lambda: self.objects.read(key))
        if found is not None:
            with self._etag_lock:
                if self._etag_counts.get(key, 0) == count:
                    self._remember(key, found.etag)
        return found

    def _remember(self, key: str, etag: str | None) -> None:
        """``etag`` as the version of ``key`` this store last wrote or read (None: forget it)."""
        with self._etag_lock:
            if etag is None:
                self._etags.pop(key, None)
            else:
                self._etags[key] = etag
            self._etag_counts[key] = self._etag_counts.get(key, 0) + 1

    def exists(self, key: str) -> bool:
        return self._call("HEAD", key, lambda: self.objects.etag(key)) is not None

    def write(self, key: str, content: Content, *, fence: bool = True, durable: bool = True,
              partial_name: str | None = None) -> None:
        body = content_bytes(content)
        if not fence:
            self._remember(key, self._call("PUT", key, lambda: self.objects.put(key, body)))
            return
        etag = self._etags.get(key) or self._call("HEAD", key, lambda: self.objects.etag(key))
        try:
            if etag is None:
                self._remember(key, self._call("PUT (fenced)", key, lambda: self.objects.create(key, body)))
            else:
                self._remember(key, self._call("PUT (fenced)", key,
                                               lambda: self.objects.replace(key, body, etag)))
        except ConditionFailed:
            self._settle_refused(key, body, replaced=True)

    def create(self, key: str, content: Content, *, partial_name: str | None = None) -> None:
        body = content_bytes(content)
        try:
            self._remember(key, self._call("PUT (create)", key, lambda: self.objects.create(key, body)))
        except ConditionFailed:
            self._settle_refused(key, body, replaced=False)

    def _settle_refused(self, key: str, body: bytes, *, replaced: bool) -> None:
        """A conditional write was refused: our own earlier try that landed (same bytes), or
        another writer's object."""
        found = self._call("GET", key, lambda: self.objects.read(key))
        if found is not None and found.body == body:
            self._remember(key, found.etag)
            return
        if replaced:
            raise StaleWriterError(
                f"{self.describe(key)} was replaced by another writer since this process last wrote it: another "
                f"process now runs this part of the run (a restart, here or on another machine), so this one "
                f"stops without putting its older state over the newer one") from None
        raise StaleWriterError(
            f"{self.describe(key)} exists already with other contents: another process has written this version "
            f"(a restart of this run elsewhere). This process stops without overwriting it") from None

    def copy(self, src_key: str, dst_key: str, *, source: RunStore | None = None) -> None:
        """Server-side where the cloud has it (S3's CopyObject), else through this machine
        (:meth:`CloudObjects.copy_from`); a store of another kind is read and written."""
        source = self if source is None else source
        if not isinstance(source, ObjectRunStore):
            return super().copy(src_key, dst_key, source=source)
        etag = self._call("COPY", dst_key, lambda: self.objects.copy_from(source.objects, src_key, dst_key))
        if etag is None:
            raise FileNotFoundError(2, "no such object", source.describe(src_key))
        self._remember(dst_key, etag)

    def list(self, prefix: str) -> list[str]:
        return self._call("LIST", prefix, lambda: self.objects.list(prefix))

    def list_etags(self, prefix: str) -> dict[str, str]:
        return self._call("LIST", prefix, lambda: self.objects.list_etags(prefix))

    def delete(self, key: str) -> None:
        self._call("DELETE", key, lambda: self.objects.remove(key))
        self._remember(key, None)

    # ---------------------------------------------------------------- leases (run_lease.py)
    def put_if(self, key: str, body: bytes, *, etag: str | None) -> str | None:
        """PUT ``key`` only over version ``etag`` (None: only when absent); its new ETag, or None
        when refused. No fencing bookkeeping: what a lease uses to take, renew and hand over."""
        try:
            if etag is None:
                return self._call("PUT (conditional)", key, lambda: self.objects.create(key, body))
            return self._call("PUT (conditional)", key, lambda: self.objects.replace(key, body, etag))
        except ConditionFailed:
            return None

    def read_with_age(self, key: str) -> tuple[bytes, str, float | None] | None:
        """``(body, etag, seconds since its last write on the server's clock)`` or None."""
        found = self._call("GET", key, lambda: self.objects.read(key))
        return None if found is None else (found.body, found.etag, found.age_s)

    def delete_if(self, key: str, etag: str) -> bool:
        """Deletes ``key`` only if it is still version ``etag``."""
        try:
            self._call("DELETE (conditional)", key, lambda: self.objects.delete(key, etag))
            return True
        except ConditionFailed:
            return False


def _short(exc: BaseException | None) -> str:
    """One line about ``exc``, with botocore's HTTP status and error code where it has them."""
    if exc is None:
        return "none"
    from rlhf_pipeline.files.cloud_s3 import s3_error_response

    response = s3_error_response(exc)
    code = response.get("Error", {}).get("Code")
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or getattr(exc, "status_code", None)
    code = code or getattr(exc, "error_code", None)
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return f"{text} (HTTP {status}, {code})" if status or code else f"{type(exc).__name__}: {text}"
