"""The memory-mapped backend: ragged columnar segment files in a local directory.

:mod:`.store` is the store (create, open, its published state, close), with its writer side in
:mod:`.appending`, its drops in :mod:`.eviction` and its reads in :mod:`.reading`; the design note lists
the other modules. The store class is imported on first use: ``inspect`` and ``repair`` need no torch.
Design: docs/storage.md#inside-the-memmap-store."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlhf_pipeline.storage.memmap.store import MemmapTrajectoryStore


def __getattr__(name: str):
    if name == "MemmapTrajectoryStore":
        from rlhf_pipeline.storage.memmap.store import MemmapTrajectoryStore

        return MemmapTrajectoryStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["MemmapTrajectoryStore"]
