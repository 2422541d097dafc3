"""Rows that went stale while they waited: sampled within ``learner.max_staleness`` policy
versions of the learner, they may be older than that by the time their step runs (they wait in
the prefetch queue while the learner publishes).

Which version a draw's staleness is checked against (:class:`DrawVersions`). The sampler checks
it as it makes the draw, on the prefetch thread, while the training thread publishes: the
version the learner happened to hold at that moment depended on whether the rows came before or
after the publish, so a resumed run (its collector had already written them) and a run under
another load passed over other rows. The training thread tells the prefetch thread the version
each draw will be trained with instead, once it has taken in the draw before; a sampler that
checks staleness makes draw ``d`` only then (one draw of overlap with the step in progress).
"""

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
