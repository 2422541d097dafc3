"""The statistics ``filter`` computes per group and per trajectory, one storage unit at a time.

Each table is built from one chunk of rows (``of_chunk``), the partial tables are combined at the
end (``combine``: a group or a trajectory may straddle chunks), and ``columns_for`` gives every
row its group's or its trajectory's values, the names of ``where.GROUP_NAMES`` and
``where.TRAJECTORY_NAMES``. Memory grows with the number of groups and trajectories, not rows.

Design: docs/curation.md#filter.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


# ====================================================================== group statistics
@dataclass
class GroupTable:
    """Statistics of each group's rewards, by group id (sorted)."""

    ids: np.ndarray  # (G,) int64, sorted
    size: np.ndarray  # (G,) int64
    mean: np.ndarray  # (G,) float64
    m2: np.ndarray  # (G,) float64: sum of squared deviations from the mean
    low: np.ndarray  # (G,) float64
    high: np.ndarray  # (G,) float64

    @classmethod
    def of_chunk(cls, group_ids: np.ndarray, rewards: np.ndarray) -> GroupTable:
        """The partial table of one chunk of rows (two passes over the chunk: exact mean, then m2)."""
        ids, inverse = np.unique(group_ids, return_inverse=True)
        rewards = rewards.astype(np.float64)
        size = np.bincount(inverse, minlength=ids.size)
        mean = np.bincount(inverse, weights=rewards, minlength=ids.size) / np.maximum(size, 1)
        m2 = np.bincount(inverse, weights=(rewards - mean[inverse]) ** 2, minlength=ids.size)
        low = np.full(ids.size, np.inf)
        high = np.full(ids.size, -np.inf)
        np.minimum.at(low, inverse, rewards)
        np.maximum.at(high, inverse, rewards)
        return cls(ids, size, mean, m2, low, high)

    @classmethod
    def combine(cls, partials: list[GroupTable]) -> GroupTable:
        """One table from partials that may hold the same group (a group split across chunks)."""
        if not partials:
            empty_i, empty_f = np.zeros(0, dtype=np.int64), np.zeros(0)
            return cls(empty_i, empty_i, empty_f, empty_f, empty_f, empty_f)
        cat = {name: np.concatenate([getattr(p, name) for p in partials])
               for name in ("ids", "size", "mean", "m2", "low", "high")}
        ids, inverse = np.unique(cat["ids"], return_inverse=True)
        size = np.bincount(inverse, weights=cat["size"], minlength=ids.size)
        mean = np.bincount(inverse, weights=cat["size"] * cat["mean"], minlength=ids.size) / np.maximum(size, 1)
        # pooled: sum of the parts' m2 plus each part's size times its mean's squared distance to the total mean
        spread = cat["m2"] + cat["size"] * (cat["mean"] - mean[inverse]) ** 2
        m2 = np.bincount(inverse, weights=spread, minlength=ids.size)
        low = np.full(ids.size, np.inf)
        high = np.full(ids.size, -np.inf)
        np.minimum.at(low, inverse, cat["low"])
        np.maximum.at(high, inverse, cat["high"])
        return cls(ids, size.astype(np.int64), mean, m2, low, high)

    def columns_for(self, group_ids: np.ndarray) -> dict[str, np.ndarray]:
        """The group statistics (``GROUP_NAMES``) of each row's group."""
        at = np.searchsorted(self.ids, group_ids)
        std = np.sqrt(np.maximum(self.m2, 0.0) / np.maximum(self.size, 1))
        std[self.low == self.high] = 0.0  # all equal: exactly 0, whatever the rounding of m2
        return {
            "group_size": self.size[at],
            "group_reward_mean": self.mean[at],
            "group_reward_std": std[at],
            "group_reward_min": self.low[at],
            "group_reward_max": self.high[at],
        }


@dataclass
class TrajectoryTable:
    """Turns, return, ending and tool use of each trajectory, by trajectory id (sorted)."""

    ids: np.ndarray  # (T,) int64, sorted
    turns: np.ndarray  # (T,) int64
    total_reward: np.ndarray  # (T,) float64
    end: np.ndarray  # (T,) int64: the termination reason (only a done row carries one)
    tool_calls: np.ndarray  # (T,) int64: summed over the turns (0 when the store has no tool counts)
    tool_errors: np.ndarray  # (T,) int64

    @classmethod
    def of_chunk(cls, trajectory_ids: np.ndarray, rewards: np.ndarray, reasons: np.ndarray | None,
                 tool_calls: np.ndarray | None = None, tool_errors: np.ndarray | None = None) -> TrajectoryTable:
        ids, inverse = np.unique(trajectory_ids, return_inverse=True)
        end = np.zeros(ids.size, dtype=np.int64)
        if reasons is not None:
            np.maximum.at(end, inverse, reasons.astype(np.int64))

        def summed(values: np.ndarray | None) -> np.ndarray:
            if values is None:
                return np.zeros(ids.size, dtype=np.int64)
            return np.bincount(inverse, weights=values, minlength=ids.size).astype(np.int64)

        return cls(ids, np.bincount(inverse, minlength=ids.size),
                   np.bincount(inverse, weights=rewards.astype(np.float64), minlength=ids.size), end,
                   summed(tool_calls), summed(tool_errors))

    @classmethod
    def combine(cls, partials: list[TrajectoryTable]) -> TrajectoryTable:
        if not partials:
            empty = np.zeros(0, dtype=np.int64)
            return cls(empty, empty, np.zeros(0), empty, empty, empty)
        ids, inverse = np.unique(np.concatenate([p.ids for p in partials]), return_inverse=True)
        end = np.zeros(ids.size, dtype=np.int64)
        np.maximum.at(end, inverse, np.concatenate([p.end for p in partials]))

        def summed(name: str) -> np.ndarray:
            return np.bincount(inverse, weights=np.concatenate([getattr(p, name) for p in partials]),
                               minlength=ids.size)

        return cls(ids, summed("turns").astype(np.int64), summed("total_reward"), end,
                   summed("tool_calls").astype(np.int64), summed("tool_errors").astype(np.int64))

    def columns_for(self, trajectory_ids: np.ndarray) -> dict[str, np.ndarray]:
        at = np.searchsorted(self.ids, trajectory_ids)
        return {"trajectory_turns": self.turns[at], "trajectory_return": self.total_reward[at],
                "trajectory_end": self.end[at], "trajectory_tool_calls": self.tool_calls[at],
                "trajectory_tool_errors": self.tool_errors[at]}
