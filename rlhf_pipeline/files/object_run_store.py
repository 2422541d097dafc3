"""A run's state objects at an ``s3://`` URL: whole-object PUTs (atomic: a reader sees the old or
the new object), conditional writes for fencing, and retries under a stated budget.

Why s3fs: the buffer's Zarr stores already reach object storage through fsspec's s3fs (its
``storage_options`` and botocore's credential chain: ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
profiles), so a run at a URL is configured exactly like a buffer at a URL, with one client and one
set of credentials. The conditional headers go through s3fs's ``_call_s3`` (botocore's
``put_object`` with ``IfMatch`` / ``IfNoneMatch``), as the buffer's commit record does.

**Fencing.** The store remembers the ETag of every key it last wrote or read. A fenced write
replaces only that version (``If-Match``), or creates the key (``If-None-Match: *``) when it has
never seen it and it does not exist; a key it has never seen that exists is read first (``HEAD``),
so a restarted process takes over its predecessor's objects, and the predecessor, if it still
runs, is refused at its next write (:class:`~rlhf_pipeline.files.run_store.StaleWriterError`).
Versions (weights, checkpoints) are created with ``If-None-Match: *``: never overwritten.

**Retries.** botocore's and s3fs's own retries are off, so that one loop owns the budget
(:class:`RetryPolicy`): throttling (503 SlowDown, 500/502/504), a conflicting conditional write
in flight (409) and timeouts or dropped connections are retried with exponential backoff and full
jitter, at most ``attempts`` tries, none started after ``budget_s`` seconds. A write whose answer was
lost may have landed: its retry then meets its own write (412) and the store reads the object
back; the same bytes count as written. What gives up raises
:class:`~rlhf_pipeline.files.run_store.RunStoreError` naming the object, the tries and the last error.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

from rlhf_pipeline.files.run_store import (
    Content,
    RunStore,
    RunStoreError,
    StaleWriterError,
    content_bytes,
)

SCHEMES = ("s3://",)
_RETRY_STATUS = {500, 502, 503, 504, 409}
_RETRY_CODES = {"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling",
                "ThrottlingException", "ConditionalRequestConflict"}


@dataclass(frozen=True)
class RetryPolicy:
    """How long one request may keep trying: at most ``attempts`` tries, and no try starts (waits
    included) after ``budget_s`` seconds; the wait before try ``n`` is drawn uniformly from
    ``[0, min(max_delay_s, first_delay_s * 2**n))``. One try itself is bounded by the connect and
    read timeouts, so a request gives up within ``budget_s + read_timeout_s``."""

    attempts: int = 8
    first_delay_s: float = 0.1
    max_delay_s: float = 5.0
    budget_s: float = 60.0
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0

    def delay_s(self, attempt: int) -> float:
        return random.uniform(0.0, min(self.max_delay_s, self.first_delay_s * 2 ** attempt))


class _PreconditionFailed(Exception):
    """412: the key exists (``If-None-Match``) or is not the version named (``If-Match``)."""


class _Transient(Exception):
    """A failure worth another try (throttled, a timeout, a dropped connection)."""


def _response(exc: BaseException) -> dict:
    seen = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        response = getattr(current, "response", None)
        if isinstance(response, dict):
            return response
        current = current.__cause__ or current.__context__
    return {}


def _classify(exc: BaseException) -> str:
    """``"precondition"``, ``"missing"``, ``"transient"`` or ``"fatal"``."""
    response = _response(exc)
    code = response.get("Error", {}).get("Code")
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if code == "NoSuchBucket":
        return "fatal"
    if code == "PreconditionFailed" or status == 412:
        return "precondition"
    if code in ("NoSuchKey", "404", "NotFound") or status == 404:
        return "missing"
    if code in _RETRY_CODES or status in _RETRY_STATUS:
        return "transient"
    if isinstance(exc, FileExistsError):  # s3fs's translation of a refused If-None-Match
        return "precondition"
    if isinstance(exc, FileNotFoundError) and not response:
        return "missing"
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError, ConnectionError)):
        return "transient"
    try:
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import HTTPClientError
    except ImportError:  # pragma: no cover - s3fs brings botocore
        return "fatal"
    if isinstance(exc, (HTTPClientError, BotoConnectionError)):
        return "transient"
    try:
        import aiohttp
    except ImportError:  # pragma: no cover
        return "fatal"
    return "transient" if isinstance(exc, aiohttp.ClientError) else "fatal"


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b/`` -> ``("bucket", "a/b")``."""
    rest = url.split("://", 1)[1].strip("/")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError(f"{url!r} names no bucket; give s3://BUCKET/PREFIX")
    return bucket, prefix


