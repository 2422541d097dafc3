"""Durable ragged replay-buffer storage: one contract, several backends.

``create_store(location, backend=...)`` makes a new store, ``open_store(location)``
reopens one of any backend (it asks each registered backend whether the location
is one of its stores). ``open_buffer(location)`` opens a run's buffer directory: a single
store, or the read-only union of its ``shard-NNNN`` stores (one per collector).

Importing this package imports no torch: the store classes (and torch with them) load on
first use, so ``rlhf-pipeline inspect`` and ``repair``, which read a store's files with
numpy, json and zarr only (:mod:`.buffers`), start in a fraction of a second.

To add a backend: implement :class:`~rlhf_pipeline.storage.base.TrajectoryStore`
with the classmethods ``create(location, schema, **options)`` and ``open(location, mode)``,
add one line to ``BACKENDS``, and a torch-free module with ``detect(location) -> bool`` (a
cheap check that raises nothing and also recognizes a damaged store), ``stats(location)``,
``verify(location, progress)`` and ``repair(location, apply, progress)`` to ``INSPECTION``.
"""

from __future__ import annotations

import importlib
import os
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

if TYPE_CHECKING:
    from rlhf_pipeline.schema import StoreSchema
    from rlhf_pipeline.storage.base import TrajectoryStore
    from rlhf_pipeline.storage.memmap import MemmapTrajectoryStore

# backend name -> "module:Class"; tried in this order by open_store
BACKENDS: dict[str, str] = {
    "memmap": "rlhf_pipeline.storage.memmap:MemmapTrajectoryStore",
    "zarr": "rlhf_pipeline.storage.zarr:ZarrTrajectoryStore",
}

# backend name -> module of torch-free functions on a location: detect, stats, verify, repair
INSPECTION: dict[str, str] = {
    "memmap": "rlhf_pipeline.storage.memmap.inspection",
    "zarr": "rlhf_pipeline.storage.zarr.inspection",
}


def backend_class(name: str) -> type[TrajectoryStore]:
    """The store class registered under ``name`` (imported on first use)."""
    try:
        target = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown storage backend {name!r}; choose from {sorted(BACKENDS)}") from None
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def inspection(name: str):
    """The torch-free module of backend ``name`` (``detect``, ``stats``, ``verify``, ``repair``)."""
    return importlib.import_module(INSPECTION[name])


def buffer_inside(location: str) -> str | None:
    """``location/buffer`` when ``location`` is a local directory holding one (a run directory
    given where its buffer was meant), else None. Imports no torch."""
    run_buffer = os.path.join(location, "buffer")
    return run_buffer if "://" not in location and os.path.isdir(run_buffer) else None


def detect_backend(location: str) -> str:
    """Name of the backend whose store (possibly damaged) lives at ``location``.

    ``StoreNotFoundError`` when the path does not exist, ``NotAStoreError`` when no backend
    recognizes what is there. Imports no torch.
    """
    location = str(location)
    if "://" not in location and not os.path.exists(location):
        raise StoreNotFoundError(f"{location} does not exist")
    for name in BACKENDS:
        if inspection(name).detect(location):
            return name
    if (run_buffer := buffer_inside(location)) is not None:
        raise NotAStoreError(f"{location} is not a replay buffer but holds one: did you mean {run_buffer}?")
    raise NotAStoreError(
        f"{location} is not a replay buffer: no backend ({', '.join(BACKENDS)}) recognizes it. Check the "
        f"path: a buffer is a memmap directory, a Zarr store, or a run's buffer/ of shard-NNNN stores."
    )


def open_store(location, mode: str = "r", *, backend: str | None = None, **options) -> TrajectoryStore:
    """Opens an existing store; ``mode="r"`` reads (no lock), ``mode="a"`` appends (writer lock)."""
    if backend is None and options.get("storage_options") is not None:
        backend = "zarr"  # fsspec options: only the Zarr backend reads URLs
    name = backend or detect_backend(str(location))
    return backend_class(name).open(str(location), mode=mode, **options)


def open_buffer(location, mode: str = "r", **options) -> TrajectoryStore:
    """Opens a run's buffer directory, whatever its layout.

    A single store (one collector; runs made before shards) opens as with :func:`open_store`;
    a directory or URL prefix of ``shard-NNNN`` stores (one per collector) opens as a read-only
    :class:`~rlhf_pipeline.storage.sharded.ShardedStoreReader` over all of them, which also
    picks up shards created later. Appending goes to one shard: ``open_store(shard, mode="a")``.
    A saved selection (``rlhf-pipeline filter ... --selection``) opens as a read-only
    :class:`~rlhf_pipeline.storage.selection.SelectionStore` over the rows it names.
    """
    from rlhf_pipeline.storage.buffers import is_sharded_buffer
    from rlhf_pipeline.storage.selection import SelectionStore, is_selection

    location = str(location)
    if is_selection(location):
        return SelectionStore.open(location, mode=mode, **options)
    if is_sharded_buffer(location, options.get("storage_options")):
        if mode != "r":
            raise ReadOnlyStoreError(
                f"{location} holds one store per collector (shard-NNNN); the union is read-only. "
                f"Open one shard with open_store(<shard dir>, mode={mode!r}) to append"
            )
        from rlhf_pipeline.storage.sharded import ShardedStoreReader

        return ShardedStoreReader(location, **options)
    return open_store(location, mode=mode, **options)


def create_store(location, backend: str = "memmap", schema: StoreSchema | None = None, **options) -> TrajectoryStore:
    """Creates a new, empty store opened for appending (``options`` are the backend's)."""
    from rlhf_pipeline.schema import StoreSchema

    return backend_class(backend).create(str(location), schema or StoreSchema(), **options)


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
    "create_store",
    "detect_backend",
    "inspection",
    "make_replay_buffer",
    "open_buffer",
    "open_store",
]
