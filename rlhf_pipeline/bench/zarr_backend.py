"""The Zarr store in the storage benchmark (``rlhf-pipeline bench storage --backends zarr``).

Defaults as a user gets them (blosc-zstd, 4096-row segments, durable publishes like
memmap's), so the numbers describe the store as shipped. ``finish_writes`` waits for
the background deletion of compacted fragments, so ``disk_bytes`` counts only what
the store keeps.
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
