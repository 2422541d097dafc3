"""S3 (and S3-compatible servers) behind :class:`~rlhf_pipeline.files.cloud_base.CloudObjects`:
conditional PUTs through s3fs's botocore client.

Design: docs/scaling.md#which-clouds-s3-and-azure-blob-storage-not-yet-gcs.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping
from typing import Any

from rlhf_pipeline.files.cloud_base import (
    TRANSIENT_STATUS,
    CloudAccessError,
    CloudObjects,
    ConditionFailed,
    ContainerNotFoundError,
    ObjectVersion,
    connection_dropped,
    connection_lost,
    server_age_s,
)

_CONFLICT_RETRIES = 5  # a 409 "conditional request conflict": another conditional PUT of that key is in flight


class S3Objects(CloudObjects):
    """S3 and S3-compatible servers (MinIO, R2, moto) through s3fs's botocore client."""

    name = "S3"
    schemes = ("s3://", "s3a://")
    extra = "s3"
    packages = (("s3fs", "s3fs"),)
    credentials_hint = ("pass credentials as storage_options key=/secret= or set AWS_ACCESS_KEY_ID and "
                        "AWS_SECRET_ACCESS_KEY")
    server_side_copy = True  # CopyObject

    @classmethod
    def fsspec_options(cls, options: Mapping[str, Any] | None) -> dict[str, Any]:
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

    async def _call(self, method: str, key: str, **kwargs) -> dict:
        return await self._request(method, key, Key=self.key(key), **kwargs)

    async def _request(self, method: str, key: str, **kwargs) -> dict:
        """s3fs's client call (public s3fs has no conditional PUT: If-None-Match / If-Match), its
        errors as ours; ``key`` names what it is about in them."""
        for attempt in range(_CONFLICT_RETRIES):
            try:
                return await self.fs._call_s3(method, Bucket=self.container, **kwargs)
            except FileNotFoundError as exc:
                if "bucket" in str(exc).lower():
                    raise ContainerNotFoundError(
                        f"the bucket {self.container!r} does not exist on this endpoint; create it first, or "
                        f"check endpoint_url (storage_options or AWS_ENDPOINT_URL)") from None
                raise
            except Exception as exc:  # s3fs maps the codes we need to generic OSErrors
                denied = self.access_error(exc)
                if denied is not None:
                    raise denied from None
                status = _s3_status(exc)
                if status == 412:
                    raise ConditionFailed(key) from None
                if status != 409 or attempt == _CONFLICT_RETRIES - 1:
                    raise
            await asyncio.sleep(0.05 * 2**attempt)
        raise AssertionError("unreachable")

    def access_error(self, exc: BaseException, key: str | None = None) -> CloudAccessError | None:
        if isinstance(exc, PermissionError):
            return CloudAccessError(f"access denied ({exc}); {self.credentials_hint}")
        return None

    async def create(self, key: str, body: bytes) -> str:
        return (await self._call("put_object", key, Body=body, IfNoneMatch="*"))["ETag"]

    async def replace(self, key: str, body: bytes, etag: str) -> str:
        try:
            return (await self._call("put_object", key, Body=body, IfMatch=etag))["ETag"]
        except ContainerNotFoundError:
            raise
        except FileNotFoundError:  # S3 answers 404, not 412, when the object is gone
            raise ConditionFailed(key) from None

    async def read(self, key: str) -> ObjectVersion | None:
        try:
            out = await self._call("get_object", key)
        except ContainerNotFoundError:
            raise
        except FileNotFoundError:
            return None
        async with out["Body"] as stream:
            body = await stream.read()
        date = out.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        return ObjectVersion(body, out["ETag"], server_age_s(date, out.get("LastModified")))

    async def delete(self, key: str, etag: str) -> None:
        try:
            await self._call("delete_object", key, IfMatch=etag)
        except ContainerNotFoundError:
            raise
        except FileNotFoundError:
            raise ConditionFailed(key) from None


    async def put(self, key: str, body: bytes) -> str:
        return (await self._call("put_object", key, Body=body))["ETag"]

    async def copy_from(self, source: CloudObjects, source_key: str, key: str) -> str | None:
        """Server-side: CopyObject (the bytes never leave S3), across buckets of one endpoint too;
        an object over CopyObject's 5 GiB limit is copied in parts (s3fs's UploadPartCopy), still
        server-side. Another cloud's object goes through the client (the base class)."""
        if not isinstance(source, S3Objects):
            return await super().copy_from(source, source_key, key)
        copied_from = {"Bucket": source.container, "Key": source.key(source_key)}
        try:
            return (await self._call("copy_object", key, CopySource=copied_from))["CopyObjectResult"]["ETag"]
        except ContainerNotFoundError:
            raise
        except FileNotFoundError:
            return None
        except Exception as exc:
            if _s3_status(exc) == 404:
                return None
            if "EntityTooLarge" not in str(s3_error_response(exc)) + str(exc):
                raise
        await self.fs._cp_file(f"{source.container}/{source.key(source_key)}", f"{self.container}/{self.key(key)}")
        return await self.etag(key)

    async def etag(self, key: str) -> str | None:
        try:
            return (await self._call("head_object", key))["ETag"]
        except ContainerNotFoundError:
            raise
        except FileNotFoundError:
            return None
        except Exception as exc:
            if _s3_status(exc) == 404:  # a HEAD's 404 has no body for s3fs to translate
                return None
            raise

    async def unconditional_delete(self, key: str) -> None:
        await self._call("delete_object", key)

    async def remove_many(self, keys: list[str]) -> None:
        """One DeleteObjects request per 1,000 keys (a missing key counts as deleted there too)."""
        for start in range(0, len(keys), 1000):
            batch = keys[start:start + 1000]
            out = await self._request("delete_objects", batch[0], Delete={
                "Objects": [{"Key": self.key(key)} for key in batch], "Quiet": True})
            if out.get("Errors"):  # answered per key: the request succeeded, some deletes did not
                first = out["Errors"][0]
                raise OSError(f"S3 did not delete {len(out['Errors'])} of {len(batch)} objects; "
                              f"{first.get('Key')}: {first.get('Code')} {first.get('Message')}")

    async def list(self, prefix: str) -> list[str]:
        names: list[str] = []
        async for contents, prefixes in self._pages(prefix):
            names += list(contents)
            # "directories" too, as a directory listing names them (a metrics log's parts)
            names += prefixes
        return names

    async def list_etags(self, prefix: str) -> dict[str, str]:
        etags: dict[str, str] = {}
        async for contents, _ in self._pages(prefix):
            etags.update(contents)
        return etags

    async def _pages(self, prefix: str):
        """Each page of the listing: ``({object name: etag}, [directory names])``."""
        base = self._list_base(prefix)
        page: dict[str, Any] = {"Prefix": base, "Delimiter": "/"}
        while True:
            out = await self.fs._call_s3("list_objects_v2", Bucket=self.container, **page)
            yield ({item["Key"][len(base):]: item["ETag"] for item in out.get("Contents", [])},
                   [item["Prefix"][len(base):].rstrip("/") for item in out.get("CommonPrefixes", [])])
            if not out.get("IsTruncated"):
                return
            page["ContinuationToken"] = out["NextContinuationToken"]

    @classmethod
    def without_client_retries(cls, url: str, storage_options: Mapping[str, Any] | None, *,
                               connect_timeout_s: float, read_timeout_s: float) -> S3Objects:
        import fsspec

        options = cls.fsspec_options(storage_options)
        config = dict(options.pop("config_kwargs", None) or {})
        config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
        config.setdefault("connect_timeout", connect_timeout_s)
        config.setdefault("read_timeout", read_timeout_s)
        fs, path = fsspec.core.url_to_fs(url, config_kwargs=config, skip_instance_cache=True, **options)
        fs.retries = 1  # s3fs's own retry loop: a class attribute, not a constructor argument
        return cls(fs, path)

    def transient(self, exc: BaseException) -> bool:
        response = s3_error_response(exc)
        code = response.get("Error", {}).get("Code")
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in _S3_TRANSIENT_CODES or status in TRANSIENT_STATUS:
            return True
        if response:
            return False
        try:
            from botocore import exceptions
        except ImportError:  # pragma: no cover - s3fs brings botocore
            return connection_dropped(exc)
        # a body that fails the checksum its PUT stored was damaged on its way: read it again (a
        # botocore before 1.36 checks none)
        damaged = getattr(exceptions, "FlexibleChecksumError", ())
        return (isinstance(exc, (exceptions.HTTPClientError, exceptions.ConnectionError, damaged))
                or connection_dropped(exc))

    def unanswered(self, exc: BaseException) -> bool:
        try:
            from botocore import exceptions
        except ImportError:  # pragma: no cover - s3fs brings botocore
            return connection_lost(exc)
        # botocore's ConnectionError: refused, connect timeout, DNS; HTTPClientError: reset, closed,
        # read timeout. A body that fails its checksum (FlexibleChecksumError) came: not these
        return isinstance(exc, (exceptions.ConnectionError, exceptions.HTTPClientError)) or connection_lost(exc)


_S3_TRANSIENT_CODES = {"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling",
                       "ThrottlingException", "ConditionalRequestConflict"}


def s3_error_response(exc: BaseException) -> dict:
    """botocore's parsed response behind ``exc`` (s3fs raises its own OSError from botocore's)."""
    seen = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        response = getattr(current, "response", None)
        if isinstance(response, dict):
            return response
        current = current.__cause__ or current.__context__
    return {}


@functools.cache  # one signature inspection per process, not one per store opened
def _s3fs_takes(option: str) -> bool:
    import inspect

    try:
        from s3fs import S3FileSystem
    except ImportError:  # the caller's missing_packages() check says so where it matters
        return False
    return option in inspect.signature(S3FileSystem.__init__).parameters


def _s3_status(exc: BaseException) -> int | None:
    response = {}
    for candidate in (exc, exc.__cause__, exc.__context__):
        if isinstance(getattr(candidate, "response", None), dict):
            response = candidate.response
            break
    code = response.get("Error", {}).get("Code")
    if code == "PreconditionFailed":
        return 412
    if code == "ConditionalRequestConflict":
        return 409
    return response.get("ResponseMetadata", {}).get("HTTPStatusCode")

