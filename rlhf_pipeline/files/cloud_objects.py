"""Conditional writes to the objects under one URL prefix, whichever cloud holds them: create
only, replace only the version read, delete only the version held, and read with the object's
age on the server's clock. No torch, nothing of ours above this layer.

Object storage has no rename and no ``flock``; these four operations are what replaces them
(the Zarr buffer's create-only units, fenced commit record and leased writer lock in
``storage/zarr/object_store.py``; run-state files at a URL). Each cloud names them differently:

============  =========================  ===================================  ===================
cloud         create only                replace only the version read        refused
============  =========================  ===================================  ===================
S3            ``If-None-Match: *``       ``If-Match: <etag>``                 412 (409: retried)
Azure Blob    ``If-None-Match: *``       ``If-Match: <etag>``                 409 exists, 412
============  =========================  ===================================  ===================

and the callers see one interface, :class:`CloudObjects`, with :class:`ConditionFailed` for a
refusal. :func:`cloud_for` picks the implementation from a URL's scheme; an implementation is
built on the fsspec file system that reads the same URL (s3fs, adlfs), so credentials and
endpoint are configured once, the way that file system takes them.

The coroutines run on the event loop the file system's client is used from: Zarr's loop for a
store's file system (``asynchronous=True``), or ``fs.loop`` for a synchronous one
(``fsspec.asyn.sync(objects.loop, objects.read, key)``).

This module is where callers import from: the interface and its errors (``cloud_base.py``), one
module per cloud (``cloud_s3.py``, ``cloud_azure.py``), and the choice between them by scheme. The
clouds answer the same four questions and the table above is the whole difference between them;
a caller must never need to know which one it has.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlhf_pipeline.files.cloud_azure import AzureObjects
from rlhf_pipeline.files.cloud_base import (
    CloudAccessError,
    CloudObjects,
    ConditionFailed,
    ContainerNotFoundError,
    ObjectVersion,
    RetryPolicy,
    UnreachableError,
    through_outages,
)
from rlhf_pipeline.files.cloud_s3 import S3Objects

CLOUDS: tuple[type[CloudObjects], ...] = (S3Objects, AzureObjects)


def cloud_for(url: str) -> type[CloudObjects] | None:
    """The implementation for ``url``'s scheme; None for a local path or another fsspec URL."""
    for cloud in CLOUDS:
        if url.startswith(cloud.schemes):
            return cloud
    return None


def objects_at(url: str, storage_options: Mapping[str, Any] | None = None) -> CloudObjects:
    """The objects under ``url`` (a synchronous file system: run the coroutines on ``.loop``)."""
    import fsspec

    cloud = cloud_for(url)
    if cloud is None:
        raise ValueError(f"{url} is not on a cloud object store this library writes to; use a URL starting "
                         f"with one of {', '.join(s for c in CLOUDS for s in c.schemes)}")
    fs, path = fsspec.core.url_to_fs(url, **cloud.fsspec_options(storage_options))
    return cloud(fs, path)


__all__ = [
    "CLOUDS",
    "AzureObjects",
    "CloudAccessError",
    "CloudObjects",
    "ConditionFailed",
    "ContainerNotFoundError",
    "ObjectVersion",
    "RetryPolicy",
    "S3Objects",
    "UnreachableError",
    "cloud_for",
    "objects_at",
    "through_outages",
]
