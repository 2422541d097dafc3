"""Write-path transforms: they run inside ``rb.extend`` before rows reach the store, each a pure function
(the math, tested on its own) plus a thin torchrl ``Transform`` attached with
``rb.append_transform(t, invert=True)``: :class:`GroupAdvantage` holds rows until a group is complete,
then writes it with ``advantage``; :class:`ReferenceLogProbs` fills ``ref_log_probs``; :class:`KLReward`
fills ``kl`` and ``token_rewards``. They must run in that order, and torchrl runs the inverse chain
last-appended first, so append them reversed, or let :func:`attach_write_path` do it::

    attach_write_path(rb, GroupAdvantage(8), ReferenceLogProbs(ref), KLReward(0.05))

Design: docs/write-path.md#attaching-the-transforms.
"""

from __future__ import annotations

from rlhf_pipeline.transforms.group_advantage import GroupAdvantage, group_advantages, trajectory_returns
from rlhf_pipeline.transforms.kl_reward import AdaptiveKLController, KLReward, kl_k1, kl_k2, kl_k3, kl_token_rewards
from rlhf_pipeline.transforms.pending_groups import PendingGroups
from rlhf_pipeline.transforms.ref_logprobs import ReferenceLogProbs, reference_log_probs
from rlhf_pipeline.transforms.write_path import WritePathTransform

__all__ = [
    "AdaptiveKLController", "GroupAdvantage", "KLReward", "PendingGroups", "ReferenceLogProbs",
    "WritePathTransform", "attach_write_path", "group_advantages", "kl_k1", "kl_k2", "kl_k3",
    "kl_token_rewards", "reference_log_probs", "trajectory_returns",
]


def attach_write_path(rb, *transforms: WritePathTransform):
    """Appends ``transforms`` (given in write order) to ``rb`` so they run in that order on extend."""
    for t in reversed(transforms):
        rb.append_transform(t, invert=True)
    return rb
