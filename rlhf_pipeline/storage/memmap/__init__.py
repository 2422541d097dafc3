"""The memory-mapped backend: ragged columnar segment files in a local directory.

Modules: :mod:`.store` (the store: create, open, its published state, close), :mod:`.appending`
(appending and publishing), :mod:`.eviction` (dropping the oldest sealed segments: capacity and
retention), :mod:`.reading` (mapping segments and gathering rows), :mod:`.segments`
(one segment's files: writing, mapping, copying), :mod:`.layout` (names, the published
state and damage, without torch), :mod:`.state_slots` (the published state, two
CRC-checked slots), :mod:`.checksums` (CRC32C of sealed segments), :mod:`.row_index` (the
reader's index of held rows for fused padded reads), :mod:`.inspection` (stats and checks
without torch), :mod:`.repair`. The store class is imported on first use: ``inspect`` and
``repair`` need no torch.
"""

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
