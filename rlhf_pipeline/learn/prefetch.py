"""Learner-side data: which rows a step samples, and a thread that prepares them ahead of time.

``FreshRowSampler`` makes draw ``d`` from the newest ``window`` rows of a store that another
process may be appending to (opened read-only; every draw refreshes it). Over a sharded
buffer (one store per collector) the window takes an even share of each shard's newest rows
(``ShardedStoreReader.newest_positions``), row counts (``new_rows_per_draw``) are summed
over all shards, and no draw is made while a shard is still empty: a collector that starts
a little later than the others would otherwise miss the first steps, which would train on
the other collectors' prompts alone. Its randomness
comes from a generator seeded with ``(seed, d)``, so draw ``d`` picks the same rows whether or
not the run was interrupted before it: the draw count and the buffer position the next draw
waits for (``min_next_row``) are its whole state, kept in the learner's ``Progress``.

Update-to-data ratio: with ``new_rows_per_draw = n > 0`` a draw waits until the buffer holds
``n`` rows more than at the previous draw, so rows are reused about ``batch_size / n`` times
on average; 0 never waits (offline replay over a recorded buffer).

Off-policy control: a row sampled by a policy more than ``max_staleness`` versions older
than the learner's current version is not used; it is counted in ``dropped_stale``. When
the window holds too few fresh rows the sampler waits for the collector to write more
(the wait is reported as data-wait time), and gives up with a clear error after
``timeout_s``.

A draw names rows by their store positions; the learner then reads them straight into its
padded batch (``PaddedCollator.read`` -> ``store.read_padded``, the fused path), so only the
``policy_version`` column is read to check staleness.

``Prefetcher`` runs ``produce(step)`` (sample + pad) in a background thread ``depth``
steps ahead, so the model does not wait on disk reads and padding. On CUDA the learner's
``produce`` pins the padded batch in this thread, and the learner copies it to the device
with ``non_blocking=True``, so the copy overlaps with compute.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


class DataTimeoutError(RuntimeError):
    """The buffer held too few usable rows for longer than the learner's data timeout."""


@dataclass
class SampledRows:
    positions: torch.Tensor  # (batch_size,) store positions, valid until the store's next refresh
    dropped_stale: int  # rows drawn but rejected as too stale
    buffer_rows: int  # rows in the buffer when drawn
    buffer_next_row: int
    version: int  # learner version the staleness check used
    min_next_row: int = 0  # where the following draw waits


class FreshRowSampler:
    """Draws ``batch_size`` distinct rows from the newest ``window`` rows, skipping stale ones."""

    def __init__(self, store, *, batch_size: int, window: int, seed: int,
                 max_staleness: int | None, new_rows_per_draw: int = 0, min_next_row: int = 0,
                 timeout_s: float = 600.0, poll_s: float = 0.05,
                 stop: threading.Event | None = None) -> None:
        if window < batch_size:
            raise ValueError(f"sample window ({window}) must be >= batch_size ({batch_size})")
        self.store = store
        self.batch_size = batch_size
        self.window = window
        self.seed = seed
        self.max_staleness = max_staleness
        self.new_rows_per_draw = new_rows_per_draw
        self.min_next_row = min_next_row  # the next draw waits until the store reaches it
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.stop = stop or threading.Event()
        self.current_version = 0  # set by the learner after each publish

    def draw(self, draw_index: int) -> SampledRows:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + draw_index)
        deadline = time.monotonic() + self.timeout_s
        dropped = 0
        while True:
            version = self.current_version
            n = len(self.store)  # refreshes a read-only store
            next_row = self.store.next_row
            # the newest rows: a store's last positions; across shards, some of each shard's newest
            newest = self.store.newest_positions(self.window)
            empty = self._empty_shards()
            if newest.numel() >= self.batch_size and next_row >= self.min_next_row and not empty:
                order = newest[torch.randperm(newest.numel(), generator=generator)]
                kept, stale = self._fresh_positions(order, version)
                dropped += stale
                if kept is not None:
                    if self.new_rows_per_draw:
                        self.min_next_row = next_row + self.new_rows_per_draw
                    return SampledRows(kept, dropped, n, next_row, version, self.min_next_row)
            if self.stop.is_set():
                raise InterruptedError("sampling stopped")
            if time.monotonic() > deadline:
                if empty:
                    raise DataTimeoutError(
                        f"waited {self.timeout_s:.0f}s for rows in {', '.join(empty)} of "
                        f"{self.store.location}, which the learner samples along with the other "
                        f"shards: start its collector (`rlhf-pipeline collect PIPELINE --collector-index "
                        f"K`), or remove the empty shard directory if that collector will not run"
                    )
                raise DataTimeoutError(
                    f"waited {self.timeout_s:.0f}s for {self.batch_size} rows no more than "
                    f"{self.max_staleness} versions old (learner version {version}) in the newest "
                    f"{self.window} rows of {self.store.location} ({n} rows; waiting for row "
                    f"{self.min_next_row}): is a collector running "
                    f"for this run? (raise learner.data_timeout_s, or max_staleness for offline replay)"
                )
            time.sleep(self.poll_s)

    def _empty_shards(self) -> list[str]:
        empty_shards = getattr(self.store, "empty_shards", None)
        return empty_shards() if empty_shards is not None else []

    def _fresh_positions(self, order: torch.Tensor, version: int) -> tuple[torch.Tensor | None, int]:
        """The first ``batch_size`` candidates of ``order`` fresh enough to use, and how many
        stale ones were passed over (only ``policy_version`` is read to tell)."""
        if self.max_staleness is None:
            return order[: self.batch_size], 0
        picked: list[torch.Tensor] = []
        have = stale = 0
        for start in range(0, order.numel(), self.batch_size):
            chunk = order[start: start + self.batch_size]
            versions = self.store.read(chunk, fields=("policy_version",))["policy_version"]
            fresh = versions >= version - self.max_staleness
            stale += int((~fresh).sum())
            picked.append(chunk[fresh][: self.batch_size - have])
            have += picked[-1].numel()
            if have == self.batch_size:
                return torch.cat(picked), stale
        return None, stale


class Prefetcher:
    """Runs ``produce(i)`` for ``i = start, start+1, ...`` in a thread, ``depth`` items ahead."""

    def __init__(self, produce: Callable[[int], Any], start_step: int, *, depth: int = 2,
                 stop: threading.Event | None = None) -> None:
        self._produce = produce
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = stop or threading.Event()
        self._thread = threading.Thread(target=self._work, args=(start_step,), daemon=True,
                                        name="learner-prefetch")
        self._thread.start()

    def _work(self, step: int) -> None:
        while not self._stop.is_set():
            try:
                item = (step, self._produce(step), None)
            except BaseException as exc:  # handed to the consumer, which re-raises it
                item = (step, None, exc)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return
            step += 1

    def next(self) -> tuple[int, Any, float]:
        """``(i, item, seconds the caller waited for it)``; re-raises the producer's error.

        Raises InterruptedError once the stop event is set while nothing is queued: the
        producer drops what it was making when stopped, so waiting on could never end.
        """
        start = time.perf_counter()
        while True:
            try:
                step, item, exc = self._queue.get(timeout=0.1)
                break
            except queue.Empty:
                if self._stop.is_set() or not self._thread.is_alive():
                    raise InterruptedError("prefetching stopped") from None
        waited = time.perf_counter() - start
        if exc is not None:
            raise exc
        return step, item, waited

    def close(self) -> None:
        self._stop.set()
        # drain so a producer blocked on a full queue sees the stop flag
        while self._thread.is_alive():
            try:
                self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.1)
