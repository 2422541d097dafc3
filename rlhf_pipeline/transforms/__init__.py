"""Write-path transforms: they run inside ``rb.extend`` before rows reach the store.

Each transform is a pure function (the math, tested on its own) plus a thin torchrl
``Transform`` that attaches with ``rb.append_transform(t, invert=True)``:

* :class:`GroupAdvantage` holds rows until a group is complete, then writes it with
  ``advantage`` (its pending rows go in the store's ``writer_state`` with every append);
* :class:`ReferenceLogProbs` fills ``ref_log_probs`` from a frozen reference model;
* :class:`KLReward` fills ``kl`` and ``token_rewards``.

Order. On ``extend`` torchrl runs the inverse chain *last-appended first*. The write
path must run group advantage -> reference log-probs -> KL reward (rows wait for their
group before the reference model spends time on them; KL needs the reference), so
append them in the reverse order, or let :func:`attach_write_path` do it::

    attach_write_path(rb, GroupAdvantage(8), ReferenceLogProbs(ref), KLReward(0.05))

The store must hold the optional fields the stack fills:
``StoreSchema(optional=("advantage", "ref_log_probs", "kl", "token_rewards"))``.
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
