"""What every cloud's conditional objects answer (:class:`CloudObjects`), the errors they raise,
and the small helpers the implementations share (:class:`RetryPolicy`, :func:`through_outages`);
``cloud_objects.py`` picks an implementation (``cloud_s3.py``, ``cloud_azure.py``) for a URL.

Design: docs/scaling.md#which-clouds-s3-and-azure-blob-storage-not-yet-gcs.
"""

from __future__ import annotations

import asyncio
import importlib.util
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any, ClassVar, TypeVar

T = TypeVar("T")


class ConditionFailed(Exception):
    """The server refused a conditional write: the object exists, or is no longer the version named."""


class ContainerNotFoundError(FileNotFoundError):
    """The bucket (S3) or container (Azure) does not exist; the message names it and the fix."""


class CloudAccessError(PermissionError):
    """The server refused the credentials; the message says where credentials come from."""


@dataclass(frozen=True)
class ObjectVersion:
    body: bytes
    etag: str
    age_s: float | None  # seconds since its last write, on the server's clock (None: not told)


class CloudObjects(ABC):
    """The objects under one prefix of one cloud's object store; keys are relative to the prefix.

    Built on the fsspec file system that reads the same URL (s3fs, adlfs), so credentials and endpoint
    are configured once, the way that file system takes them. The coroutines run on the event loop the
    file system's client is used from: Zarr's loop for a store's file system (``asynchronous=True``), or
    :attr:`loop` for a synchronous one (``fsspec.asyn.sync(objects.loop, objects.read, key)``).
    """

    # what a cloud needs, for the messages of a caller that checks before opening anything
    name: ClassVar[str]  # "S3", "Azure Blob Storage"
    schemes: ClassVar[tuple[str, ...]]  # URL schemes, with "://"
    extra: ClassVar[str]  # the pip extra that installs its packages
    packages: ClassVar[tuple[tuple[str, str], ...]]  # (module, pip name) it imports
    credentials_hint: ClassVar[str]  # where credentials and endpoint come from
    server_side_copy: ClassVar[bool] = False  # copy_from between its own objects stays on the server

    def __init__(self, fs, path: str):
        self.fs = fs
        self.container, _, self.prefix = path.strip("/").partition("/")

    @classmethod
    @abstractmethod
    def fsspec_options(cls, options: Mapping[str, Any] | None) -> dict[str, Any]:
        """``storage_options`` for this cloud's fsspec file system, with our defaults added."""

    @classmethod
    def missing_packages(cls) -> list[str]:
        """pip names of this cloud's packages that are not installed."""
        return [pip for module, pip in cls.packages if module_missing(module)]

    @property
    def loop(self):
        """The event loop a synchronous file system runs its client on."""
        return self.fs.loop

    def key(self, key: str) -> str:
        """``key``'s full name in the bucket or container."""
        return f"{self.prefix}/{key}" if self.prefix else key

    @abstractmethod
    def access_error(self, exc: BaseException, key: str | None = None) -> CloudAccessError | None:
        """The :class:`CloudAccessError` to raise for ``exc`` when it says the credentials were
        refused (also for what the cloud's fsspec file system raised on a read); else None."""

    @abstractmethod
    async def create(self, key: str, body: bytes) -> str:
        """Writes ``key`` only if it does not exist (else :class:`ConditionFailed`); its etag."""

    @abstractmethod
    async def replace(self, key: str, body: bytes, etag: str) -> str:
        """Writes ``key`` only if it is still version ``etag`` (else :class:`ConditionFailed`,
        also when it is gone); the new etag."""

    @abstractmethod
    async def read(self, key: str) -> ObjectVersion | None:
        """``key``'s bytes, etag and age; None when it does not exist."""

    @abstractmethod
    async def delete(self, key: str, etag: str) -> None:
        """Deletes ``key`` only if it is still version ``etag`` (else :class:`ConditionFailed`,
        also when it is gone)."""

    # the unconditional operations beside them (run state: ``files/object_run_store.py``)
    @abstractmethod
    async def put(self, key: str, body: bytes) -> str:
        """Writes ``key`` whatever is there; its etag."""

    @abstractmethod
    async def etag(self, key: str) -> str | None:
        """``key``'s etag without its body (a HEAD); None when it does not exist."""

    async def remove(self, key: str) -> None:
        """Deletes ``key`` whatever version it is; a missing key is fine, a missing bucket or
        container is not (:class:`ContainerNotFoundError`): a run whose container is gone must say
        so, not carry on as if its objects had been deleted."""
        try:
            await self.unconditional_delete(key)
        except ContainerNotFoundError:  # a FileNotFoundError too: let it through before the next clause
            raise
        except FileNotFoundError:
            pass

    async def remove_many(self, keys: list[str]) -> None:
        """:meth:`remove` of each of ``keys``, sent together; a cloud with a batch delete overrides it
        (S3's DeleteObjects: one request for up to 1,000 keys)."""
        import asyncio

        await asyncio.gather(*(self.remove(key) for key in keys))

    @abstractmethod
    async def unconditional_delete(self, key: str) -> None:
        """The cloud's DELETE of ``key`` with no condition (what :meth:`remove` sends): raises
        ``FileNotFoundError`` when the object does not exist, :class:`ContainerNotFoundError`
        when its bucket or container does not."""

    async def copy_from(self, source: CloudObjects, source_key: str, key: str) -> str | None:
        """Copies ``source``'s object ``source_key`` to ``key`` here, whatever is there; its etag,
        or None when the source object does not exist. This one goes through the client (a GET,
        then a PUT: the bytes travel through this machine); a cloud with a server-side copy
        between its own objects overrides it (S3's CopyObject)."""
        found = await source.read(source_key)
        return None if found is None else await self.put(key, found.body)

    @abstractmethod
    async def list(self, prefix: str) -> list[str]:
        """Names of the objects and "directories" directly under ``prefix`` (relative to it)."""

    @abstractmethod
    async def list_etags(self, prefix: str) -> dict[str, str]:
        """The objects directly under ``prefix`` (no "directories"), each with its etag as
        :meth:`read` and :meth:`etag` give it: from the same listing requests as :meth:`list`."""

    @classmethod
    @abstractmethod
    def without_client_retries(cls, url: str, storage_options: Mapping[str, Any] | None, *,
                               connect_timeout_s: float, read_timeout_s: float) -> CloudObjects:
        """The objects under ``url`` on a client that tries each request once, within these
        timeouts: for a caller whose own loop owns the retries and their budget."""

    @abstractmethod
    def transient(self, exc: BaseException) -> bool:
        """Whether ``exc`` is worth another try: throttled, a server error, a timeout, a dropped
        connection (not a refusal, a missing object or refused credentials)."""

    @abstractmethod
    def unanswered(self, exc: BaseException) -> bool:
        """Whether ``exc`` says the request got no answer at all: the connection was refused, reset
        or timed out (the server down, restarting or out of reach). Such a fault lasts as long as
        the outage, whatever the number of tries: :class:`RetryPolicy` retries it for a time."""

    def _list_base(self, prefix: str) -> str:
        inner = prefix.strip("/")
        base = self.key(inner) if inner else self.prefix
        return f"{base}/" if base else ""


