"""Copies a replay buffer between backends (memmap <-> Zarr), losslessly and in bounded memory.

Rows are streamed one source segment at a time into the new store, so memory stays at about one segment
and an interrupted conversion leaves a valid destination holding a prefix of the rows. Every field of
every held row is kept bit for bit, with the schema, the segment size and the row capacity; global row
ids restart at 0, and backend options (the Zarr codec) are the destination's own.

Design: docs/buffer-tools.md#convert.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlhf_pipeline.storage.backends import backend_class, inspection, open_store
from rlhf_pipeline.storage.base import StoreStats, TrajectoryStore
from rlhf_pipeline.storage.new_buffer import new_store

DEFAULT_SEGMENT_ROWS = 4096


def segment_rows_of(store: TrajectoryStore) -> int:
    for name in ("segment_rows", "_segment_rows"):
        value = getattr(store, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return DEFAULT_SEGMENT_ROWS


def _open_source(location: str) -> TrajectoryStore:
    """The store at ``location``, as its rows are read: a saved selection there (``filter --selection``)
    as the rows it names, and a shard of a branch continued online as its parent's rows then its own
    (``storage/continued.py``); a conversion copies them into a store of their own."""
    from rlhf_pipeline.storage.manifest import is_selection

    if is_selection(location):
        from rlhf_pipeline.storage import open_buffer

        return open_buffer(location, mode="r")
    own = open_store(location, mode="r")
    try:
        return _continued_shard(location, own) or own
    except BaseException:
        own.close()
        raise


def _continued_shard(location: str, own: TrajectoryStore) -> TrajectoryStore | None:
    from rlhf_pipeline.storage.buffers import join_shard
    from rlhf_pipeline.storage.continued import ContinuedShard
    from rlhf_pipeline.storage.continues import continued_rows

    buffer, _, name = str(location).rstrip("/").rpartition("/")
    continues = continued_rows(buffer) if buffer else None
    rows = int((continues or {}).get("rows", {}).get(name, 0))
    if not rows:
        return None
    parent = open_store(join_shard(str(continues["parent_buffer"]), name), mode="r")
    try:
        return ContinuedShard(parent, own, rows)
    except BaseException:
        parent.close()
        raise


def convert(src: str, dst: str, to: str, *, segment_rows: int | None = None,
            progress: Callable[[int, int], None] | None = None, **dst_options: Any) -> StoreStats:
    """Copies the buffer at ``src`` into a new ``to`` store (``"zarr"`` or ``"memmap"``) at ``dst``.

    ``progress(rows_done, rows_total)`` is called after each segment. ``dst_options`` go
    to the destination's ``create`` (e.g. ``codec="zstd"`` for Zarr). Returns the
    destination's stats; raises before writing anything if ``dst`` already holds a store. In a
    directory ``dst`` appears whole or not at all (:mod:`.new_buffer`): a convert killed midway
    leaves no store that looks like a finished one with fewer rows.
    """
    target_cls = backend_class(to)
    with _open_source(src) as source:
        rows_per_step = segment_rows_of(source) if segment_rows is None else segment_rows
        capacity = getattr(source, "capacity_rows", None)
        dst_options.setdefault("segment_rows", rows_per_step)
        if capacity is not None:
            dst_options.setdefault("capacity_rows", max(int(capacity), dst_options["segment_rows"]))
        first, stop = source.first_row, source.next_row
        with new_store(target_cls, dst, "convert", source.schema, **dst_options) as target:
            done = 0
            # aligned on the source's segment boundaries, so each step decodes one segment
            start = first
            while start < stop:
                end = min(stop, (start // rows_per_step + 1) * rows_per_step)
                target.append(source.read_global(torch.arange(start, end)))
                done += end - start
                start = end
                if progress is not None:
                    progress(done, stop - first)
            if progress is not None and stop == first:
                progress(0, 0)
    return inspection(to).stats(dst)  # once closed: what stays on disk


def verify(src: str, dst: str, *, rows_per_step: int = DEFAULT_SEGMENT_ROWS) -> int:
    """Compares every held row of two buffers (any backends); returns the row count or raises."""
    with _open_source(src) as a, open_store(dst, mode="r") as b:
        if len(a) != len(b) or a.schema != b.schema:
            raise ValueError(f"{src} holds {len(a)} rows of {a.schema.field_names}, {dst} holds "
                             f"{len(b)} rows of {b.schema.field_names}")
        for start in range(0, len(a), rows_per_step):
            positions = torch.arange(start, min(len(a), start + rows_per_step))
            if not a.read(positions).equal(b.read(positions)):
                raise ValueError(f"rows {start}..{int(positions[-1])} differ between {src} and {dst}")
        return len(a)
