"""pass@k and the summary of one (version, set) evaluation.

pass@k is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on
Code", eq. 1): with ``n`` samples of a prompt of which ``c`` pass, ``1 - C(n - c, k) / C(n, k)``,
averaged over prompts. pass@1 is then the mean pass rate; with greedy decoding (one sample) it is
the share of prompts answered. mean_score is the mean score over every completion.
Design: docs/evaluation.md#scores.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of ``k`` samples drawn from ``n`` (``c`` passing) passes."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def summarize(set_name: str, scores: Sequence[Sequence[float]], pass_score: float,
              episode_counts: Mapping[str, float] | None = None) -> dict[str, float]:
    """``eval/<set>/pass@1``, ``eval/<set>/pass@<k>`` (k > 1 samples), ``eval/<set>/mean_score`` and
    ``eval/<set>/prompts`` of ``scores`` (one list of sample scores per prompt); agents' ``episode_counts``
    (turns, tool calls, failed calls: totals) become per-episode means."""
    k = len(scores[0])
    passed = [sum(s >= pass_score for s in prompt) for prompt in scores]
    out = {f"eval/{set_name}/pass@1": sum(pass_at_k(k, c, 1) for c in passed) / len(scores)}
    if k > 1:
        out[f"eval/{set_name}/pass@{k}"] = sum(pass_at_k(k, c, k) for c in passed) / len(scores)
    out[f"eval/{set_name}/mean_score"] = sum(map(sum, scores)) / (k * len(scores))
    out[f"eval/{set_name}/prompts"] = float(len(scores))
    for name, total in (episode_counts or {}).items():
        out[f"eval/{set_name}/{name}_per_episode"] = total / (k * len(scores))
    return out
