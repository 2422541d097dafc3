"""Per-token KL to the reference and the KL-shaped token reward, on the write path (:class:`KLReward`).
Per response token, with ``logp`` the sampling log-prob and ``ref`` the reference's, one of Schulman's
estimators gives ``kl``: ``k1 = logp - ref``, ``k2 = 0.5 * (logp - ref) ** 2`` or
``k3 = exp(ref - logp) - (ref - logp) - 1``; ``token_rewards = -coef * kl`` with the row's ``reward``
added on its last response token; ``reward`` is untouched. The coefficient is fixed or adaptive
(:class:`AdaptiveKLController`, Ziegler et al. 2019), part of ``state_dict()``. Why it does not meet the
advantage: docs/architecture.md#the-write-path-transforms; the estimators and the controller:
docs/write-path.md#the-transforms.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch

from rlhf_pipeline.schema.ragged import RaggedTensor
from rlhf_pipeline.schema import TrajectoryBatch, TrajectoryValidationError
from rlhf_pipeline.transforms.write_path import WritePathTransform

Estimator = Literal["k1", "k2", "k3"]


# ============================================================================ pure math
def kl_k1(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return log_probs - ref_log_probs


def kl_k2(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return 0.5 * (log_probs - ref_log_probs).square()


def kl_k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    diff = ref_log_probs - log_probs
    return torch.expm1(diff) - diff  # expm1 keeps precision when diff is near 0


ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_token_rewards(
    log_probs: RaggedTensor,
    ref_log_probs: RaggedTensor,
    reward: torch.Tensor,
    *,
    coef: float,
    estimator: Estimator = "k1",
) -> tuple[RaggedTensor, RaggedTensor]:
    """Returns ``(kl, token_rewards)``, both aligned with the response; see the module docstring."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {list(ESTIMATORS)}, got {estimator!r}")
    if not torch.equal(log_probs.offsets, ref_log_probs.offsets):
        lengths, ref_lengths = log_probs.lengths(), ref_log_probs.lengths()
        bad = torch.nonzero(lengths != ref_lengths) if lengths.numel() == ref_lengths.numel() else torch.zeros(1, 1)
        raise TrajectoryValidationError(
            "ref_log_probs is not aligned with response_log_probs (one value per response token); "
            "recompute it with ReferenceLogProbs", row=int(bad[0]) if bad.numel() else None, field="ref_log_probs")
    kl = ESTIMATORS[estimator](log_probs.values.float(), ref_log_probs.values.float())
    token_rewards = -coef * kl
    lengths = log_probs.lengths()
    if bool((lengths == 0).any()):
        raise TrajectoryValidationError("empty response: the scalar reward needs a last token",
                                        row=int(torch.nonzero(lengths == 0)[0]), field="response_tokens")
    token_rewards[log_probs.offsets[1:] - 1] += reward.to(token_rewards.dtype)
    return RaggedTensor(kl, log_probs.offsets), RaggedTensor(token_rewards, log_probs.offsets)


class AdaptiveKLController:
    """``coef *= 1 + clip(KL / target - 1, -0.2, 0.2) * n / horizon`` (Ziegler et al. 2019)."""

    def __init__(self, init_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"target_kl and horizon must be > 0, got {target_kl}, {horizon}")
        self.coef, self.target_kl, self.horizon = float(init_coef), float(target_kl), int(horizon)

    def update(self, kl: float, n_steps: int) -> float:
        error = min(max(kl / self.target_kl - 1.0, -0.2), 0.2)
        self.coef *= 1.0 + error * n_steps / self.horizon
        return self.coef

    def state(self) -> dict[str, float]:
        return {"coef": self.coef, "target_kl": self.target_kl, "horizon": self.horizon}


# ============================================================================ transform
class KLReward(WritePathTransform):
    """Writes ``kl`` and ``token_rewards`` (module docstring); needs ``ref_log_probs`` upstream.

    Args:
        coef: KL coefficient (the initial one when adaptive).
        estimator: ``"k1"`` (default), ``"k2"`` or ``"k3"``.
        target_kl: per-sequence KL target; set it to make the coefficient adaptive.
        horizon: adaptive controller horizon, in rows.
    """

    fills_fields = ("kl", "token_rewards")

    def __init__(self, coef: float = 0.05, *, estimator: Estimator = "k1", target_kl: float | None = None,
                 horizon: int = 10_000) -> None:
        super().__init__()
        if estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {list(ESTIMATORS)}, got {estimator!r}")
        self.estimator = estimator
        self.coef = float(coef)
        self.controller = AdaptiveKLController(coef, target_kl, horizon) if target_kl is not None else None
        self._last_kl = float("nan")
        self._rows = 0

    def write(self, batch: TrajectoryBatch | None) -> TrajectoryBatch | None:
        if batch is None:
            return None
        if "ref_log_probs" not in batch:
            raise TrajectoryValidationError(
                "KLReward needs ref_log_probs: run ReferenceLogProbs before it on the write path "
                "(append KLReward to the buffer before ReferenceLogProbs; torchrl runs inverse "
                "transforms last-appended-first), or write ref_log_probs yourself", field="ref_log_probs")
        kl, token_rewards = kl_token_rewards(batch["response_log_probs"], batch["ref_log_probs"], batch["reward"],
                                             coef=self.coef, estimator=self.estimator)
        # mean over rows of the per-sequence KL is the token total over the row count
        self._last_kl = float(kl.values.sum(dtype=torch.float64)) / len(batch)
        self._rows += len(batch)
        if self.controller is not None:
            self.coef = self.controller.update(self._last_kl, len(batch))
        return batch.with_columns(kl=kl, token_rewards=token_rewards)

    def metrics(self) -> dict[str, Any]:
        return {"kl_coef": self.coef, "kl_sequence_mean": self._last_kl, "kl_rows": self._rows}

    def state_dict_payload(self) -> dict[str, Any]:
        out: dict[str, Any] = {"coef": self.coef, "rows": self._rows}
        if self.controller is not None:
            out["controller"] = self.controller.state()
        return out

    def load_payload(self, payload: Mapping[str, Any]) -> None:
        self.coef = float(payload["coef"])
        self._rows = int(payload.get("rows", 0))
        if self.controller is not None and "controller" in payload:
            self.controller.coef = float(payload["controller"]["coef"])
