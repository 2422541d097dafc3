"""The storage backends by name, and opening or creating one store of any of them; imports no torch.

``BACKENDS`` names each backend's store class (imported on first use, with torch); ``INSPECTION`` and
``REPAIR`` name its torch-free modules, which ``inspect`` and ``repair`` read a store's files with.
:func:`detect_backend` asks each backend whether a location is one of its stores. The package's
``open_buffer`` builds on these for buffers of several shards.

Design: docs/storage.md#adding-a-backend.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

from rlhf_pipeline.storage.errors import NotAStoreError, StoreNotFoundError

if TYPE_CHECKING:
    from rlhf_pipeline.schema import StoreSchema
    from rlhf_pipeline.storage.base import TrajectoryStore

# backend name -> "module:Class"; tried in this order by open_store
BACKENDS: dict[str, str] = {
    "memmap": "rlhf_pipeline.storage.memmap:MemmapTrajectoryStore",
    "zarr": "rlhf_pipeline.storage.zarr:ZarrTrajectoryStore",
}

# backend name -> module of torch-free functions on a location: detect, stats, verify
INSPECTION: dict[str, str] = {
    "memmap": "rlhf_pipeline.storage.memmap.inspection",
    "zarr": "rlhf_pipeline.storage.zarr.inspection",
}

# backend name -> module with repair(location, apply, progress), torch-free too
REPAIR: dict[str, str] = {
    "memmap": "rlhf_pipeline.storage.memmap.repair",
    "zarr": "rlhf_pipeline.storage.zarr.repair",
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
    """The torch-free module of backend ``name`` (``detect``, ``stats``, ``verify``)."""
    return importlib.import_module(INSPECTION[name])


def repairer(name: str):
    """The torch-free module of backend ``name`` with ``repair(location, apply, progress)``."""
    return importlib.import_module(REPAIR[name])


def buffer_inside(location: str) -> str | None:
    """``location/buffer`` when ``location`` is a local directory holding one (a run directory
    given where its buffer was meant), else None. Imports no torch."""
    run_buffer = os.path.join(location, "buffer")
    return run_buffer if "://" not in location and os.path.isdir(run_buffer) else None


def runs_inside(location: str) -> list[str]:
    """The names of the run directories right under ``location`` (local directories holding a
    ``buffer/``): a ``--home`` such as ``storage/`` given where a buffer was meant. Imports no torch."""
    if "://" in location or not os.path.isdir(location):
        return []
    return sorted(name for name in os.listdir(location) if os.path.isdir(os.path.join(location, name, "buffer")))


def check_buffer_url(location: str) -> str:
    """``location`` as text when it is a local path or a URL whose scheme fsspec can open; else
    :class:`~rlhf_pipeline.storage.errors.NotAStoreError` naming the scheme and the fix (never a
    traceback from deep in fsspec, and never a local directory named ``foo:``)."""
    location = str(location)
    if "://" not in location:
        return location
    import fsspec

    from rlhf_pipeline.storage.errors import StorageExtraMissingError

    scheme = location.split("://", 1)[0]
    try:
        fsspec.get_filesystem_class(scheme)
    except ValueError:
        raise NotAStoreError(
            f"{location}: {scheme}:// is not a URL scheme a buffer can be read at; use s3:// or az:// (object "
            f"storage), file:// or a local path (any other scheme needs an fsspec file system for it)") from None
    except ImportError as exc:
        raise StorageExtraMissingError(f"{location}: reading {scheme}:// URLs needs a package that is not "
                                       f"installed: {exc}") from None
    return location


def detect_backend(location: str) -> str:
    """Name of the backend whose store (possibly damaged) lives at ``location``.

    ``StoreNotFoundError`` when the path does not exist, ``NotAStoreError`` when no backend
    recognizes what is there. Imports no torch.
    """
    location = check_buffer_url(location)
    if "://" not in location and not os.path.exists(location):
        raise StoreNotFoundError(f"{location} does not exist")
    for name in BACKENDS:
        if inspection(name).detect(location):
            return name
    if (run_buffer := buffer_inside(location)) is not None:
        raise NotAStoreError(f"{location} is not a replay buffer but holds one: did you mean {run_buffer}? (in "
                             f"Python, open_buffer({str(run_buffer)!r}) reads it, all its shards)")
    if runs := runs_inside(location):
        named = ", ".join(runs[:4]) + (f" and {len(runs) - 4} more" if len(runs) > 4 else "")
        raise NotAStoreError(f"{location} is a directory of runs ({named}), not a buffer: give one of them, e.g. "
                             f"{os.path.join(location, runs[0])}")
    from rlhf_pipeline.files.shard_names import local_shard_names
    from rlhf_pipeline.storage.manifest import is_selection, selection_source

    # what open_buffer reads but no single store's backend does: said as such, with the function that reads it
    if "://" not in location and local_shard_names(location):
        raise NotAStoreError(f"{location} is a run's buffer (one shard-NNNN store per collector), not a single store: "
                             f"read it with open_buffer({location!r}); open_store opens one store, e.g. one shard")
    if is_selection(location):
        raise NotAStoreError(f"{location} is a saved selection (a branch's parent-rows/, or filter --selection), rows "
                             f"of other stores read in place, not a store: read-only, the commands that read a buffer "
                             f"take it (in Python, open_buffer({location!r})); one that writes or repairs takes its "
                             f"source, {selection_source(location)}")
    if "://" not in location and location.endswith(".zip") and os.path.isfile(location):
        import zipfile

        what = ("a zip file that holds no Zarr store (no zarr.json at its top)" if zipfile.is_zipfile(location)
                else "not a readable zip file (cut short in a copy, or not a zip at all)")
        raise NotAStoreError(f"{location} is {what}; a zipped store is the one file `rlhf-pipeline convert SRC "
                             f"{os.path.basename(location)} --to zarr` writes")
    raise NotAStoreError(
        f"{location} is not a replay buffer: no backend ({', '.join(BACKENDS)}) recognizes it. Check the "
        f"path: a buffer is a memmap directory, a Zarr store, or a run's buffer/ of shard-NNNN stores."
    )


def open_store(location, mode: str = "r", *, backend: str | None = None, **options) -> TrajectoryStore:
    """Opens an existing store; ``mode="r"`` reads (no lock), ``mode="a"`` appends (writer lock)."""
    if backend is None and (options.get("storage_options") is not None or "://" in str(location)):
        # only the Zarr backend reads URLs: asking each backend would GET the commit record twice
        backend = "zarr"
    name = backend or detect_backend(str(location))
    return backend_class(name).open(str(location), mode=mode, **options)


def create_store(location, backend: str = "memmap", schema: StoreSchema | None = None, **options) -> TrajectoryStore:
    """Creates a new, empty store opened for appending (``options`` are the backend's)."""
    from rlhf_pipeline.schema import StoreSchema

    return backend_class(backend).create(str(location), schema or StoreSchema(), **options)
