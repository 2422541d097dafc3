"""The replay sampler (:class:`EpochSampler`): epochs over a recorded buffer, every row once per epoch.

It walks the rows the store holds when it is built (or ``learner.epoch_rows`` of them); draw ``d`` is
batch ``d mod K`` of epoch ``d div K``, ``K = ceil(rows / batch_size)``, and an epoch's last batch is
partial, so every row is used exactly once per epoch. Orders (``learner.epoch_order``): ``shuffle``
(storage units shuffled, cut into windows of ``shuffle_window_rows``, rows shuffled within each),
``sequential``, ``with-replacement``. Seeded by ``(seed, e)`` or ``(seed, d)``: draw ``d`` is the same
rows whether or not the run was interrupted. No staleness bound: the rows' versions are another run's.
Design: docs/replay.md#epochs.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from rlhf_pipeline.learn.errors import NoRowsToReplay
from rlhf_pipeline.learn.samplers.contract import SampledRows

ORDERS = ("shuffle", "sequential", "with-replacement")


def shuffled_order(unit_bounds: list[tuple[int, int]], window_rows: int,
                   generator: torch.Generator) -> torch.Tensor:
    """A permutation of the rows the units cover: units shuffled, grouped into windows of at
    least ``window_rows`` rows (0: one window), rows shuffled within each window."""
    if not unit_bounds:
        return torch.zeros(0, dtype=torch.int64)
    unit_order = torch.randperm(len(unit_bounds), generator=generator).tolist()
    windows: list[list[torch.Tensor]] = [[]]
    held = 0
    for u in unit_order:
        start, stop = unit_bounds[u]
        if window_rows and held >= window_rows:
            windows.append([])
            held = 0
        windows[-1].append(torch.arange(start, stop, dtype=torch.int64))
        held += stop - start
    parts = []
    for window in windows:
        rows = torch.cat(window)
        parts.append(rows[torch.randperm(rows.numel(), generator=generator)])
    return torch.cat(parts)


class EpochSampler:
    """Epochs without (or with) replacement over a fixed snapshot of a store (docs/replay.md#epochs).

    The snapshot is positions ``[0, rows)``: ``rows`` given, or all rows held when it is built (rows
    written later are not part of the replay; a saved selection or a finished run's buffer does not
    grow anyway). ``shuffle`` reads a window unit by unit (:meth:`TrajectoryStore.unit_bounds`:
    memmap segments, Zarr units, shards one after the other), so a Zarr store decodes each unit once
    per epoch while the window's units fit in its ``cache_bytes``; ``shuffle_window_rows=0`` always
    shuffles the whole buffer. ``with-replacement`` takes ``batch_size`` positions uniformly per draw
    (repeats allowed), all batches full; an "epoch" is still ``K`` draws. The state a resumed run
    needs is the snapshot (row count, first row, unit bounds), checked against the store on resume,
    and the draw count (in the learner's ``Progress``). Settings that touch neither (loss, learning
    rate) leave the rows of every step unchanged: that is how two algorithms are compared on
    identical data. Staleness does not apply: the rows carry the policy versions of the run that
    recorded them, unrelated to this learner's, so no row is ever rejected."""

    def __init__(self, store, *, batch_size: int, order: str = "shuffle", seed: int = 0, rows: int | None = None,
                 shuffle_window_rows: int = 65_536, stop: threading.Event | None = None) -> None:
        if order not in ORDERS:
            raise ValueError(f"learner setting 'epoch_order' must be one of {list(ORDERS)}, got {order!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if shuffle_window_rows < 0:
            raise ValueError(f"shuffle_window_rows must be >= 0, got {shuffle_window_rows}")
        self.store = store
        self.batch_size = batch_size
        self.order = order
        self.seed = seed
        self.shuffle_window_rows = shuffle_window_rows
        self.stop = stop or threading.Event()
        self.current_version = 0  # set by the learner; never used to reject rows (see the docstring)
        held = len(store)  # a read-only store refreshes here: the snapshot is the rows published now
        if held == 0:
            raise NoRowsToReplay(f"{store.location} holds no rows: there is nothing to replay (learner.sampler=epoch "
                                 f"walks the rows a buffer holds when the learner starts)")
        if rows is not None and rows > held:
            raise ValueError(f"{store.location} holds {held} rows, fewer than the {rows} this replay walks "
                             f"(learner.epoch_rows): was it replaced or evicted since the replay started?")
        rows = held if rows is None else rows
        self._snapshot(rows, store.first_row, store.unit_bounds())
        self._epoch: tuple[int, torch.Tensor] | None = None  # the order of the epoch drawn last

    def _snapshot(self, rows: int, first_row: int, unit_bounds: list[tuple[int, int]]) -> None:
        self.rows = int(rows)
        self.first_row = int(first_row)
        # units cut at the snapshot's end: rows appended later are not replayed
        self.unit_bounds = [(int(a), min(int(b), self.rows)) for a, b in unit_bounds if a < self.rows]
        covered = sum(b - a for a, b in self.unit_bounds)
        if covered != self.rows:
            raise ValueError(f"{self.store.location}: unit bounds cover {covered} of {self.rows} rows")
        self.batches_per_epoch = -(-self.rows // self.batch_size)

    # ------------------------------------------------------------------ draws
    def draw(self, draw_index: int) -> SampledRows:
        if self.stop.is_set():
            raise InterruptedError("sampling stopped")
        epoch, k = divmod(draw_index, self.batches_per_epoch)
        if self.order == "with-replacement":
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + draw_index)
            positions = torch.randint(0, self.rows, (self.batch_size,), generator=generator)
        else:
            order = self.epoch_order(epoch)
            positions = order[k * self.batch_size: (k + 1) * self.batch_size]
        return SampledRows(positions, 0, self.rows, self.first_row + self.rows, self.current_version,
                           self.state_dict())

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The positions of epoch ``epoch`` in the order they are drawn (``shuffle``/``sequential``)."""
        if self._epoch is not None and self._epoch[0] == epoch:
            return self._epoch[1]
        if self.order == "sequential":
            order = torch.arange(self.rows, dtype=torch.int64)
        else:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = shuffled_order(self.unit_bounds, self.shuffle_window_rows, generator)
        self._epoch = (epoch, order)
        return order

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "first_row": self.first_row, "unit_bounds": self.unit_bounds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the snapshot of the first start; the store must still hold those rows."""
        if "rows" not in state:
            raise ValueError(
                "the checkpoint's sampler state is not an epoch sampler's (it was made with another "
                "learner.sampler); resume with the sampler the run started with"
            )
        if self.store.first_row != int(state["first_row"]) or len(self.store) < int(state["rows"]):
            raise ValueError(
                f"{self.store.location} no longer holds the rows this replay started with (rows "
                f"[{state['first_row']}, {int(state['first_row']) + int(state['rows'])}) by global id; it "
                f"holds [{self.store.first_row}, {self.store.next_row})): rows were evicted since. Replay a "
                f"copy that keeps them (`rlhf-pipeline convert SRC DST`)"
            )
        self._snapshot(int(state["rows"]), int(state["first_row"]), [tuple(b) for b in state["unit_bounds"]])
        self._epoch = None