class ObjectRunStore(RunStore):
    """A run's objects under ``s3://bucket/prefix`` (see the module docstring)."""

    def __init__(self, url: str, *, storage_options: dict[str, Any] | None = None,
                 retry: RetryPolicy = RetryPolicy()) -> None:
        if not url.startswith(SCHEMES):
            raise ValueError(f"{url!r}: a run at a URL needs one of {', '.join(SCHEMES)}")
        self.location = url.rstrip("/")
        self.bucket, self.prefix = split_url(url)
        self.retry = retry
        self._etags: dict[str, str] = {}
        self._fs = _file_system(storage_options, retry)
        self.requests = 0  # sent, retries included (what a benchmark or a test counts)

    @property
    def is_local(self) -> bool:
        return False

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    # ---------------------------------------------------------------- one request, retried
    def _call(self, what: str, key: str, method: str, **kwargs) -> Any:
        """``method`` on ``key``, retried under :attr:`retry`; raises _PreconditionFailed,
        FileNotFoundError or RunStoreError."""
        from fsspec.asyn import sync

        started = time.monotonic()
        last: BaseException | None = None
        attempt = 0
        while True:
            self.requests += 1
            try:
                return sync(self._fs.loop, self._request, method, key, kwargs)
            except Exception as exc:
                kind = _classify(exc)
                if kind == "precondition":
                    raise _PreconditionFailed(key) from None
                if kind == "missing":
                    raise FileNotFoundError(self.describe(key)) from None
                if kind == "fatal":
                    raise RunStoreError(f"{self.describe(key)}: {what} failed: {_short(exc)}. {_hint(exc)}") from exc
                last = exc
            attempt += 1
            delay = self.retry.delay_s(attempt)
            spent = time.monotonic() - started
            if attempt >= self.retry.attempts or spent + delay > self.retry.budget_s:
                raise RunStoreError(
                    f"{self.describe(key)}: {what} gave up after {attempt} tries in {spent:.1f} s (retry budget: "
                    f"{self.retry.attempts} tries, {self.retry.budget_s:g} s); last error: {_short(last)}. The "
                    f"object store is throttling or unreachable; the run can be started again once it answers"
                ) from last
            time.sleep(delay)

    async def _request(self, method: str, key: str, kwargs: dict) -> Any:
        out = await self._fs._call_s3(method, Bucket=self.bucket, Key=self._key(key), **kwargs)
        if method == "get_object":
            async with out["Body"] as stream:
                out["Body"] = await stream.read()
        return out

    # ---------------------------------------------------------------- the contract
    def read(self, key: str) -> bytes | None:
        try:
            out = self._call("GET", key, "get_object")
        except FileNotFoundError:
            return None
        self._etags[key] = out["ETag"]
        return out["Body"]

    def _head_etag(self, key: str) -> str | None:
        try:
            return self._call("HEAD", key, "head_object")["ETag"]
        except FileNotFoundError:
            return None

    def exists(self, key: str) -> bool:
        return self._head_etag(key) is not None

    def write(self, key: str, content: Content, *, fence: bool = True, durable: bool = True,
              partial_name: str | None = None) -> None:
        body = content_bytes(content)
        if not fence:
            self._etags[key] = self._call("PUT", key, "put_object", Body=body)["ETag"]
            return
        etag = self._etags.get(key) or self._head_etag(key)
        condition = {"IfMatch": etag} if etag is not None else {"IfNoneMatch": "*"}
        try:
            self._etags[key] = self._call("PUT (fenced)", key, "put_object", Body=body, **condition)["ETag"]
        except _PreconditionFailed:
            self._settle_refused(key, body, replaced=True)

    def create(self, key: str, content: Content, *, partial_name: str | None = None) -> None:
        body = content_bytes(content)
        try:
            self._etags[key] = self._call("PUT (create)", key, "put_object", Body=body, IfNoneMatch="*")["ETag"]
        except _PreconditionFailed:
            self._settle_refused(key, body, replaced=False)

    def _settle_refused(self, key: str, body: bytes, *, replaced: bool) -> None:
        """A conditional write was refused: our own earlier try that landed (same bytes), or
        another writer's object."""
        try:
            out = self._call("GET", key, "get_object")
        except FileNotFoundError:
            out = None
        if out is not None and out["Body"] == body:
            self._etags[key] = out["ETag"]
            return
        if replaced:
            raise StaleWriterError(
                f"{self.describe(key)} was replaced by another writer since this process last wrote it: another "
                f"process now runs this part of the run (a restart, here or on another machine), so this one "
                f"stops without putting its older state over the newer one") from None
        raise StaleWriterError(
            f"{self.describe(key)} exists already with other contents: another process has written this version "
            f"(a restart of this run elsewhere). This process stops without overwriting it") from None

    def list(self, prefix: str) -> list[str]:
        inner = prefix.strip("/")
        base = self._key(inner) if inner else self.prefix
        base = f"{base}/" if base else ""
        names: list[str] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Prefix": base, "Delimiter": "/"}
            if token:
                kwargs["ContinuationToken"] = token
            out = self._list_page(prefix, kwargs)
            names += [item["Key"][len(base):] for item in out.get("Contents", [])]
            # "directories" too, as a directory listing names them (a metrics log's parts)
            names += [item["Prefix"][len(base):].rstrip("/") for item in out.get("CommonPrefixes", [])]
            if not out.get("IsTruncated"):
                return names
            token = out["NextContinuationToken"]

    def _list_page(self, prefix: str, kwargs: dict) -> dict:
        from fsspec.asyn import sync

        started, attempt = time.monotonic(), 0
        while True:
            self.requests += 1
            try:
                return sync(self._fs.loop, self._fs._call_s3, "list_objects_v2", Bucket=self.bucket, **kwargs)
            except Exception as exc:
                if _classify(exc) != "transient":
                    raise RunStoreError(f"{self.describe(prefix)}: LIST failed: {_short(exc)}. {_hint(exc)}") from exc
                attempt += 1
                delay = self.retry.delay_s(attempt)
                if attempt >= self.retry.attempts or time.monotonic() - started + delay > self.retry.budget_s:
                    raise RunStoreError(f"{self.describe(prefix)}: LIST gave up after {attempt} tries; last error: "
                                        f"{_short(exc)}") from exc
                time.sleep(delay)

    def delete(self, key: str) -> None:
        try:
            self._call("DELETE", key, "delete_object")
        except FileNotFoundError:
            pass
        self._etags.pop(key, None)

    # ---------------------------------------------------------------- leases (run_lease.py)
    def put_if(self, key: str, body: bytes, *, etag: str | None) -> str | None:
        """PUT ``key`` only over version ``etag`` (None: only when absent); its new ETag, or None
        when refused. No fencing bookkeeping: what a lease uses to take, renew and hand over."""
        condition = {"IfMatch": etag} if etag is not None else {"IfNoneMatch": "*"}
        try:
            return self._call("PUT (conditional)", key, "put_object", Body=body, **condition)["ETag"]
        except _PreconditionFailed:
            return None

    def read_with_age(self, key: str) -> tuple[bytes, str, float | None] | None:
        """``(body, etag, seconds since its last write on the server's clock)`` or None."""
        from email.utils import parsedate_to_datetime

        try:
            out = self._call("GET", key, "get_object")
        except FileNotFoundError:
            return None
        date = out.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        age = None
        if date and out.get("LastModified") is not None:
            age = (parsedate_to_datetime(date) - out["LastModified"]).total_seconds()
        return out["Body"], out["ETag"], age

    def delete_if(self, key: str, etag: str) -> bool:
        """Deletes ``key`` only if it is still version ``etag``."""
        try:
            self._call("DELETE (conditional)", key, "delete_object", IfMatch=etag)
            return True
        except (_PreconditionFailed, FileNotFoundError):
            return False


