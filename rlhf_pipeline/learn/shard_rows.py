"""Naming stored rows the same way across refreshes: ``(shard key, global row id)`` (:class:`RowNames`).

A sampled *position* holds only until the store's next refresh; a row's shard and its global id there
(ids never repeat) outlive it, so the exact sampler's blocks, the rows trained and the intake published
for pacing name rows so (docs/learner.md#the-sampler-contract). A name resolves to a position against a
*view*: for a buffer at a URL, each shard's commit record as of a refresh (:func:`published_view`),
which a data-parallel rank adopts (:func:`adopt_view`, :func:`open_in_view`) to hold exactly the drawn
rows without a request. A shard's key is its name under ``buffer/`` (at a URL with its spread prefix,
``70-shard-0007``), or ``"."`` for a single store (a run made before shards, a store opened on its
own); collectors name theirs alike (``coordination.pacing.shard_key``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlhf_pipeline.storage.buffers import is_url, shard_index

SINGLE_STORE_KEY = "."
#: shard key -> the commit record a refresh read (a Zarr store's ``published_record``)
View = dict[str, dict[str, Any]]


def shard_stores(store) -> list[tuple[str, object]]:
    """``(key, store)`` of every shard of ``store``, in the order of its positions."""
    shards = getattr(store, "shards", None)
    if shards is None:
        return [(SINGLE_STORE_KEY, store)]
    names = store.shard_names
    return [(names[index], shards[index]) for index in sorted(shards)]


def next_rows(store) -> dict[str, int]:
    """Per shard key, the rows ever published to it (its ``next_row``) as of the last refresh."""
    return {key: int(shard.next_row) for key, shard in shard_stores(store)}


@dataclass
class RowNames:
    """The lasting names of a batch's rows, in batch order: shard key and global id of each."""

    keys: list[str]  # the shard keys the rows come from
    shard: np.ndarray  # (B,) index into keys
    ids: np.ndarray  # (B,) global row id within its shard
    # what they were named in, for a buffer at a URL (see the module docstring); between rank 0 and
    # another rank, packed (learn/distributed.ViewChanges)
    view: Any = None

    def select(self, mask: np.ndarray) -> RowNames:
        return RowNames(self.keys, self.shard[mask], self.ids[mask], self.view)

    def by_shard(self) -> dict[str, np.ndarray]:
        return {key: self.ids[self.shard == i] for i, key in enumerate(self.keys) if bool((self.shard == i).any())}

    def with_earlier_turns(self, steps: np.ndarray) -> RowNames:
        """Each row, a trajectory's last at ``steps[i]``, with its earlier turns: the ``steps[i]``
        rows written just before it in its shard (``learn/trajectories.py``)."""
        turns = np.asarray(steps, dtype=np.int64) + 1
        first = np.repeat(self.ids - turns + 1, turns)
        within = np.arange(int(turns.sum())) - np.repeat(np.cumsum(turns) - turns, turns)
        return RowNames(self.keys, np.repeat(self.shard, turns), first + within, self.view)


def row_names(store, positions: torch.Tensor) -> RowNames:
    """Shard key and global id of the rows at ``positions`` (as of the last refresh)."""
    positions = torch.as_tensor(positions, dtype=torch.int64).reshape(-1)
    locate = getattr(store, "locate", None)
    if locate is None:
        return RowNames([SINGLE_STORE_KEY], np.zeros(positions.numel(), dtype=np.int64),
                        positions.numpy() + int(store.first_row), published_view(store))
    indices, local = locate(positions)
    stores = shard_stores(store)
    index_of = {shard_index(key): i for i, (key, _) in enumerate(stores)}
    firsts = torch.tensor([int(shard.first_row) for _, shard in stores], dtype=torch.int64)
    slot = torch.tensor([index_of[int(i)] for i in indices.tolist()], dtype=torch.int64)
    return RowNames([key for key, _ in stores], slot.numpy(), (local + firsts[slot]).numpy(), published_view(store))


