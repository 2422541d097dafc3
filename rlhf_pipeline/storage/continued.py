"""A buffer that continues another's: a branch's rows after its parent's, read as one buffer.

A branch continued online reads, per shard, the rows the parent's shard had published at the branch
step (in place, never written), followed by the rows its own collector writes, numbered on from there.
:class:`ContinuedShard` is one such shard seen whole (own row ``r`` is row ``N + r``);
:class:`ContinuedBufferReader` is the read-only union of them. What a buffer continues is recorded in
``buffer.continues.json`` beside it (:mod:`.continues`).

Design: docs/storage.md#a-buffer-that-continues-another.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rlhf_pipeline.schema import StoreSchema, TrajectoryBatch
from rlhf_pipeline.storage.base import ReadOnlyStoreError, StoreCorruptedError, StoreStats, TrajectoryStore
from rlhf_pipeline.storage.buffers import combine_stats, join_shard
from rlhf_pipeline.storage.padded_rows import LocatedRows
from rlhf_pipeline.storage.sharded import ShardedStoreReader, refresh_now

class ContinuedShard(TrajectoryStore):
    """The parent shard's rows below ``parent_rows``, then ``own``'s rows; read-only
    (docs/storage.md#a-buffer-that-continues-another)."""

    backend_name = "continued"
    supports_field_subset = True

    def __init__(self, parent: TrajectoryStore, own: TrajectoryStore, parent_rows: int) -> None:
        super().__init__()
        if parent.next_row < parent_rows:
            raise StoreCorruptedError(
                f"{parent.location} holds {parent.next_row} rows, fewer than the {parent_rows} the branch at "
                f"{own.location} continues from: the parent's buffer was truncated or replaced")
        if parent.schema != own.schema:
            raise StoreCorruptedError(f"{own.location} stores fields {own.schema.field_names}, its parent shard "
                                      f"{parent.location} {parent.schema.field_names}: a branch keeps the schema")
        self.parent, self.own, self.parent_rows = parent, own, int(parent_rows)
        self._closed = False

    @property
    def schema(self) -> StoreSchema:
        return self.own.schema

    @property
    def location(self) -> str:
        return self.own.location

    @property
    def writable(self) -> bool:
        return False

    @property
    def first_row(self) -> int:
        if self.own.first_row > 0:  # the branch's retention dropped own rows: the parent's are behind them
            return self.parent_rows + self.own.first_row
        return min(self.parent.first_row, self.parent_rows)

    @property
    def next_row(self) -> int:
        # own row r is global row parent_rows + r, also once older own rows were dropped: ids stay put
        return self.parent_rows + self.own.next_row

    @property
    def writer_state(self) -> bytes | None:
        """The branch's collector's, once it has appended (the parent's rows carry the parent's)."""
        return self.own.writer_state

    @property
    def supports_eviction(self) -> bool:
        return False

    @property
    def supports_fused_padding(self) -> bool:
        return self.parent.supports_fused_padding and self.own.supports_fused_padding

    @property
    def refresh_interval_s(self) -> float:
        """The own store's throttle (a Zarr reader at a URL: 1 s), which the union of shards forces past."""
        return self.own.refresh_interval_s

    def refresh(self, *, force: bool = False) -> int:
        if force:
            refresh_now(self.own)
        else:
            self.own.refresh()
        return self._published_len()

    def _split(self, global_ids: torch.Tensor) -> list[tuple[TrajectoryStore, torch.Tensor, torch.Tensor]]:
        """(store, its global ids, where they were) for the parent's part and the branch's part."""
        mine = global_ids >= self.parent_rows
        parts = []
        for store, mask, shift in ((self.parent, ~mine, 0), (self.own, mine, -self.parent_rows)):
            where = torch.nonzero(mask).reshape(-1)
            if where.numel():
                parts.append((store, global_ids[where] + shift, where))
        return parts

    def _read_global(self, global_ids: torch.Tensor, fields: Sequence[str] | None = None) -> TrajectoryBatch:
        parts = self._split(global_ids)
        if len(parts) == 1:
            return parts[0][0].read_global(parts[0][1], fields=fields)
        batches = [store.read_global(ids, fields=fields) for store, ids, _ in parts]
        order = torch.argsort(torch.cat([where for _, _, where in parts]))
        return TrajectoryBatch.cat(batches).select(order)

    def _locate_rows(self, global_ids: torch.Tensor) -> LocatedRows:
        parts = [(where.numpy(), store._locate_rows(ids)) for store, ids, where in self._split(global_ids)]
        if len(parts) == 1:
            return parts[0][1]
        return LocatedRows.merge(parts, global_ids.numel(), self.schema)

    def unit_bounds(self) -> list[tuple[int, int]]:
        inherited = self.parent_rows - self.first_row  # <= 0 once own rows were dropped
        own_start = self.parent_rows + self.own.first_row - self.first_row  # own's first held row, as a position
        bounds = [(a, min(b, inherited)) for a, b in self.parent.unit_bounds() if a < inherited]
        return bounds + [(own_start + a, own_start + b) for a, b in self.own.unit_bounds()]

    def _append_validated(self, batch, writer_state) -> None:  # pragma: no cover - append raises first
        raise ReadOnlyStoreError(f"{self.location}: appends go to the branch's own shard store")

    def close(self) -> None:
        self.parent.close()
        self.own.close()
        self._closed = True

    def stats(self) -> StoreStats:
        out = combine_stats(self.location, [self.own.stats()], list(self.schema.optional))
        out.extra["continues"] = f"{self.parent.location} rows [{self.first_row}, {self.parent_rows})"
        return out

    def snapshot_to(self, path: str) -> None:
        raise NotImplementedError(f"{self.location} continues {self.parent.location}: convert the branch's "
                                  f"parent-rows/ and its own shard one by one")


class ContinuedBufferReader(ShardedStoreReader):
    """The read-only union of a branch's shards, each continuing its parent shard."""

    def __init__(self, location: str | Path, continues: dict[str, Any], **options: Any) -> None:
        self._continues = {str(k): int(v) for k, v in continues["rows"].items()}
        self._parent_buffer = str(continues["parent_buffer"])
        super().__init__(location, **options)

    def _open_shards(self, new: list[tuple[int, str]], records: dict[str, dict[str, Any]] | None = None) -> set[int]:
        from rlhf_pipeline.storage.backends import open_store

        opened = super()._open_shards(new, records)
        for index in opened:
            name, own = self._names[index], self._shards[index]
            rows = self._continues.get(name, 0)
            if rows and not isinstance(own, ContinuedShard):
                parent = open_store(join_shard(self._parent_buffer, name), mode="r")
                try:
                    self._shards[index] = ContinuedShard(parent, own, rows)
                except BaseException:
                    parent.close()
                    raise
        return opened


def open_continued(location: str, continues: dict[str, Any], mode: str = "r", **options: Any) -> TrajectoryStore:
    if mode != "r":
        raise ReadOnlyStoreError(f"{location} continues {continues['parent_buffer']}; the union is read-only. "
                                 f"Open one of its shards with open_store(<shard dir>, mode={mode!r}) to append")
    return ContinuedBufferReader(location, continues, **options)