def _file_system(storage_options: dict[str, Any] | None, retry: RetryPolicy):
    try:
        import s3fs
    except ImportError:
        raise RunStoreError(
            "a run at an s3:// URL needs the optional package 's3fs'; install it with `pip install -e '.[s3]'` "
            "(from a checkout) or `pip install 'rlhf-pipeline[s3]'`") from None
    options = dict(storage_options or {})
    options.setdefault("use_listings_cache", False)
    config = dict(options.pop("config_kwargs", None) or {})
    # our loop owns the retries and their budget: botocore's and s3fs's own are off
    config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
    config.setdefault("connect_timeout", retry.connect_timeout_s)
    config.setdefault("read_timeout", retry.read_timeout_s)
    fs = s3fs.S3FileSystem(config_kwargs=config, skip_instance_cache=True, **options)
    fs.retries = 1  # a class attribute in s3fs, not a constructor argument
    return fs


def _short(exc: BaseException | None) -> str:
    if exc is None:
        return "none"
    response = _response(exc)
    code = response.get("Error", {}).get("Code")
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return f"{text} (HTTP {status}, {code})" if status or code else f"{type(exc).__name__}: {text}"


def _hint(exc: BaseException) -> str:
    if isinstance(exc, PermissionError) or _response(exc).get("Error", {}).get("Code") in ("AccessDenied",
                                                                                             "InvalidAccessKeyId"):
        return "Check the credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or a profile)"
    if _response(exc).get("Error", {}).get("Code") == "NoSuchBucket":
        return "The bucket does not exist on this endpoint: create it, or check AWS_ENDPOINT_URL"
    return "Check the URL, AWS_ENDPOINT_URL and the credentials"
