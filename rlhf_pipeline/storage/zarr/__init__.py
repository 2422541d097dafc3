"""The Zarr v3 backend: the memmap contract on local directories, zip files and fsspec URLs.

Modules: :mod:`.store` (the store: create, open, follow the commit record, close),
:mod:`.appending` (its writer side: append, publish, seal, evict, drop), :mod:`.reading` (its
reads from decoded units), :mod:`.layout` (keys, array metadata, codecs, packing),
:mod:`.units` (the kinds of unit, writing and checked reading), :mod:`.location` (where a
store lives and raw key/value I/O), :mod:`.writer` (cutting appends into units, background
sealing), :mod:`.unit_cache` (decoded units and their LRU), :mod:`.unit_constants` (fields with
one value per unit, kept in the commit record and read without the unit), :mod:`.padded` (locating rows for
fused padded reads), :mod:`.inspection` (stats and checks without torch), :mod:`.repair`,
:mod:`.from_record` (a reader opened from another reader's commit record: no request),
:mod:`.snapshot` (a byte-for-byte copy of the published units into a new store).
The store class is imported on first use: ``inspect`` and ``repair`` need no torch.
"""

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
