"""Stable names for a buffer's rows: ``(part, global row id)`` instead of positions.

A position is valid only until the store's next refresh (eviction shifts positions; in a union of shards
a growing shard shifts every later shard's). A row key, the part (the shard index; 0 for a single store)
and the row's global id in it, never changes. :func:`parts_of` lists a buffer's parts as of its last
refresh; :func:`keys_of` turns positions into keys and :func:`positions_of` keys back into positions
(-1 for a row no longer held). Neither refreshes the store.

Design: docs/storage.md#the-contract.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from rlhf_pipeline.storage.base import TrajectoryStore



@dataclass(frozen=True)
class Part:
    """One store of a buffer whose global row ids are stable."""

    index: int  # shard index (0 for a single store)
    store: TrajectoryStore
    start: int  # buffer position of the part's oldest held row
    length: int  # rows held
    first_row: int  # global id of the part's oldest held row

    @property
    def next_row(self) -> int:
        return self.first_row + self.length


def parts_of(store: TrajectoryStore) -> list[Part]:
    """The parts of ``store`` as of its last refresh, in position order."""
    shard_ranges = getattr(store, "shard_ranges", None)
    if shard_ranges is not None:
        return [Part(index, shard, start, length, shard.first_row)
                for index, shard, start, length in shard_ranges()]
    return [Part(0, store, 0, store.next_row - store.first_row, store.first_row)]


def keys_of(store: TrajectoryStore, positions: np.ndarray,
            parts: list[Part] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(part index, global row id)`` of each position (all within ``[0, len)``)."""
    parts = parts_of(store) if parts is None else parts
    positions = np.asarray(positions, dtype=np.int64).reshape(-1)
    ends = np.array([p.start + p.length for p in parts], dtype=np.int64)
    slot = np.searchsorted(ends, positions, side="right")
    if positions.size and (positions.min() < 0 or slot.max() >= len(parts)):
        raise IndexError(f"positions must lie in [0, {int(ends[-1]) if len(ends) else 0}); got "
                         f"[{int(positions.min())}, {int(positions.max())}]")
    starts = np.array([p.start for p in parts], dtype=np.int64)
    first = np.array([p.first_row for p in parts], dtype=np.int64)
    index = np.array([p.index for p in parts], dtype=np.int64)
    return index[slot], positions - starts[slot] + first[slot]


def positions_of(store: TrajectoryStore, part_index: np.ndarray, global_ids: np.ndarray,
                 parts: list[Part] | None = None) -> np.ndarray:
    """Positions of the rows with these keys; -1 where the row is not held (evicted, unknown part)."""
    parts = parts_of(store) if parts is None else parts
    part_index = np.asarray(part_index, dtype=np.int64).reshape(-1)
    global_ids = np.asarray(global_ids, dtype=np.int64).reshape(-1)
    out = np.full(global_ids.shape, -1, dtype=np.int64)
    for part in parts:
        mine = (part_index == part.index) & (global_ids >= part.first_row) & (global_ids < part.next_row)
        out[mine] = global_ids[mine] - part.first_row + part.start
    return out


def read_by_position(parts: list[Part], positions: np.ndarray, fields=None):
    """The rows at ``positions`` of the layout ``parts`` (a snapshot from :func:`parts_of`), read
    by global id in each part: exactly the rows those positions named when the snapshot was
    taken, whatever refreshes happened since, or an IndexError if some were evicted meanwhile."""
    import torch

    from rlhf_pipeline.schema import TrajectoryBatch

    positions = np.asarray(positions, dtype=np.int64).reshape(-1)
    ends = np.array([p.start + p.length for p in parts], dtype=np.int64)
    slot = np.searchsorted(ends, positions, side="right")
    if positions.size and (positions.min() < 0 or slot.max() >= len(parts)):
        raise IndexError(f"positions must lie in [0, {int(ends[-1]) if len(ends) else 0})")
    pieces = []
    for k in np.unique(slot).tolist() if positions.size else [0]:
        where = np.flatnonzero(slot == k)
        ids = positions[where] - parts[k].start + parts[k].first_row
        pieces.append((parts[k].store.read_global(torch.from_numpy(ids), fields=fields), where))
    if len(pieces) == 1:
        return pieces[0][0]
    inverse = np.empty(positions.size, dtype=np.int64)
    inverse[np.concatenate([where for _, where in pieces])] = np.arange(positions.size)
    return TrajectoryBatch.cat([rows for rows, _ in pieces]).select(torch.from_numpy(inverse))
