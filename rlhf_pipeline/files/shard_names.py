"""The names of a buffer's shards: ``shard-NNNN``, and at an object-store URL ``<hh>-shard-NNNN``.

A run's buffer is a directory (or URL prefix) of stores, one per collector, each named after its shard
index: ``shard-0007`` on a file system; made now at an ``s3://`` or ``az://`` URL, ``70-shard-0007``, the
index's lowest hex digits first, so that one buffer's shards start spread over 16 (then 256) key prefixes
of the bucket's partitions. :func:`shard_index` reads either name (digits that are not the index's are no
shard); a shard keeps the name it was made with, so older buffers at URLs keep ``shard-NNNN``.
Design: docs/object-storage.md#spread-shard-names.
"""

from __future__ import annotations

import re
from pathlib import Path

from rlhf_pipeline.files.cloud_objects import cloud_for

SHARD_PREFIX = "shard-"
IMPORT_SHARD_FIRST = 9000
"""A run's collectors take shards 0, 1, ...; ``rlhf-pipeline import`` into a run takes shards from here, so a
collector started later never writes (and numbers ids) in an import's shard."""
_SHARD_NAME = re.compile(r"^(?:([0-9a-f]{2})-)?shard-(\d+)$")


def shard_name(index: int) -> str:
    """The plain name of shard ``index``: ``shard-0007``."""
    if index < 0:
        raise ValueError(f"shard index must be >= 0, got {index}")
    return f"{SHARD_PREFIX}{index:04d}"


def spread_shard_name(index: int) -> str:
    """The name of shard ``index`` made at an object-store URL: ``70-shard-0007``, the index's two
    lowest hex digits in front, lowest first, so a run's shards ``0 .. N-1`` start spread evenly over
    16 (then 256) key prefixes."""
    return f"{_spread_digits(index)}-{shard_name(index)}"


def _spread_digits(index: int) -> str:
    """The index's two lowest hex digits, lowest first: consecutive shards differ in the first."""
    return f"{index % 16:x}{index // 16 % 16:x}"


def spreads_shards(buffer: str | Path) -> bool:
    """True when shards made under ``buffer`` take spread names: at an object-store URL. A file
    system has no key partitions; its shards keep the plain names."""
    return cloud_for(str(buffer)) is not None


def new_shard_name(buffer: str | Path, index: int) -> str:
    """The name shard ``index`` takes when it is made under ``buffer`` now."""
    return spread_shard_name(index) if spreads_shards(buffer) else shard_name(index)


def shard_index(name: str) -> int | None:
    """The index in a shard's name (``shard-0007`` or ``70-shard-0007``); None for any other name,
    digits that are not the index's included."""
    match = _SHARD_NAME.match(name)
    if match is None:
        return None
    index = int(match.group(2))
    if match.group(1) is not None and match.group(1) != _spread_digits(index):
        return None
    return index


def is_import_shard(key: str) -> bool:
    """Whether ``key`` (a shard's name) names a shard that ``import`` wrote rather than a collector."""
    index = shard_index(key)
    return index is not None and index >= IMPORT_SHARD_FIRST


def local_shard_names(directory: str | Path) -> list[str]:
    """The names of the shards in the local buffer directory ``directory`` (none when it is none)."""
    root = Path(directory)
    return [child.name for child in root.iterdir() if shard_index(child.name) is not None and child.is_dir()] \
        if root.is_dir() else []


def join_shard(buffer: str | Path, name: str) -> str:
    """The location of the shard named ``name`` under ``buffer``; joined as text for a URL."""
    if "://" in str(buffer):
        return f"{str(buffer).rstrip('/')}/{name}"
    return str(Path(buffer) / name)


def shard_location(buffer: str | Path, index: int) -> str:
    """Where shard ``index`` is made under ``buffer`` (:func:`new_shard_name`). A shard that exists
    keeps the name it was made with: find it by listing the buffer."""
    return join_shard(buffer, new_shard_name(buffer, index))


def shard_key_of(location: str | Path) -> str:
    """A shard's name from its location: the last part of its path or URL."""
    return str(location).replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]