def published_view(store) -> View | None:
    """Each shard's commit record as of ``store``'s last refresh, by shard key, when the buffer is at
    a URL and every shard is a Zarr store; else None: a local refresh costs an ``fstat`` per shard,
    nothing worth sending to another process. References, not copies: a refresh replaces a record."""
    if not is_url(store.location):
        return None
    stores = shard_stores(store)
    if not all(hasattr(shard, "published_record") for _, shard in stores):
        return None
    return {key: shard.published_record for key, shard in stores}


def adopt_view(store, view: View) -> None:
    """``store`` (another process's reader of the same buffer) takes ``view`` as its own, without a
    request: afterwards it holds exactly the rows the view's process held (shards ``view`` leaves
    out keep their records)."""
    if hasattr(store, "adopt_records"):
        store.adopt_records(view)
    elif view:
        store.adopt_record(view[SINGLE_STORE_KEY])


def open_in_view(location: str, view: View, **options: Any):
    """A reader of the buffer at ``location`` (a URL) holding exactly ``view``, another reader's
    :func:`published_view` of it, opened without a request: no LIST, no record GET. ``options`` as
    for ``open_buffer`` (``storage_options``, ``refresh_interval_s``, ...)."""
    if SINGLE_STORE_KEY in view:
        from rlhf_pipeline.storage.zarr.from_record import open_reader

        return open_reader(location, view[SINGLE_STORE_KEY], **options)
    from rlhf_pipeline.storage.sharded import ShardedStoreReader

    return ShardedStoreReader(location, records=view, **options)


def union_positions(store, rows: dict[str, np.ndarray]) -> tuple[torch.Tensor, int]:
    """Positions (as of the last refresh) of the rows named by ``rows`` (key -> global ids),
    in the order given (shard by shard); rows no longer held (evicted) are left out, and
    their number is returned with the positions."""
    start = 0
    parts: list[np.ndarray] = []
    gone = 0
    for key, shard in shard_stores(store):
        first, stop = int(shard.first_row), int(shard.next_row)
        ids = rows.get(key)
        if ids is not None and len(ids):
            ids = np.asarray(ids, dtype=np.int64)
            held = ids >= first
            gone += int((~held).sum())
            parts.append(ids[held] - first + start)
        start += stop - first
    unknown = set(rows) - {key for key, _ in shard_stores(store)}
    gone += sum(len(rows[key]) for key in unknown)
    merged = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return torch.from_numpy(merged), gone


def positions_of(store, names: RowNames) -> torch.Tensor | None:
    """Positions (as of the last refresh) of the rows ``names`` names, in their order: the
    inverse of :func:`row_names` in another process's view of the same buffer. None while the
    view lacks one of them (a shard not seen yet, or a row published after the last refresh).
    Raises when a row is no longer held (evicted since it was named)."""
    start = 0
    spans: dict[str, tuple[int, int, int]] = {}  # key -> (first union position, first id, next id)
    for key, shard in shard_stores(store):
        first, stop = int(shard.first_row), int(shard.next_row)
        spans[key] = (start, first, stop)
        start += stop - first
    positions = np.empty(names.ids.shape[0], dtype=np.int64)
    for index, key in enumerate(names.keys):
        mine = names.shard == index
        if not mine.any():
            continue
        if key not in spans:
            return None
        offset, first, stop = spans[key]
        ids = names.ids[mine]
        if int(ids.max()) >= stop:
            return None
        if int(ids.min()) < first:
            raise RuntimeError(f"row {int(ids.min())} of shard {key!r} was evicted before this data-parallel rank "
                               f"read it (the buffer holds rows from {first} on); give the buffer a larger "
                               f"capacity_rows than the learner's draws run behind the collectors")
        positions[mine] = ids - first + offset
    return torch.from_numpy(positions)
