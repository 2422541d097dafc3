"""The Zarr store in the storage benchmark (``rlhf-pipeline bench storage --backends zarr``).

Defaults as a user gets them (blosc-zstd, 4096-row segments, durable publishes like
memmap's), so the numbers describe the store as shipped. ``finish_writes`` waits for
the background deletion of compacted fragments, so ``disk_bytes`` counts only what
the store keeps. Design: docs/benchmarks.md#storage-rlhf-pipeline-bench-storage.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rlhf_pipeline.bench.storage_bench import TrajectoryStoreBackend

if TYPE_CHECKING:
    from rlhf_pipeline.schema import StoreSchema
    from rlhf_pipeline.storage.base import TrajectoryStore


class _ZarrStoreBackend(TrajectoryStoreBackend):
    def finish_writes(self) -> None:
        self._store.flush()


def ZarrBackend() -> TrajectoryStoreBackend:
    def create(path: Path, schema: StoreSchema) -> TrajectoryStore:
        from rlhf_pipeline.storage.zarr.store import ZarrTrajectoryStore

        return ZarrTrajectoryStore.create(str(path), schema)

    return _ZarrStoreBackend("zarr", create)


class RemoteZarrBackend(_ZarrStoreBackend):
    """The Zarr store at an object-store URL (``bench storage --location s3://...``), under a fresh
    prefix per run that is deleted afterwards. Appends go through the writer; batches are sampled
    by a second, read-only store asked to refresh before every batch, as a learner in another
    process does, from its decoded-unit cache. ``refresh_interval_s=0`` (``zarr-s3``) re-reads
    the commit record every time (one GET per batch); ``zarr-s3-throttled`` keeps the reader's
    default for object stores (at most one GET per second)."""

    def __init__(self, name: str = "zarr-s3", refresh_interval_s: float | None = 0.0):
        super().__init__(name, self._create_remote)
        self._refresh_interval_s = refresh_interval_s

    def setup(self, directory: Path, spec) -> None:
        import uuid

        if not spec.location:
            raise ValueError("the zarr-s3 backend writes to --location (an s3:// URL); pass one")
        self._url = f"{spec.location.rstrip('/')}/bench-{uuid.uuid4().hex[:12]}"
        self._options = dict(spec.storage_options)
        self._reader = None
        super().setup(directory, spec)

    def _create_remote(self, path: Path, schema: StoreSchema) -> TrajectoryStore:
        from rlhf_pipeline.storage.zarr.store import ZarrTrajectoryStore

        return ZarrTrajectoryStore.create(self._url, schema, storage_options=self._options)

    def sample_padded(self, positions):
        if self._reader is None:
            from rlhf_pipeline.storage.zarr.store import ZarrTrajectoryStore

            self._reader = ZarrTrajectoryStore.open(self._url, storage_options=self._options,
                                                    refresh_interval_s=self._refresh_interval_s)
        len(self._reader)  # a read-only store refreshes here (or not, within its interval)
        return self._collator.read(self._reader, positions)

    def disk_bytes(self) -> int:
        from rlhf_pipeline.storage.zarr.inspection import stats

        return stats(self._url, storage_options=self._options).bytes_on_disk  # the objects' sizes

    def close(self) -> None:
        import fsspec

        from rlhf_pipeline.storage.zarr.object_store import object_store_options

        try:
            if self._reader is not None:
                self._reader.close()
            super().close()
        finally:
            fs, path = fsspec.core.url_to_fs(self._url, **object_store_options(self._options, location=self._url))
            fs.rm(path, recursive=True)


def ThrottledRemoteZarrBackend() -> RemoteZarrBackend:
    """``zarr-s3`` with the reader's default refresh interval on an object store (1 s)."""
    return RemoteZarrBackend("zarr-s3-throttled", refresh_interval_s=None)
