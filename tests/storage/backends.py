"""Every storage backend the shared suites run against, and how to build one for a test.

The contract suite, the state machine, the multiprocess and crash tests all take a
backend from ``BACKENDS``, so a new backend gets every one of them by adding one
entry: an object with ``name``, ``create(path, schema=None, *, segment_rows,
capacity_rows=None)`` and ``open(path, mode)``. ``create`` receives the common
options under these names and translates them into the backend's own.
Subprocess workers import this module too (``tests/storage`` is on their path).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage.base import TrajectoryStore


@dataclass(frozen=True)
class MemmapBackend:
    name: str = "memmap"
    durable: bool = True

    def create(
        self, path, schema: StoreSchema | None = None, *, segment_rows: int = 16, capacity_rows: int | None = None
    ) -> TrajectoryStore:
        from rlhf_pipeline.storage.memmap import MemmapTrajectoryStore

        # no grace before deleting evicted files, so tests see deletions at once
        return MemmapTrajectoryStore.create(
            path, schema, segment_rows=segment_rows, capacity_rows=capacity_rows,
            evict_grace_s=0.0, durable=self.durable,
        )

    def open(self, path, mode: str = "r") -> TrajectoryStore:
        from rlhf_pipeline.storage.memmap import MemmapTrajectoryStore

        return MemmapTrajectoryStore.open(path, mode, durable=self.durable)


@dataclass(frozen=True)
class ZarrBackend:
    name: str = "zarr"
    durable: bool = True

    def create(
        self, path, schema: StoreSchema | None = None, *, segment_rows: int = 16, capacity_rows: int | None = None
    ) -> TrajectoryStore:
        from rlhf_pipeline.storage.zarr.store import ZarrTrajectoryStore

        return ZarrTrajectoryStore.create(
            path, schema, segment_rows=segment_rows, capacity_rows=capacity_rows, durable=self.durable,
        )

    def open(self, path, mode: str = "r") -> TrajectoryStore:
        from rlhf_pipeline.storage.zarr.store import ZarrTrajectoryStore

        return ZarrTrajectoryStore.open(path, mode, durable=self.durable)


BACKENDS: dict[str, object] = {
    "memmap": MemmapBackend(),
    "zarr": ZarrBackend(),
}
