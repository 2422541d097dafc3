"""The Zarr v3 backend: the memmap contract on local directories, zip files and fsspec URLs.

:mod:`.store` is the store (create, open, follow the commit record, close), with its writer side in
:mod:`.appending` and its reads in :mod:`.reading`; the design note lists the other modules.
The store class is imported on first use: ``inspect`` and ``repair`` need no torch.
Design: docs/zarr-layout.md#inside-the-zarr-store."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlhf_pipeline.storage.zarr.store import ZarrTrajectoryStore


def __getattr__(name: str):
    if name == "ZarrTrajectoryStore":
        from rlhf_pipeline.storage.zarr.store import ZarrTrajectoryStore

        return ZarrTrajectoryStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ZarrTrajectoryStore"]
