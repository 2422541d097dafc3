"""Durable ragged replay-buffer storage: one contract, several backends.

``create_store(location, backend=...)`` makes a new store, ``open_store(location)``
reopens one of any backend (it asks each registered backend whether the location
is one of its stores). ``open_buffer(location)`` opens a run's buffer directory: a single
store, or the read-only union of its ``shard-NNNN`` stores (one per collector). Backends are imported lazily, so opening a memmap store
never imports zarr.

To add a backend: implement :class:`~rlhf_pipeline.storage.base.TrajectoryStore`
with the classmethods ``create(location, schema, **options)``,
``open(location, mode)`` and ``detect(location) -> bool`` (a cheap check that
raises nothing), then add one line to ``BACKENDS``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage.base import (
    NotAStoreError,
    ReadOnlyStoreError,
    StoreCorruptedError,
    StoreError,
    StoreLockedError,
    StoreStats,
    TrajectoryStore,
)

if TYPE_CHECKING:
    from rlhf_pipeline.storage.memmap import MemmapTrajectoryStore

# backend name -> "module:Class"; tried in this order by open_store
BACKENDS: dict[str, str] = {
    "memmap": "rlhf_pipeline.storage.memmap:MemmapTrajectoryStore",
    "zarr": "rlhf_pipeline.storage.zarr:ZarrTrajectoryStore",
}


def backend_class(name: str) -> type[TrajectoryStore]:
    """The store class registered under ``name`` (imported on first use)."""
    try:
        target = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown storage backend {name!r}; choose from {sorted(BACKENDS)}") from None
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def detect_backend(location: str) -> str:
    """Name of the backend whose store lives at ``location``; ``NotAStoreError`` if none."""
    for name in BACKENDS:
        if backend_class(name).detect(str(location)):
            return name
    raise NotAStoreError(
        f"{location} is not a replay buffer: no backend ({', '.join(BACKENDS)}) recognizes it. "
        f"Check the path, or create one with create_store()."
    )


def open_store(location, mode: str = "r", *, backend: str | None = None, **options) -> TrajectoryStore:
    """Opens an existing store; ``mode="r"`` reads (no lock), ``mode="a"`` appends (writer lock)."""
    name = backend or detect_backend(str(location))
    return backend_class(name).open(str(location), mode=mode, **options)


def open_buffer(location, mode: str = "r", **options) -> TrajectoryStore:
    """Opens a run's buffer directory, whatever its layout.

    A single store (one collector; runs made before shards) opens as with :func:`open_store`;
    a directory of ``shard-NNNN`` stores (one per collector) opens as a read-only
    :class:`~rlhf_pipeline.storage.sharded.ShardedStoreReader` over all of them, which also
    picks up shards created later. Appending goes to one shard: ``open_store(shard, mode="a")``.
    A saved selection (``rlhf-pipeline filter ... --selection``) opens as a read-only
    :class:`~rlhf_pipeline.storage.selection.SelectionStore` over the rows it names.
    """
    from rlhf_pipeline.storage.selection import SelectionStore, is_selection
    from rlhf_pipeline.storage.sharded import ShardedStoreReader, is_sharded_buffer

    location = str(location)
    if is_selection(location):
        return SelectionStore.open(location, mode=mode, **options)
    if is_sharded_buffer(location):
        if mode != "r":
            raise ReadOnlyStoreError(
                f"{location} holds one store per collector (shard-NNNN); the union is read-only. "
                f"Open one shard with open_store(<shard dir>, mode={mode!r}) to append"
            )
        return ShardedStoreReader(location, **options)
    return open_store(location, mode=mode, **options)


def create_store(location, backend: str = "memmap", schema: StoreSchema | None = None, **options) -> TrajectoryStore:
    """Creates a new, empty store opened for appending (``options`` are the backend's)."""
    return backend_class(backend).create(str(location), schema or StoreSchema(), **options)


def __getattr__(name: str):
    # lazy re-exports of the backend classes and torchrl glue
    lazy = {
        "MemmapTrajectoryStore": "rlhf_pipeline.storage.memmap",
        "AppendWriter": "rlhf_pipeline.storage.torchrl_glue",
        "make_replay_buffer": "rlhf_pipeline.storage.torchrl_glue",
        "ShardedStoreReader": "rlhf_pipeline.storage.sharded",
        "SelectionStore": "rlhf_pipeline.storage.selection",
    }
    if name in lazy:
        return getattr(importlib.import_module(lazy[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BACKENDS",
    "AppendWriter",
    "MemmapTrajectoryStore",
    "NotAStoreError",
    "ReadOnlyStoreError",
    "SelectionStore",
    "ShardedStoreReader",
    "StoreCorruptedError",
    "StoreError",
    "StoreLockedError",
    "StoreStats",
    "TrajectoryStore",
    "backend_class",
    "create_store",
    "detect_backend",
    "make_replay_buffer",
    "open_buffer",
    "open_store",
]
