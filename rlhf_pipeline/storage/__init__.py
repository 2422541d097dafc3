"""Durable ragged replay-buffer storage: one contract (``TrajectoryStore``), the memmap and Zarr backends.

``create_store(location, backend=...)`` makes a new store; ``open_store(location)`` reopens one of any
backend (it asks each registered backend whether the location is one of its stores); ``open_buffer``
opens whatever the commands take as a buffer: a store, the read-only union of a run's ``shard-NNNN``
stores, a saved selection, or a branch's buffer continuing its parent's. Importing this package imports
no torch: the store classes (and torch with them) load on first use, so ``inspect`` and ``repair`` start
at once. The contract, and how to add a backend: docs/storage.md#design-notes.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from rlhf_pipeline.storage.errors import (
    IncompatibleStoreError,
    NotAStoreError,
    ReadOnlyStoreError,
    StoreClosedError,
    StoreCorruptedError,
    StoreDamageWarning,
    StoreError,
    StoreLockedError,
    StoreNotFoundError,
)
from rlhf_pipeline.storage.summary import StoreStats

from rlhf_pipeline.storage.backends import (
    BACKENDS,
    INSPECTION,
    REPAIR,
    backend_class,
    buffer_inside,
    create_store,
    detect_backend,
    inspection,
    open_store,
    repairer,
)

if TYPE_CHECKING:
    from rlhf_pipeline.storage.base import TrajectoryStore
    from rlhf_pipeline.storage.memmap import MemmapTrajectoryStore


def open_buffer(location, mode: str = "r", **options) -> TrajectoryStore:
    """Opens a run's buffer directory, whatever its layout.

    A single store (one collector; runs made before shards) opens as with :func:`open_store`;
    a directory or URL prefix of ``shard-NNNN`` stores (one per collector) opens as a read-only
    :class:`~rlhf_pipeline.storage.sharded.ShardedStoreReader` over all of them, which also
    picks up shards created later. Appending goes to one shard: ``open_store(shard, mode="a")``.
    A saved selection (``rlhf-pipeline filter ... --selection``) opens as a read-only
    :class:`~rlhf_pipeline.storage.selection.SelectionStore` over the rows it names. A branch's
    buffer that continues its parent's (``continues.json``) opens as a read-only
    :class:`~rlhf_pipeline.storage.continued.ContinuedBufferReader`.
    """
    from rlhf_pipeline.storage.buffers import is_sharded_buffer, is_url, list_shards
    from rlhf_pipeline.storage.selection import SelectionStore, is_selection

    from rlhf_pipeline.storage.continues import continued_rows

    location = str(location)
    continues = continued_rows(location, options.get("storage_options"))  # a branch's, continuing its parent's
    if continues is not None:
        from rlhf_pipeline.storage.continued import open_continued

        return open_continued(location, continues, mode=mode, **options)
    listed = None
    if is_url(location):  # one LIST, handed to the reader of the shards (which would list again)
        try:
            listed = list_shards(location, options.get("storage_options"))
        except OSError:  # as is_sharded_buffer: then it is no sharded buffer, and opening the store says why
            listed = []
    if not listed and is_selection(location):  # at a URL, one HEAD more only where no shards were listed
        return SelectionStore.open(location, mode=mode, **options)
    if listed or (listed is None and is_sharded_buffer(location)):
        if mode != "r":
            raise ReadOnlyStoreError(
                f"{location} holds one store per collector (shard-NNNN); the union is read-only. "
                f"Open one shard with open_store(<shard dir>, mode={mode!r}) to append"
            )
        from rlhf_pipeline.storage.sharded import ShardedStoreReader

        return ShardedStoreReader(location, shards=listed, **options)
    if listed == [] and mode == "r":  # a URL holding no shards: one store, or a saved selection kept there
        from rlhf_pipeline.storage.errors import NotAStoreError

        try:
            return open_store(location, mode=mode, **options)
        except NotAStoreError:  # asked only when no store is there: no request more for a store's opening
            from rlhf_pipeline.storage.selection import fetch_selection

            if fetch_selection(location, options.get("storage_options")) is None:
                raise
            return SelectionStore.open(location, mode=mode, **options)
    return open_store(location, mode=mode, **options)


def __getattr__(name: str):
    # lazy re-exports of the backend classes and torchrl glue (they import torch)
    lazy = {
        "MemmapTrajectoryStore": "rlhf_pipeline.storage.memmap",
        "AppendWriter": "rlhf_pipeline.storage.torchrl_glue",
        "make_replay_buffer": "rlhf_pipeline.storage.torchrl_glue",
        "ShardedStoreReader": "rlhf_pipeline.storage.sharded",
        "SelectionStore": "rlhf_pipeline.storage.selection",
        "TrajectoryStore": "rlhf_pipeline.storage.base",
    }
    if name in lazy:
        return getattr(importlib.import_module(lazy[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BACKENDS",
    "INSPECTION",
    "REPAIR",
    "AppendWriter",
    "IncompatibleStoreError",
    "MemmapTrajectoryStore",
    "NotAStoreError",
    "ReadOnlyStoreError",
    "SelectionStore",
    "ShardedStoreReader",
    "StoreClosedError",
    "StoreCorruptedError",
    "StoreDamageWarning",
    "StoreError",
    "StoreLockedError",
    "StoreNotFoundError",
    "StoreStats",
    "TrajectoryStore",
    "backend_class",
    "buffer_inside",
    "create_store",
    "detect_backend",
    "inspection",
    "make_replay_buffer",
    "open_buffer",
    "open_store",
    "repairer",
]
