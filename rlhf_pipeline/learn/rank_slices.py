"""Which rows each data-parallel rank reads, and the view of the buffer it reads them in.

Rank 0 draws; every rank reads a contiguous slice of the draw (:func:`rank_slice`) from its own
reader of the same buffer. Two things keep the buffer's requests from growing with the ranks:

* **One refresh per step, rank 0's.** For a buffer at a URL the names of a draw carry each shard's
  commit record as rank 0's refresh read it (``RowNames.view``, ``learn/shard_rows.py``). Rank 0
  sends only the records that changed since the draw it shared before (:class:`SharedView`), and
  of those only what the other ranks do not hold (:mod:`.view_changes`); they rebuild the records
  (``DataParallel.received``) and adopt them (:func:`positions_in_view`), so they hold exactly rank
  0's rows, with no LIST and no record GET of their own: they GET only the units of their slice.
  Draws are shared in order, so each rank's view follows rank 0's draw by draw, from the view they
  opened the buffer in: rank 0's records too, sent at setup (``DataParallel.open_buffer``,
  :meth:`SharedView.opened`). A local buffer's ranks refresh their own view (an ``fstat`` per
  shard) until it holds the drawn rows.
* **Shard affinity.** With at least as many shards as ranks, rank 0 orders the draw by owning rank
  (shard ``k`` belongs to rank ``k mod N``: :func:`order_by_owner`), so a rank reads from the same
  shards every step and each unit is fetched by one rank. Rank 0 also reads small fields of the
  whole draw (``done``/``step`` for multi-turn narrowing, ``policy_version`` for the samplers'
  staleness check); a Zarr shard's commit record answers those where a unit holds one value
  (``storage/zarr/unit_constants.py``), so it fetches other ranks' units only for multi-turn rows
  or a unit of mixed versions. The global batch is the draw the sampler made (the exact sampler's
  even share per shard); only which rank trains which row changes. With fewer shards than ranks
  the slices are equal, in draw order.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import TYPE_CHECKING

import torch

from rlhf_pipeline.learn.samplers import DataTimeoutError
from rlhf_pipeline.learn.shard_rows import RowNames, View, adopt_view, positions_of, shard_stores
from rlhf_pipeline.learn.view_changes import ViewChanges, pack_changes

if TYPE_CHECKING:
    from rlhf_pipeline.learn.samplers import SampledRows


def rank_slice(values: torch.Tensor, rank: int, world_size: int,
               rank_rows: list[int] | None = None) -> tuple[torch.Tensor, bool]:
    """Rank ``rank``'s contiguous slice of a draw's per-row ``values`` and whether it is a filler
    (an empty slice replaced by the draw's first row, trained with weight 0). ``rank_rows``: each
    rank's rows in rank order (a draw :func:`order_by_owner` ordered); None: slices of equal size."""
    if rank_rows is None:
        mine = torch.tensor_split(values, world_size)[rank]
    else:
        start = sum(rank_rows[:rank])
        mine = values[start:start + rank_rows[rank]]
    if mine.numel() == 0:
        return values[:1], True
    return mine, False


def order_by_owner(sampled: SampledRows, store, world_size: int) -> SampledRows:
    """``sampled`` with each rank's rows together, in rank order (``rank_rows`` set): rank ``r`` owns
    shard ``k`` when ``k mod world_size == r``. Within a rank the draw's order is kept. Unchanged with
    fewer shards than ranks (some rank would own none) or an empty draw."""
    if len(shard_stores(store)) < world_size or sampled.positions.numel() == 0:
        return sampled
    shard_indices, _ = store.locate(sampled.positions)
    owner = shard_indices % world_size
    order = torch.sort(owner, stable=True).indices
    return dataclasses.replace(
        sampled, positions=sampled.positions[order],
        weights=None if sampled.weights is None else sampled.weights[order],
        trajectory_steps=None if sampled.trajectory_steps is None else sampled.trajectory_steps[order],
        rank_rows=torch.bincount(owner, minlength=world_size).tolist())


class SharedView:
    """Rank 0's record of what it has shared: each shard's commit record as the other ranks hold it."""

    def __init__(self) -> None:
        self._shared: View = {}

    def changes(self, names: RowNames) -> RowNames:
        """``names`` carrying only the records of the shards that changed since the last draw shared
        (or since the opening shared: :meth:`opened`), packed (:mod:`.view_changes`): the other ranks
        keep the rest, and the parts of these they hold. They unpack it with
        :meth:`DataParallel.received <rlhf_pipeline.learn.distributed.DataParallel.received>`."""
        if names.view is None:
            return names
        # a refresh replaces a record, so an unchanged one is often the same object: compared first
        changed = {key: record for key, record in names.view.items() if self._shared.get(key) != record}
        packed = pack_changes(changed, self._shared)
        self._shared.update(changed)
        return dataclasses.replace(names, view=packed)

    def opened(self, view: View) -> ViewChanges:
        """What to send the other ranks so they open the buffer in ``view`` (every shard's record)."""
        self._shared = dict(view)
        return pack_changes(view, {})


def positions_in_view(store, names: RowNames, *, stop: threading.Event, timeout_s: float) -> torch.Tensor:
    """Positions of ``names`` in this rank's view of the buffer. With the records rank 0 drew them in
    (``names.view``) the view adopts those: no request. Otherwise it is refreshed until it holds
    every one of them: rank 0 may have drawn rows published after this rank's last refresh."""
    if isinstance(names.view, ViewChanges):
        raise TypeError("these names carry rank 0's records packed: unpack them first (DataParallel.received)")
    if names.view is not None:
        adopt_view(store, names.view)
        positions = positions_of(store, names)
        if positions is None:
            raise RuntimeError(f"this data-parallel rank's view of {store.location} lacks rows rank 0 drew even "
                               f"with rank 0's commit records: do all ranks read the same buffer?")
        return positions
    deadline = time.monotonic() + timeout_s
    while True:
        store.refresh()
        positions = positions_of(store, names)
        if positions is not None:
            return positions
        if stop.is_set():
            raise InterruptedError("data-parallel rank stopped while waiting for rank 0's rows")
        if time.monotonic() > deadline:
            raise DataTimeoutError(f"this data-parallel rank's view of {store.location} lacked rows rank 0 "
                                   f"drew for {timeout_s:.0f}s (learner.data_timeout_s): is the buffer on a "
                                   f"file system every rank sees the same way?")
        time.sleep(0.01)
