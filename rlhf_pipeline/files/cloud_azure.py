"""Azure Blob Storage (and Azurite) behind :class:`~rlhf_pipeline.files.cloud_base.CloudObjects`:
conditional uploads through azure-storage-blob's asyncio client.

Design: docs/scaling.md#which-clouds-s3-and-azure-blob-storage-not-yet-gcs.
"""

from __future__ import annotations

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


class AzureObjects(CloudObjects):
    """Azure Blob Storage (and Azurite) through azure-storage-blob's asyncio client: the one adlfs
    made for the same URL, so both use the same account, endpoint and credentials."""

    name = "Azure Blob Storage"
    schemes = ("az://", "abfs://", "abfss://")
    extra = "azure"
    packages = (("adlfs", "adlfs"), ("azure.storage.blob", "azure-storage-blob"))
    credentials_hint = ("set AZURE_STORAGE_CONNECTION_STRING (or AZURE_STORAGE_ACCOUNT_NAME with "
                        "AZURE_STORAGE_ACCOUNT_KEY), or pass storage_options connection_string= or "
                        "account_name= with account_key=/sas_token=/credential=")

    def __init__(self, fs, path: str, *, client_retries: bool = True):
        super().__init__(fs, path)
        self._container_client = fs.service_client.get_container_client(self.container)
        # azure-core's retry policy reads ``retry_total`` from each call's keyword arguments
        self._per_call: dict[str, Any] = {} if client_retries else {"retry_total": 0}
        if fs.asynchronous:
            _drop_broken_exit_hooks(fs)

    @classmethod
    def fsspec_options(cls, options: Mapping[str, Any] | None) -> dict[str, Any]:
        merged = dict(options or {})
        merged.setdefault("use_listings_cache", False)  # as on S3: leftovers must show in listings
        return merged

    def _blob(self, key: str):
        return self._container_client.get_blob_client(self.key(key))

    async def _call(self, key: str, operation, *, gone_is_refusal: bool):
        from azure.core.exceptions import (
            HttpResponseError,
            ResourceExistsError,
            ResourceModifiedError,
            ResourceNotFoundError,
        )

        try:
            return await operation(self._blob(key), **self._per_call)
        except ResourceModifiedError:  # 412: an If-Match (or If-None-Match) condition not met
            raise ConditionFailed(key) from None
        except ResourceExistsError as exc:  # 409: only "BlobAlreadyExists" is a refused create
            if _azure_code(exc) == "BlobAlreadyExists":
                raise ConditionFailed(key) from None
            raise
        except ResourceNotFoundError as exc:
            if _azure_code(exc) == "ContainerNotFound":
                raise ContainerNotFoundError(
                    f"the container {self.container!r} does not exist in storage account "
                    f"{self._container_client.account_name!r}; create it first (`az storage container create "
                    f"--name {self.container}`), or check the account and endpoint ({self.credentials_hint})"
                ) from None
            if gone_is_refusal:
                raise ConditionFailed(key) from None
            raise FileNotFoundError(f"{self.container}/{self.key(key)}") from None
        except HttpResponseError as exc:
            denied = self.access_error(exc, key)
            if denied is not None:
                raise denied from None
            raise

    def access_error(self, exc: BaseException, key: str | None = None) -> CloudAccessError | None:
        from azure.core.exceptions import ClientAuthenticationError, HttpResponseError

        refused = isinstance(exc, ClientAuthenticationError) or (
            isinstance(exc, HttpResponseError) and exc.status_code in (401, 403))
        if not refused:
            return None
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        what = f"blob {self.key(key)!r}" if key is not None else f"prefix {self.prefix!r}"
        return CloudAccessError(f"access to {what} in container {self.container!r} was denied ({reason}); "
                                f"{self.credentials_hint}")

    async def create(self, key: str, body: bytes) -> str:
        async def upload(blob, **per_call):
            return (await blob.upload_blob(body, overwrite=False, **per_call))["etag"]

        return await self._call(key, upload, gone_is_refusal=False)

    async def replace(self, key: str, body: bytes, etag: str) -> str:
        from azure.core import MatchConditions

        async def upload(blob, **per_call):
            return (await blob.upload_blob(body, overwrite=True, etag=etag,
                                           match_condition=MatchConditions.IfNotModified, **per_call))["etag"]

        return await self._call(key, upload, gone_is_refusal=True)

    async def read(self, key: str) -> ObjectVersion | None:
        headers: dict[str, str | None] = {}

        def keep_date(response) -> None:  # the server's clock, for the age
            headers["date"] = response.http_response.headers.get("Date")

        async def download(blob, **per_call):
            stream = await blob.download_blob(raw_response_hook=keep_date, **per_call)
            return stream, await stream.readall()

        try:
            stream, body = await self._call(key, download, gone_is_refusal=False)
        except ContainerNotFoundError:
            raise
        except FileNotFoundError:
            return None
        return ObjectVersion(body, stream.properties.etag, server_age_s(headers.get("date"), stream.properties.last_modified))

    async def delete(self, key: str, etag: str) -> None:
        from azure.core import MatchConditions

        async def delete(blob, **per_call):
            await blob.delete_blob(etag=etag, match_condition=MatchConditions.IfNotModified, **per_call)

        await self._call(key, delete, gone_is_refusal=True)

    async def put(self, key: str, body: bytes) -> str:
        async def upload(blob, **per_call):
            return (await blob.upload_blob(body, overwrite=True, **per_call))["etag"]

        return await self._call(key, upload, gone_is_refusal=False)

    async def etag(self, key: str) -> str | None:
        async def properties(blob, **per_call):
            return (await blob.get_blob_properties(**per_call)).etag

        try:
            return await self._call(key, properties, gone_is_refusal=False)
        except ContainerNotFoundError:
            raise
        except FileNotFoundError:
            return None

    async def unconditional_delete(self, key: str) -> None:
        async def delete(blob, **per_call):
            await blob.delete_blob(**per_call)

        await self._call(key, delete, gone_is_refusal=False)

    async def list(self, prefix: str) -> list[str]:
        base = self._list_base(prefix)
        # walk_blobs with a delimiter names the "directories" (BlobPrefix, ending in "/") too
        return [item.name[len(base):].rstrip("/") for item in await self._walk(base)]

    async def list_etags(self, prefix: str) -> dict[str, str]:
        from azure.storage.blob import BlobProperties

        base = self._list_base(prefix)
        # a listing's etag is bare (0x8D...), a response header's quoted ("0x8D..."): read()'s form
        return {item.name[len(base):]: _quoted(item.etag) for item in await self._walk(base)
                if isinstance(item, BlobProperties)}

    async def _walk(self, base: str) -> list:
        from azure.core.exceptions import HttpResponseError, ResourceNotFoundError

        try:
            return [item async for item in
                    self._container_client.walk_blobs(name_starts_with=base, delimiter="/", **self._per_call)]
        except ResourceNotFoundError:
            raise ContainerNotFoundError(f"the container {self.container!r} does not exist; create it first "
                                         f"({self.credentials_hint})") from None
        except HttpResponseError as exc:
            denied = self.access_error(exc)
            if denied is not None:
                raise denied from None
            raise

    @classmethod
    def without_client_retries(cls, url: str, storage_options: Mapping[str, Any] | None, *,
                               connect_timeout_s: float, read_timeout_s: float) -> AzureObjects:
        import fsspec

        options = cls.fsspec_options(storage_options)
        options.setdefault("connection_timeout", int(connect_timeout_s))
        options.setdefault("read_timeout", int(read_timeout_s))
        fs, path = fsspec.core.url_to_fs(url, skip_instance_cache=True, **options)
        return cls(fs, path, client_retries=False)

    def transient(self, exc: BaseException) -> bool:
        from azure.core.exceptions import (
            HttpResponseError,
            ServiceRequestError,
            ServiceResponseError,
        )

        if isinstance(exc, (ServiceRequestError, ServiceResponseError)):  # no answer, or a broken one
            return True
        if isinstance(exc, HttpResponseError):
            return exc.status_code in TRANSIENT_STATUS and _azure_code(exc) != "BlobAlreadyExists"
        return connection_dropped(exc)

    def unanswered(self, exc: BaseException) -> bool:
        from azure.core.exceptions import ServiceRequestError, ServiceResponseError

        # ServiceRequestError: the request never went out (refused, connect timeout);
        # ServiceResponseError: the connection broke before a whole answer came (reset, read timeout)
        return isinstance(exc, (ServiceRequestError, ServiceResponseError)) or connection_lost(exc)


def _drop_broken_exit_hooks(fs) -> None:
    """adlfs closes its clients at exit with ``sync(fs.loop, ...)``, but an asynchronous file system
    (Zarr's) has no loop of its own (``None``), so every process using one printed a RuntimeError
    traceback at exit. Its clients run on Zarr's loop, which stops at exit anyway."""
    import weakref

    # the only way to reach a finalizer adlfs did not keep; a Python without it prints the traceback again
    for hook in list(getattr(weakref.finalize, "_registry", {})):
        found = hook.peek()
        if found is not None and found[0] is fs and found[2][:1] == (None,):
            hook.detach()


def _quoted(etag: str) -> str:
    return etag if etag.startswith('"') else f'"{etag}"'


def _azure_code(exc: Exception) -> str | None:
    code = getattr(exc, "error_code", None)
    return getattr(code, "value", code)


