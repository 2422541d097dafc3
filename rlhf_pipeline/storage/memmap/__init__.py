"""The memory-mapped backend: ragged columnar segment files in a local directory.

Modules: :mod:`.store` (the store: create, open, append, read, evict), :mod:`.segments`
(one segment's files: writing, mapping, copying), :mod:`.state_slots` (the published
state, two CRC-checked slots), :mod:`.row_index` (the reader's index of held rows for
fused padded reads).
"""

from rlhf_pipeline.storage.memmap.store import MemmapTrajectoryStore

__all__ = ["MemmapTrajectoryStore"]
