"""The Zarr v3 backend: the memmap contract on local directories, zip files and fsspec URLs.

Modules: :mod:`.store` (the store), :mod:`.layout` (keys, array metadata, codecs),
:mod:`.location` (where a store lives and raw key/value I/O), :mod:`.writer` (cutting
appends into units, background sealing), :mod:`.unit_cache` (decoded units and their
LRU), :mod:`.padded` (locating rows for fused padded reads), :mod:`.stats`.
"""

from rlhf_pipeline.storage.zarr.store import ZarrTrajectoryStore

__all__ = ["ZarrTrajectoryStore"]
