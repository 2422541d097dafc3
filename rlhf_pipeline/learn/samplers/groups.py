"""The ``groups`` learner sampler (:class:`GroupWindowSampler`): whole GRPO groups from the newest rows,
and zero-variance groups replaced by informative groups kept from earlier steps.

Draw ``d`` (seeded with ``(seed, d)``) keeps the groups that lie whole in the newest ``window`` rows
and are fresh enough for ``max_staleness``, shuffles them and takes groups while they fit in
``batch_size``, so a batch's group statistics are its groups' own. With ``replace_zero_variance`` each
group whose rewards are all equal (no GRPO signal) is replaced by one from a pool of informative groups
seen before, held as row keys, never copies. State (exact resume): ``min_next_row`` and the pool.
Design: docs/curation.md#whole-groups-and-replacing-groups-without-signal.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlhf_pipeline.learn.errors import DataTimeoutError
from rlhf_pipeline.learn.samplers.contract import RowsWait, SampledRows
from rlhf_pipeline.storage.row_keys import keys_of, parts_of, positions_of

_EQUAL = 1e-8  # rewards closer than this count as equal (as charts/frac_reward_zero_std counts them)


@dataclass
class _Group:
    group_id: int
    positions: np.ndarray  # (G,) buffer positions, ascending
    version: int  # oldest policy version among its rows
    std: float  # population std of its rewards
    spread: float  # max - min reward


class GroupWindowSampler:
    """Whole groups from the newest ``window`` rows
    (docs/curation.md#whole-groups-and-replacing-groups-without-signal).

    A draw reads ``group_id``, ``reward`` and ``policy_version`` of the newest ``window`` rows (each
    shard's newest, in a sharded buffer). A group cut by the window's old edge is left out (its row
    just before the window has the same ``group_id``), and so are groups sampled by a policy more than
    ``max_staleness`` versions old; the draw's ``dropped_stale`` counts the window's rows of those.
    ``batch_size`` should be a multiple of the group size; otherwise the batch is the whole groups that
    fit. Zero-variance replacement (the idea of TRL's experimental ``GRPOWithReplayBufferTrainer``): the
    pool holds at most ``pool_groups`` informative groups (reward std > 0) seen in earlier draws, those
    of highest std; a replacement is drawn with probability proportional to its std, among pool groups
    still held by the buffer (eviction drops them), fresh enough, not in the batch already and that fit
    in the rows freed. This draw's informative groups join the pool afterwards, so a batch never
    replaces a group by one of its own; a zero-variance group with no eligible replacement stays.
    Metrics (each draw's ``metrics``, logged under ``charts/``): ``groups_in_batch``,
    ``groups_zero_variance`` (among the fresh groups drawn), ``groups_replaced``, ``replay_pool_groups``.
    Draw ``d`` depends only on ``min_next_row``, the pool, the seed and the rows published."""

    def __init__(self, store, *, batch_size: int, window: int, seed: int, max_staleness: int | None,
                 new_rows_per_draw: int = 0, replace_zero_variance: bool = False, pool_groups: int = 64,
                 min_next_row: int = 0, timeout_s: float = 600.0, poll_s: float = 0.005,
                 stop: threading.Event | None = None) -> None:
        if window < batch_size:
            raise ValueError(f"sample window ({window}) must be >= batch_size ({batch_size})")
        if pool_groups < 1:
            raise ValueError(f"the replay pool must hold at least 1 group, got {pool_groups}")
        self.store = store
        self.batch_size = batch_size
        self.window = window
        self.seed = seed
        self.max_staleness = max_staleness
        self.new_rows_per_draw = new_rows_per_draw
        self.replace_zero_variance = replace_zero_variance
        self.pool_groups = pool_groups
        self.min_next_row = min_next_row
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.stop = stop or threading.Event()
        self.current_version = 0  # set by the learner before each draw: the version it trains with
        self.hurry: threading.Event | None = None  # set while the learner waits for a draw (polling.py)
        # the pool, as row keys: entry k is group_ids[k], its std and oldest version, and rows
        # (parts, rows)[offsets[k]:offsets[k+1]]
        self._pool = _empty_pool()

    # ================================================================ drawing
    def draw(self, draw_index: int) -> SampledRows:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + draw_index)
        deadline = time.monotonic() + self.timeout_s
        wait = RowsWait(self.store, self.poll_s, self.hurry)
        while True:
            version = self.current_version
            n = wait.rows()  # refreshes a read-only store
            next_row = self.store.next_row
            newest = self.store.newest_positions(self.window)
            empty = self._empty_shards()
            if newest.numel() >= self.batch_size and next_row >= self.min_next_row and not empty:
                groups = self._whole_groups(newest.numpy())
                fresh = [g for g in groups if self._fresh(g.version, version)]
                chosen = self._pack(fresh, generator)
                if chosen:
                    stale_rows = sum(g.positions.size for g in groups) - sum(g.positions.size for g in fresh)
                    return self._finish(chosen, generator, version, n, next_row, stale_rows)
            if self.stop.is_set():
                raise InterruptedError("sampling stopped")
            if time.monotonic() > deadline:
                raise DataTimeoutError(
                    f"waited {self.timeout_s:.0f}s for whole groups no more than {self.max_staleness} versions "
                    f"old (learner version {version}) in the newest {self.window} rows of {self.store.location} "
                    f"({n} rows; waiting for row {self.min_next_row}; empty shards: {', '.join(empty) or 'none'}): "
                    f"is a collector running for this run? A group larger than batch_size ({self.batch_size}) never "
                    f"fits: raise learner.batch_size to a multiple of the group size"
                )
            wait.sleep()

    def _finish(self, chosen: list[_Group], generator: torch.Generator, version: int, n: int,
                next_row: int, stale_rows: int) -> SampledRows:
        zero = [i for i, g in enumerate(chosen) if g.spread <= _EQUAL]
        informative = [g for g in chosen if g.spread > _EQUAL]
        replaced = 0
        if self.replace_zero_variance:
            layout = parts_of(self.store)
            replaced = self._replace(chosen, zero, generator, version, layout)
            self._remember(informative, layout)
        if self.new_rows_per_draw:
            self.min_next_row = next_row + self.new_rows_per_draw
        positions = torch.from_numpy(np.concatenate([g.positions for g in chosen]))
        metrics = {
            "charts/groups_in_batch": float(len(chosen)),
            "charts/groups_zero_variance": float(len(zero)),
            "charts/groups_replaced": float(replaced),
            "charts/replay_pool_groups": float(len(self._pool["group_ids"])),
        }
        return SampledRows(positions, stale_rows, n, next_row, version, self.state_dict(), metrics=metrics)

    def _fresh(self, group_version: int, version: int) -> bool:
        return self.max_staleness is None or group_version >= version - self.max_staleness

    def _whole_groups(self, positions: np.ndarray) -> list[_Group]:
        """The groups lying whole in ``positions`` (ascending, in runs of consecutive positions)."""
        rows = self.store.read(torch.from_numpy(positions), fields=("group_id", "reward", "policy_version"))
        group_ids = rows["group_id"].numpy()
        starts = np.flatnonzero(np.diff(positions, prepend=-2) != 1)  # where each run of positions begins
        before = positions[starts] - 1
        before = before[before >= 0]
        cut = self.store.read(torch.from_numpy(before), fields=("group_id",))["group_id"].numpy() \
            if before.size else np.zeros(0, dtype=np.int64)
        whole = ~np.isin(group_ids, cut)
        ids, first, inverse = np.unique(group_ids[whole], return_index=True, return_inverse=True)
        rewards = rows["reward"].numpy()[whole].astype(np.float64)
        versions = rows["policy_version"].numpy()[whole]
        kept_positions = positions[whole]
        out = []
        for k in np.argsort(first, kind="stable").tolist():  # groups in buffer order: deterministic
            mine = inverse == k
            r = rewards[mine]
            out.append(_Group(int(ids[k]), kept_positions[mine], int(versions[mine].min()), float(r.std()),
                              float(r.max() - r.min())))
        return out

    def _pack(self, groups: list[_Group], generator: torch.Generator) -> list[_Group]:
        """Groups in random order, taken while their rows fit in ``batch_size``."""
        chosen, rows = [], 0
        for k in torch.randperm(len(groups), generator=generator).tolist():
            size = groups[k].positions.size
            if rows + size <= self.batch_size:
                chosen.append(groups[k])
                rows += size
            if rows == self.batch_size:
                break
        return chosen

    # ================================================================ the pool
    def _replace(self, chosen: list[_Group], zero: list[int], generator: torch.Generator, version: int,
                 layout) -> int:
        """Replaces the zero-variance groups ``chosen[zero]`` from the pool; returns how many."""
        self._prune(version, layout)
        pool = self._pool
        if not zero or not len(pool["group_ids"]):
            return 0
        in_batch = {g.group_id for g in chosen}
        free = self.batch_size - sum(g.positions.size for g in chosen)
        sizes = np.diff(pool["offsets"])
        weights = pool["std"].copy()
        replaced = 0
        for i in zero:
            room = chosen[i].positions.size + free
            eligible = (sizes <= room) & ~np.isin(pool["group_ids"], list(in_batch)) & (weights > 0)
            if not eligible.any():
                continue
            probabilities = torch.from_numpy(np.where(eligible, weights, 0.0))
            k = int(torch.multinomial(probabilities, 1, generator=generator))
            lo, hi = int(pool["offsets"][k]), int(pool["offsets"][k + 1])
            positions = positions_of(self.store, pool["parts"][lo:hi], pool["rows"][lo:hi], layout)
            free += chosen[i].positions.size - positions.size
            in_batch.add(int(pool["group_ids"][k]))
            chosen[i] = _Group(int(pool["group_ids"][k]), np.sort(positions), int(pool["versions"][k]),
                               float(pool["std"][k]), float("inf"))
            replaced += 1
        return replaced

    def _prune(self, version: int, layout) -> None:
        """Drops pool groups the buffer no longer holds whole, or too stale to train on."""
        pool = self._pool
        if not len(pool["group_ids"]):
            return
        held = positions_of(self.store, pool["parts"], pool["rows"], layout) >= 0
        row_group = np.repeat(np.arange(len(pool["group_ids"])), np.diff(pool["offsets"]))
        whole = np.ones(len(pool["group_ids"]), dtype=bool)
        np.logical_and.at(whole, row_group, held)
        fresh = np.array([self._fresh(int(v), version) for v in pool["versions"]], dtype=bool)
        self._pool = _subset(pool, np.flatnonzero(whole & fresh))

    def _remember(self, groups: list[_Group], layout) -> None:
        """Adds informative groups to the pool, keeping the ``pool_groups`` of highest std (newest on ties)."""
        known = set(self._pool["group_ids"].tolist())
        new = [g for g in groups if g.group_id not in known]
        if not new:
            return
        parts, rows = keys_of(self.store, np.concatenate([g.positions for g in new]), layout)
        sizes = np.array([g.positions.size for g in new], dtype=np.int64)
        added = {
            "group_ids": np.array([g.group_id for g in new], dtype=np.int64),
            "std": np.array([g.std for g in new], dtype=np.float64),
            "versions": np.array([g.version for g in new], dtype=np.int64),
            "offsets": np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
            "parts": parts, "rows": rows,
        }
        pool = _concat(self._pool, added)
        age = np.arange(len(pool["group_ids"]))  # later entries are newer
        keep = np.lexsort((-age, -pool["std"]))[: self.pool_groups]
        self._pool = _subset(pool, np.sort(keep))

    def _empty_shards(self) -> list[str]:
        empty_shards = getattr(self.store, "empty_shards", None)
        return empty_shards() if empty_shards is not None else []

    # ================================================================ state
    def state_dict(self) -> dict[str, Any]:
        pool = {name: torch.from_numpy(values.copy()) for name, values in self._pool.items()}
        return {"min_next_row": int(self.min_next_row), "pool": pool}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.min_next_row = int(state["min_next_row"])
        if "pool" in state:
            self._pool = {name: values.numpy().copy() for name, values in state["pool"].items()}


def _empty_pool() -> dict[str, np.ndarray]:
    return {"group_ids": np.zeros(0, dtype=np.int64), "std": np.zeros(0), "versions": np.zeros(0, dtype=np.int64),
            "offsets": np.zeros(1, dtype=np.int64), "parts": np.zeros(0, dtype=np.int64),
            "rows": np.zeros(0, dtype=np.int64)}


def _subset(pool: dict[str, np.ndarray], entries: np.ndarray) -> dict[str, np.ndarray]:
    sizes = np.diff(pool["offsets"])[entries]
    rows = np.concatenate([np.arange(pool["offsets"][k], pool["offsets"][k + 1]) for k in entries]) \
        if entries.size else np.zeros(0, dtype=np.int64)
    return {"group_ids": pool["group_ids"][entries], "std": pool["std"][entries],
            "versions": pool["versions"][entries], "offsets": np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
            "parts": pool["parts"][rows], "rows": pool["rows"][rows]}


def _concat(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {name: np.concatenate([a[name], b[name]]) for name in ("group_ids", "std", "versions", "parts", "rows")}
    out["offsets"] = np.concatenate([a["offsets"], b["offsets"][1:] + a["offsets"][-1]])
    return out
