"""A run's buffer as the commands see it: one store, or a directory of ``shard-NNNN`` stores; no torch.

Every command that takes a buffer (``inspect``, ``inspect --verify``, ``repair``, ``convert``) accepts a
memmap directory, a Zarr store (directory, ``.zip`` or URL), or a run's ``buffer/`` of shards, one store
per collector (a directory, or a URL prefix listed through fsspec, where a shard made now gets a spread
name: ``files/shard_names.py``). :func:`stores_in` expands a buffer into its stores; :func:`buffer_stats`,
:func:`verify_buffer` and :func:`repair_buffer` run the backends' torch-free functions on each.

Design: docs/buffer-tools.md.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from rlhf_pipeline.files.shard_names import (  # noqa: F401 - re-exported: the shard names, with the listing
    SHARD_PREFIX,
    join_shard,
    local_shard_names,
    new_shard_name,
    shard_index,
    shard_key_of,
    shard_location,
    shard_name,
    spread_shard_name,
)
from rlhf_pipeline.storage.errors import StoreCorruptedError, StoreNotFoundError
from rlhf_pipeline.storage.reports import CheckReport, Progress, RepairReport
from rlhf_pipeline.storage.summary import StoreStats, combine_trajectories


def is_url(location: str | Path) -> bool:
    """True for an fsspec URL (``s3://bucket/prefix``, ``file:///abs``): joined as text, listed through fsspec."""
    return "://" in str(location)


def shard_path(buffer_dir: str | Path, index: int) -> Path:
    return Path(buffer_dir) / shard_name(index)


def list_shards(buffer: str | Path, storage_options: dict | None = None) -> list[tuple[int, str]]:
    """``(index, location)`` of the shard stores under ``buffer``, by index.

    A local directory is read with one directory listing; a URL prefix is listed through fsspec, once
    (one LIST request on S3; a prefix holding no object lists as empty). An index held under two names
    (``shard-0007`` and ``70-shard-0007``) is refused: which of them its collector writes is not known.
    """
    if is_url(buffer):
        from rlhf_pipeline.storage.backends import check_buffer_url

        check_buffer_url(buffer)
        names = _url_shard_names(str(buffer), storage_options)
    else:
        names = local_shard_names(buffer)
    found: dict[int, str] = {}
    for name in names:
        index = shard_index(name)
        if index is None:
            continue
        if index in found:
            first, second = sorted([found[index], name])
            raise StoreCorruptedError(
                f"{buffer} holds shard {index} twice, as {first} and as {second}: keep the one its collector "
                f"writes (the one with rows; `rlhf-pipeline inspect` each) and move the other out of the buffer")
        found[index] = name
    return [(index, join_shard(buffer, found[index])) for index in sorted(found)]


def find_shard(buffer: str | Path, index: int, storage_options: dict | None = None) -> str:
    """Where shard ``index`` of ``buffer`` is: the store already there under either name (one listing),
    else where it is made (:func:`shard_location`). A collector or an import opens its shard here, so
    a buffer made before spread names goes on with its ``shard-NNNN`` stores."""
    for listed, location in list_shards(buffer, storage_options):
        if listed == index:
            return location
    return shard_location(buffer, index)


def _url_shard_names(url: str, storage_options: dict | None) -> list[str]:
    """The names of the directories under ``url`` (one LIST)."""
    import fsspec

    from rlhf_pipeline.storage.zarr import object_store

    if object_store.is_object_store_url(url):
        object_store.require_object_store_client(url)
        options = object_store.object_store_options(storage_options, location=url)  # no listing cache: new shards show
    else:
        options = dict(storage_options or {})
    fs, root = fsspec.core.url_to_fs(url, **options)
    try:
        entries = fs.ls(root, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [shard_key_of(entry["name"]) for entry in entries if entry.get("type") == "directory"]


def is_sharded_buffer(location: str | Path, storage_options: dict | None = None) -> bool:
    """True when ``location`` (a directory or a URL prefix) holds ``shard-NNNN`` stores."""
    try:
        return bool(list_shards(location, storage_options))
    except OSError:
        return False


def within(location: str | Path, container: str | Path) -> bool:
    """Whether ``location`` is ``container`` or lies under it (paths resolved; URLs compared as text)."""
    if is_url(location) or is_url(container):
        inner, outer = str(location).rstrip("/"), str(container).rstrip("/")
        return inner == outer or inner.startswith(outer + "/")
    inner, outer = Path(location).resolve(), Path(container).resolve()
    return inner == outer or outer in inner.parents


def buffer_holding(location: str | Path) -> str | None:
    """The buffer that ``location`` lies inside, if any: the nearest directory (or URL prefix) above
    it that is a store, holds shard stores, or is a run's ``buffer/`` (``settings.json`` beside it,
    looked at on a local file system only). A store written there becomes part of that buffer: a new
    ``shard-NNNN`` of a run's buffer is read by its learner as rows of the run. None when nothing above
    ``location`` is a buffer. Locally a few ``stat`` calls per directory up to the root; at a URL a
    GET and two LISTs per prefix up to the bucket."""
    from rlhf_pipeline.storage.backends import detect_backend
    from rlhf_pipeline.storage.errors import NotAStoreError

    if is_url(location):
        scheme, rest = str(location).rstrip("/").split("://", 1)
        parts = rest.split("/")
        ancestors = [f"{scheme}://{'/'.join(parts[:n])}" for n in range(len(parts) - 1, 1, -1)]
    else:
        ancestors = [str(parent) for parent in Path(location).resolve().parents if parent != parent.parent]
    for ancestor in ancestors:
        try:
            detect_backend(ancestor)
            return ancestor
        except NotAStoreError:  # nothing there, or not a store (StoreNotFoundError too)
            pass
        if is_sharded_buffer(ancestor):
            return ancestor
        local = Path(ancestor)
        if not is_url(ancestor) and local.name == "buffer" and (local.parent / "settings.json").is_file():
            return ancestor
    return None


def stores_in(location: str, skipped: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """``(backend, location)`` of every store of a buffer: the store itself, or each shard.

    Raises ``StoreNotFoundError`` for a path that does not exist, ``NotAStoreError`` when
    nothing there is a store, ``StoreCorruptedError`` when the store is too damaged to tell
    its backend. A shard being created (no metadata yet; at an object-store URL, where there is
    no rename, :class:`~rlhf_pipeline.storage.errors.StoreBeingCreatedError` says so) is left out,
    and ``skipped`` (when given) gets its name and why, as a learner's union leaves it out.
    """
    from rlhf_pipeline.storage.backends import check_buffer_url, detect_backend
    from rlhf_pipeline.storage.errors import NotAStoreError

    location = check_buffer_url(location)
    if "://" not in location and not os.path.exists(location):
        raise StoreNotFoundError(f"{location} does not exist")
    if not is_sharded_buffer(location):
        return [(detect_backend(location), location)]
    found, not_open = [], {}
    for index, path in list_shards(location):
        try:
            found.append((detect_backend(path), path))
        except NotAStoreError as exc:
            not_open[shard_key_of(path)] = _being_created(path) or str(exc)
    if skipped is not None:
        skipped.update(not_open)
    if not found:
        raise NotAStoreError(f"{location} holds no readable shard store (shard-NNNN directories): "
                             + "; ".join(f"{name}: {why}" for name, why in not_open.items()))
    return found


def _being_created(location: str) -> str | None:
    """Why the shard at ``location``, which no backend recognizes, is a store being made (at an
    object-store URL); else None."""
    from rlhf_pipeline.storage.errors import StoreBeingCreatedError
    from rlhf_pipeline.storage.zarr.inspection import open_record

    if not is_url(location):
        return None
    try:
        loc, _ = open_record(location)
        loc.kv.close()
    except StoreBeingCreatedError as exc:
        return str(exc)
    except Exception:  # noqa: BLE001 - anything else: the caller's own reason stands
        return None
    return None


def buffer_stats(location: str) -> StoreStats:
    """``inspect``'s summary of a buffer, summed over its shards; no torch, except for a saved
    selection, whose kept rows are read through its source (torch)."""
    from rlhf_pipeline.storage.backends import inspection
    from rlhf_pipeline.storage.errors import NotAStoreError, StoreNotFoundError
    from rlhf_pipeline.storage.manifest import is_selection

    skipped: dict[str, str] = {}
    try:
        stores = stores_in(location, skipped)
    except StoreNotFoundError:
        raise
    except NotAStoreError:
        if not is_selection(location):
            raise
        from rlhf_pipeline.storage import open_buffer

        with open_buffer(location, mode="r") as selection:
            return selection.stats()
    if not is_sharded_buffer(location):
        backend, path = stores[0]
        return inspection(backend).stats(path)
    out = combine_stats(location, [inspection(b).stats(p) for b, p in stores])
    if skipped:  # as the learner's union says it (ShardedStoreReader.stats)
        out.extra["shards_not_open"] = "; ".join(f"{k}: {v}" for k, v in sorted(skipped.items()))
    return out


def combine_stats(location: str, per_shard: list[StoreStats], schema_optional: list[str] | None = None) -> StoreStats:
    """The stats of a sharded buffer from its shards' stats (shards in index order)."""
    versions: dict[int, int] = {}
    for s in per_shard:
        for v, c in s.policy_versions.items():
            versions[v] = versions.get(v, 0) + c
    out = StoreStats(
        backend="sharded",
        location=str(location),
        rows=sum(s.rows for s in per_shard),
        first_row=sum(s.first_row for s in per_shard),
        next_row=sum(s.next_row for s in per_shard),
        groups=sum(s.groups for s in per_shard),  # group ids carry the collector index
        prompt_tokens=sum(s.prompt_tokens for s in per_shard),
        response_tokens=sum(s.response_tokens for s in per_shard),
        bytes_on_disk=sum(s.bytes_on_disk for s in per_shard),
        raw_bytes=sum(s.raw_bytes for s in per_shard),
        segments=sum(s.segments for s in per_shard),
        policy_versions=dict(sorted(versions.items())),
        optional_fields=list(schema_optional if schema_optional is not None
                             else (per_shard[0].optional_fields if per_shard else [])),
        trajectories=combine_trajectories([s.trajectories for s in per_shard]),
        extra={
            "shards": len(per_shard),
            "shard_backends": ",".join(sorted({s.backend for s in per_shard})),
            "shard_rows": ", ".join(f"{str(s.location).rstrip('/').rsplit('/', 1)[-1]}: {s.rows}" for s in per_shard),
            # where each shard's held rows begin: retention (or eviction) dropped the ones before
            "shard_first_rows": ", ".join(f"{str(s.location).rstrip('/').rsplit('/', 1)[-1]}: {s.first_row}"
                                          for s in per_shard),
        },
    )
    with_rows = [s for s in per_shard if s.rows and s.reward_mean is not None]
    if with_rows:
        total = sum(s.rows for s in with_rows)
        mean = sum(s.rows * s.reward_mean for s in with_rows) / total
        # the backends report the population std (numpy's default): combine the same way
        ss = sum(s.rows * ((s.reward_std or 0.0) ** 2 + (s.reward_mean - mean) ** 2) for s in with_rows)
        out.reward_mean = mean
        out.reward_std = math.sqrt(ss / total)
        out.reward_min = min(s.reward_min for s in with_rows)
        out.reward_max = max(s.reward_max for s in with_rows)
    return out


def verify_buffer(location: str, progress: Progress | None = None) -> list[CheckReport]:
    """``inspect --verify``: one report per store of the buffer; of a saved selection (a branch's
    ``parent-rows/``), one per store it reads, once opening it checked that they still hold the
    rows it names (torch, as ``open_buffer`` reads it)."""
    from rlhf_pipeline.storage.backends import inspection
    from rlhf_pipeline.storage.manifest import is_selection

    if is_selection(location):
        from rlhf_pipeline.storage import open_buffer

        with open_buffer(location, mode="r") as selection:
            stores = [(source.backend_name, source.location) for source in selection.sources]
    else:
        stores = stores_in(location)
    return [inspection(backend).verify(path, progress) for backend, path in stores]


def repair_buffer(location: str, *, apply: bool = False, progress: Progress | None = None) -> list[RepairReport]:
    """``repair``: one report per store of the buffer (a dry run unless ``apply``)."""
    from rlhf_pipeline.storage.backends import repairer

    return [repairer(backend).repair(path, apply=apply, progress=progress) for backend, path in stores_in(location)]
