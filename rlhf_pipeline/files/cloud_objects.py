"""Conditional writes to the objects under one URL prefix, whichever cloud holds them: create only,
replace only the version read, delete only the version held, and read with the object's age on the
server's clock. What replaces rename and ``flock`` on object storage (the Zarr buffer's units, commit
record and writer lock; run state at a URL). Torch-free; nothing of ours above this layer.

Where callers import from: the interface :class:`CloudObjects` and its refusal :class:`ConditionFailed`
(``cloud_base.py``), one module per cloud (``cloud_s3.py``, ``cloud_azure.py``), and :func:`cloud_for`,
the choice by the URL's scheme; a caller never needs to know which cloud it has.
Design: docs/scaling.md#which-clouds-s3-and-azure-blob-storage-not-yet-gcs.
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
