"""The ``window`` learner sampler (:class:`FreshRowSampler`): each step draws from the newest rows of a
buffer being written.

Draw ``d`` takes ``batch_size`` distinct rows uniformly from the newest ``window`` rows (an even share
of each shard's newest; no draw while a shard is still empty), seeded with ``(seed, d)``: the draw
count and ``min_next_row`` are its whole state. With ``new_rows_per_draw = n > 0`` a draw waits for
``n`` new rows (rows are reused about ``batch_size / n`` times); rows more than ``max_staleness``
versions old are skipped and counted (``dropped_stale``), and the sampler waits for fresh rows until
``timeout_s``. Design: docs/learner.md#which-rows-a-step-trains-on.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from rlhf_pipeline.learn.errors import DataTimeoutError
from rlhf_pipeline.learn.samplers.contract import RowsWait, SampledRows


class FreshRowSampler:
    """Draws ``batch_size`` distinct rows from the newest ``window`` rows, skipping stale ones.

    The store is opened read-only and refreshed at every draw; another process may be appending to it.
    Over a sharded buffer (one store per collector) the window takes an even share of each shard's
    newest rows (``ShardedStoreReader.newest_positions``) and ``new_rows_per_draw`` counts rows summed
    over all shards; no draw is made while a shard is still empty, since a collector that starts a
    little later than the others would otherwise miss the first steps, which would train on the other
    collectors' prompts alone. ``new_rows_per_draw=0`` never waits. Only the ``policy_version`` column
    is read to check staleness; when the window holds too few fresh rows the sampler waits for more
    (reported as data-wait time) and gives up with a clear error after ``timeout_s``."""

    def __init__(self, store, *, batch_size: int, window: int, seed: int,
                 max_staleness: int | None, new_rows_per_draw: int = 0, min_next_row: int = 0,
                 timeout_s: float = 600.0, poll_s: float = 0.005,
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
        self.current_version = 0  # set by the learner before each draw: the version it trains with
        self.hurry: threading.Event | None = None  # set while the learner waits for a draw (polling.py)

    def draw(self, draw_index: int) -> SampledRows:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + draw_index)
        deadline = time.monotonic() + self.timeout_s
        wait = RowsWait(self.store, self.poll_s, self.hurry)
        dropped = 0
        while True:
            version = self.current_version
            n = wait.rows()  # refreshes a read-only store
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
                    return SampledRows(kept, dropped, n, next_row, version, self.state_dict())
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
            wait.sleep()

    def state_dict(self) -> dict[str, Any]:
        return {"min_next_row": int(self.min_next_row)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.min_next_row = int(state["min_next_row"])

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
