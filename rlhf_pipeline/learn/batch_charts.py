"""The ``charts/...`` a learner step logs: about the rows it trained on (rewards, advantages,
lengths, staleness, which collectors fed it; :func:`batch_charts`) and about the run so far
(speed, waiting, stale rows, rows generated against rows trained; :func:`run_charts`)."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rlhf_pipeline.learn.metrics import group_reward_stats
from rlhf_pipeline.learn.usage import staleness_metrics
from rlhf_pipeline.schema.ids import collector_index_of


def batch_charts(rows: TensorDict, policy_version: int) -> dict[str, float]:
    """``rows``: one value a row (every rank's rows under data parallelism, on the CPU);
    ``policy_version``: the learner's version when it trained on them."""
    staleness = (policy_version - rows["policy_version"]).float()
    row_versions = rows["policy_version"]  # the versions that sampled the rows: how off-policy the batch is
    charts = group_reward_stats(rows["next", "reward"].reshape(-1), rows["group_id"])
    if "sequence_advantage" in rows.keys():
        advantage = rows["sequence_advantage"]
        charts["charts/advantage_mean"] = float(advantage.mean())
        charts["charts/advantage_std"] = float(advantage.std()) if advantage.numel() > 1 else 0.0
    # ids carry their collector's index in the high bits: how many collectors fed this batch
    charts["charts/collectors_in_batch"] = float(torch.unique(collector_index_of(rows["group_id"])).numel())
    if "sample_weight" in rows.keys():
        charts["charts/importance_weight_mean"] = float(rows["sample_weight"].mean())
        charts["charts/importance_weight_min"] = float(rows["sample_weight"].min())
    lengths = rows["response_lengths"].float()
    charts.update({
        "charts/response_length_mean": float(lengths.mean()),
        "charts/response_length_max": float(lengths.max()),
        "charts/staleness_mean": float(staleness.mean()),
        "charts/staleness_max": float(staleness.max()),
        "charts/row_version_min": float(row_versions.min()),
        "charts/row_version_max": float(row_versions.max()),
        "charts/row_version_spread": float(row_versions.max() - row_versions.min()),
        **staleness_metrics(staleness),  # mean and max again, median, p90, fraction 0 / 1 / 2 / 3+ stale
    })
    return charts


def run_charts(tokens: float, elapsed_s: float, waited_s: float, dropped: int, sampled, progress, *,
               rows_trained: int) -> dict[str, float]:
    """``tokens``: the step's prompt + response tokens; ``sampled``: its draw (``SampledRows``);
    ``progress``: the learner's ``Progress`` after the step; ``rows_trained``: distinct rows so far."""
    return {
        "charts/tokens_per_s": tokens / max(elapsed_s + waited_s, 1e-9),
        "charts/data_wait_s": waited_s,
        "charts/rows_dropped_stale": float(dropped),
        "charts/rows_dropped_stale_total": float(progress.rows_dropped_stale),
        "charts/policy_version": float(progress.policy_version),
        "charts/buffer_rows": float(sampled.buffer_rows),
        # waste: rows ever written to the buffer over the distinct rows trained on so far
        "charts/rows_generated": float(sampled.buffer_next_row),
        "charts/rows_trained": float(rows_trained),
        "charts/rows_generated_per_row_trained": sampled.buffer_next_row / max(rows_trained, 1),
        "charts/step_time_s": elapsed_s,
        **sampled.metrics,
    }
