"""Snapshots of a Zarr store: its published units copied byte for byte into a new store.

``ZarrTrajectoryStore.snapshot_to`` (and torchrl's ``dumps``) lands here: the files of every unit the
source's commit record names are copied as they are (:meth:`.units.UnitIO.copy_to`), then that record is
published as the new store's own, last, so a reader of the new store sees it empty or whole.
Design: docs/zarr-layout.md#snapshots."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlhf_pipeline.storage.zarr.location import publish

if TYPE_CHECKING:  # the store calls this module: the target is made by the source's own class
    from rlhf_pipeline.storage.zarr.store import ZarrTrajectoryStore


def write_snapshot(source: ZarrTrajectoryStore, path: str) -> None:
    """Copies ``source``'s published units into a new Zarr store at ``path`` (a missing or empty directory, or a URL)."""
    source.flush()
    source.refresh()
    record = dict(source.published_record)
    io = source.unit_io
    target = type(source).create(path, source.schema, capacity_rows=source.capacity_rows,
                                 segment_rows=source.segment_rows, codec=io.codecs.config,
                                 cache_bytes=0, durable=io.durable)
    try:
        io.copy_to(target.unit_io, source.units)
        publish(target.unit_io.loc, record, durable=io.durable)
    finally:
        target.close()
