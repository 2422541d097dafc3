"""The metrics of one agent round (``Collector.last_metrics`` over ``Environments``, and each hook's argument): rows,
rewards, turns, tool calls, what failed, the engine's figures, and how much of the round the engine
had work (``generate_s``, ``engine_idle_share``)."""

from __future__ import annotations

from typing import Any

import torch

from rlhf_pipeline.agents.rollout import Rollout
from rlhf_pipeline.schema import TrajectoryBatch


def round_metrics(collector: Any, result: Rollout, batch: TrajectoryBatch | None, elapsed: float,
                  generate_s: float) -> dict[str, float]:
    """``collector``'s (a :class:`~.collector.Collector` over episodes with environments) metrics of the
    round it just wrote.

    ``generate_s``: seconds the engine had at least one turn to sample (from a turn's submission
    until none is in flight); ``engine_idle_share`` the
    rest of the round (environments working, rows written), as a share of ``round_s``."""
    episodes, m = result.episodes, result.metrics
    n = max(len(episodes), 1)  # every group dropped: the per-episode figures are 0
    returns = torch.tensor([sum(e.rewards) for e in episodes] or [0.0], dtype=torch.float64)  # (n,)
    g = collector.config.group_size
    group_std = returns.reshape(-1, g).std(dim=1, unbiased=False) if g > 1 and episodes else torch.zeros(1)
    turns = torch.tensor([len(e.turns) for e in episodes] or [0], dtype=torch.float64)
    calls = [sum(len(t.tool_calls) for t in e.turns) for e in episodes]
    rows = 0 if batch is None else len(batch)
    metrics = {
        "rows": float(rows),
        "rows_per_s": rows / max(elapsed, 1e-9),
        "round_s": elapsed,
        "generate_s": generate_s,
        "engine_idle_share": max(0.0, 1.0 - generate_s / max(elapsed, 1e-9)),
        "reward_mean": float(returns.mean()),
        "reward_std": float(returns.std(unbiased=False)),
        "groups_with_signal": float((group_std > 0).double().mean()),
        "turns_per_episode": float(turns.mean()),
        "turns_max": float(turns.max()),
        "tool_call_rate": sum(c > 0 for c in calls) / n,  # episodes that called a tool at least once
        "tool_calls_per_episode": sum(calls) / n,
        "sampled_tokens_per_episode": 0.0 if batch is None else float(batch["response_tokens"].lengths().sum()) / n,
        "groups_dropped": float(m["groups_dropped"]),
        "generation_batches": float(m["generation_batches"]),
        "retokenization_drift": float(m["retokenization_drift"]),
        "template_mismatch": float(m["template_mismatch"]),
        "environment_timeouts": float(m["environment_timeouts"]),
    }
    for name, count in sorted(m.items()):  # reason/env_done..., tools/ok, dropped/step_failed...
        if name.startswith(("reason/", "tools/", "dropped/")):
            metrics[name] = float(count)
    return metrics
