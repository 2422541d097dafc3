"""Rows that went stale while they waited: sampled within ``learner.max_staleness`` policy
versions of the learner, they may be older than that by the time their step runs (they wait in
the prefetch queue while the learner publishes)."""

from __future__ import annotations

import numpy as np
import torch
from tensordict import TensorDict

from rlhf_pipeline.learn.microbatch import take_rows


def fresh_mask(batch: TensorDict, policy_version: int, max_staleness: int | None) -> np.ndarray:
    """(B,) bool: which rows of ``batch`` are within ``max_staleness`` versions of ``policy_version``."""
    if max_staleness is None:
        return np.ones(batch.batch_size[0], dtype=bool)
    return (batch["policy_version"] >= policy_version - max_staleness).numpy()


def drop_stale(batch: TensorDict, fresh: np.ndarray) -> tuple[TensorDict | None, int]:
    """``batch`` without the rows ``fresh`` rejects (None when none is left), and their count."""
    if fresh.all():
        return batch, 0
    if not fresh.any():
        return None, int(fresh.size)
    return take_rows(batch, torch.from_numpy(np.flatnonzero(fresh))), int((~fresh).sum())
