"""A reader of a Zarr store opened from a commit record another reader of it read: no request.

Data-parallel learner ranks read one buffer at a URL: rank 0 opens it (a LIST and one GET of each shard's
commit record) and shares the records it read; every other rank opens its readers from them
(:func:`open_reader`), so its opening sends nothing, where 160 ranks over 640 shards each opening their
own sent 205,000 requests at once. The record holds all that :meth:`ZarrTrajectoryStore.open` reads
(schema, codecs, the arrays' layout, the units); the location is what every rank knows.
Design: docs/scaling.md#opening-the-buffer."""

from __future__ import annotations

from typing import Any

from rlhf_pipeline.storage.manifest import ManifestWatcher
from rlhf_pipeline.storage.zarr.layout import ATTRS_KEY
from rlhf_pipeline.storage.zarr.location import parse_root, resolve
from rlhf_pipeline.storage.zarr.object_store import default_refresh_interval_s
from rlhf_pipeline.storage.zarr.store import DEFAULT_CACHE_BYTES, ZarrTrajectoryStore
from rlhf_pipeline.storage.zarr.units import ROOT_META


def open_reader(location: str, record: dict[str, Any], *, cache_bytes: int = DEFAULT_CACHE_BYTES,
                storage_options: dict | None = None, refresh_interval_s: float | None = None) -> ZarrTrajectoryStore:
    """A reader (``mode="r"``) of the store at ``location`` whose view is ``record``: the commit record
    another reader of the same store read (its ``published_record``), checked as a record read here
    would be. Opening sends no request; the reader's next refresh reads the record as any reader's
    does (after ``refresh_interval_s``, as for :meth:`ZarrTrajectoryStore.open`)."""
    location = str(location)
    if refresh_interval_s is None:
        refresh_interval_s = default_refresh_interval_s(location)
    if not refresh_interval_s >= 0:
        raise ValueError(f"refresh_interval_s must be >= 0 seconds, got {refresh_interval_s!r}")
    record = parse_root({"attributes": {ATTRS_KEY: record}}, location)  # the backend and format a reader reads
    loc = resolve(location, read_only=True, storage_options=storage_options)
    # a local store's reader tells a newer record by an fstat: nothing read yet, its first refresh reads it
    watcher = ManifestWatcher(loc.local_root / ROOT_META, what="Zarr replay buffer") \
        if loc.local_root is not None else None
    try:
        store = ZarrTrajectoryStore(location, loc, record, writable=False, cache_bytes=cache_bytes, durable=True,
                                    lock=None, watcher=watcher)
    except BaseException:
        loc.kv.close()
        raise
    store.refresh_interval_s = float(refresh_interval_s)
    return store
