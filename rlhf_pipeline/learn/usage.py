"""How much of what was generated the learner trains on, and how old it is when it does.

Two things a user paying for generation wants to see per step (``charts/`` in metrics.jsonl
and TensorBoard):

* **waste**: ``rows_generated`` (rows ever written to the buffer, all shards) over
  ``rows_trained`` (distinct rows that went into at least one loss). 1.0 means every
  generated row was trained on; a row drawn twice counts once. :class:`TrainedRows` keeps
  one bit per stored row (per shard, by global id; ``learn/shard_rows.py``), so the count
  is exact and costs 1 MB per 8 million rows; it resumes from the learner's checkpoint.
* **staleness**: per step, the learner's policy version minus the version that sampled each
  row: mean, median, 90th percentile, max, and the fraction of rows 0, 1, 2 and 3+ versions
  old (:func:`staleness_metrics`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

STALENESS_BUCKETS = (0, 1, 2)  # fractions of rows exactly this stale, plus one for the rest


class TrainedRows:
    """Which stored rows have gone into a loss: a bitmap per shard over its global row ids."""

    def __init__(self) -> None:
        self._bits: dict[str, np.ndarray] = {}  # shard key -> packed bits (uint8), bit i = global row i
        self.count = 0

    def mark(self, rows: dict[str, np.ndarray]) -> int:
        """Marks ``rows`` (shard key -> global ids) as trained on; returns how many were new."""
        new = 0
        for key, ids in rows.items():
            ids = np.unique(np.asarray(ids, dtype=np.int64))
            if not len(ids):
                continue
            bits = self._bits.get(key, np.zeros(0, dtype=np.uint8))
            needed = int(ids[-1]) // 8 + 1
            if needed > len(bits):
                grown = np.zeros(max(needed, 2 * len(bits)), dtype=np.uint8)
                grown[: len(bits)] = bits
                bits = grown
            byte, mask = ids // 8, (1 << (ids % 8)).astype(np.uint8)
            fresh = (bits[byte] & mask) == 0
            new += int(fresh.sum())
            np.bitwise_or.at(bits, byte, mask)
            self._bits[key] = bits
        self.count += new
        return new

    def state_dict(self) -> dict[str, Any]:
        # tensors, not arrays: checkpoints load with weights_only=True (state_files.py)
        return {"count": self.count, "bits": {key: torch.from_numpy(bits.copy()) for key, bits in self._bits.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = int(state["count"])
        self._bits = {str(key): np.array(bits, dtype=np.uint8) for key, bits in state["bits"].items()}


def staleness_metrics(staleness: torch.Tensor) -> dict[str, float]:
    """Distribution of per-row staleness (versions) in one step's batch."""
    values = staleness.to(torch.float32).reshape(-1)
    if not values.numel():
        return {}
    out = {
        "charts/staleness_mean": float(values.mean()),
        "charts/staleness_p50": float(values.quantile(0.5)),
        "charts/staleness_p90": float(values.quantile(0.9)),
        "charts/staleness_max": float(values.max()),
    }
    for bucket in STALENESS_BUCKETS:
        out[f"charts/staleness_frac_{bucket}"] = float((values == bucket).float().mean())
    out[f"charts/staleness_frac_{STALENESS_BUCKETS[-1] + 1}plus"] = float(
        (values > STALENESS_BUCKETS[-1]).float().mean())
    return out