@dataclass(frozen=True)
class RetryPolicy:
    """How long one request may keep trying. A request the server answered with a fault
    (throttling, a server error) is tried at most ``attempts`` times: the server is up and keeps
    saying no. A request that got no answer (:meth:`CloudObjects.unanswered`: refused, reset, timed
    out) is tried again until ``budget_s`` has passed, however many tries that takes: an outage
    lasts a time, not a number of requests (a refused connection fails in a millisecond, so eight
    tries spent ~8 s of a 60 s budget and stopped runs over outages of 8 to 13 s). Either way no try
    starts (waits included) after ``budget_s`` seconds; the wait before try ``n`` is drawn uniformly
    from ``[0, min(max_delay_s, first_delay_s * 2**n))``. One try itself is bounded by the connect
    and read timeouts, so a request gives up within ``budget_s + read_timeout_s``."""

    attempts: int = 8
    first_delay_s: float = 0.1
    max_delay_s: float = 5.0
    budget_s: float = 60.0
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0

    def delay_s(self, attempt: int) -> float:
        return random.uniform(0.0, min(self.max_delay_s, self.first_delay_s * 2 ** min(attempt, 30)))

    def gives_up(self, answered_tries: int, spent_s: float, next_delay_s: float) -> bool:
        """Whether to give up: ``attempts`` answered faults, or no time left for another try."""
        return answered_tries >= self.attempts or spent_s + next_delay_s > self.budget_s

    def describe(self) -> str:
        return f"{self.attempts} tries while the store answers with faults, {self.budget_s:g} s in all"


class UnreachableError(ConnectionError):
    """Requests got no answer for a whole retry budget: the object store is down or out of reach."""


def through_outages(call: Callable[[], T], unanswered: Callable[[BaseException], bool], what: str,
                    policy: RetryPolicy = RetryPolicy()) -> T:
    """``call()``, tried again while it gets no answer (``unanswered``), for up to
    ``policy.budget_s``; then :class:`UnreachableError` naming ``what``, the time and the tries.
    Faults the server answers pass through at once: the caller (or its client) owns those."""
    started = time.monotonic()
    tries = 0
    while True:
        try:
            return call()
        except Exception as exc:
            if not unanswered(exc):
                raise
            tries += 1
            delay = policy.delay_s(tries)
            spent = time.monotonic() - started
            if spent + delay > policy.budget_s:
                raise UnreachableError(
                    f"{what} got no answer for {spent:.1f} s ({tries} tries; retry budget {policy.budget_s:g} s); "
                    f"last error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}. The object "
                    f"store is down or out of reach") from exc
        time.sleep(delay)


# HTTP statuses worth another try on either cloud (throttling, timeouts, server errors, and a
# conditional write racing another one)
TRANSIENT_STATUS = {408, 409, 429, 500, 502, 503, 504}


def module_missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):  # a missing parent package ("azure" for "azure.storage.blob")
        return True


def connection_lost(exc: BaseException) -> bool:
    """Whether ``exc`` is a connection refused, reset or timed out, as Python and aiohttp raise it:
    no answer came (an HTTP answer, even an error, is not one of these)."""
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError, ConnectionError)):
        return True
    try:
        import aiohttp
    except ImportError:  # pragma: no cover - both clouds' clients bring aiohttp
        return False
    return isinstance(exc, aiohttp.ClientConnectionError)


def connection_dropped(exc: BaseException) -> bool:
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError, ConnectionError)):
        return True
    try:
        import aiohttp
    except ImportError:  # pragma: no cover - both clouds' clients bring aiohttp
        return False
    return isinstance(exc, aiohttp.ClientError)


def server_age_s(date_header: str | None, last_modified) -> float | None:
    if not date_header or last_modified is None:
        return None
    return (parsedate_to_datetime(date_header) - last_modified).total_seconds()

