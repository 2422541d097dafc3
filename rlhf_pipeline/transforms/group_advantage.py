"""Group-relative advantage on the write path (:class:`GroupAdvantage`, the math in
:func:`group_advantages` and :func:`trajectory_returns`): torchrl ``MCAdvantage`` semantics, vectorized,
with GRPO's, Dr. GRPO's and RLOO's variants, trajectory returns by sum, mean, max or step, and dynamic
sampling (``drop_zero_variance``). It runs first on the write path: it decides which rows are written.
Why the math, the transform and the checks that refuse a write before any state changes share a file:
they are one definition of the variant computed, read together; the pending rows they share live apart
(``pending_groups.py``). Design: docs/write-path.md#what-the-group-advantage-computes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch

from rlhf_pipeline.schema.ragged import RaggedTensor
from rlhf_pipeline.schema import StoreSchema, TrajectoryBatch, TrajectoryValidationError, validate_batch
from rlhf_pipeline.transforms.pending_groups import PendingGroups
from rlhf_pipeline.transforms.write_path import WritePathTransform

TrajectoryReturn = Literal["sum", "mean", "max", "step"]


# ============================================================================ pure math
def trajectory_returns(
    reward: torch.Tensor, traj_of_row: torch.Tensor, num_trajectories: int, how: TrajectoryReturn
) -> torch.Tensor:
    """(N,) per-row rewards -> (T,) per-trajectory returns (``how`` in sum/mean/max)."""
    reward = reward.to(torch.float64)
    if how == "sum":
        return torch.zeros(num_trajectories, dtype=torch.float64).index_add_(0, traj_of_row, reward)
    if how == "mean":
        total = torch.zeros(num_trajectories, dtype=torch.float64).index_add_(0, traj_of_row, reward)
        count = torch.bincount(traj_of_row, minlength=num_trajectories)
        return total / count
    if how == "max":
        out = torch.full((num_trajectories,), -torch.inf, dtype=torch.float64)
        return out.scatter_reduce_(0, traj_of_row, reward, reduce="amax")
    raise ValueError(f"trajectory_return must be 'sum', 'mean', 'max' or 'step', got {how!r}")


def group_advantages(
    returns: torch.Tensor,
    group_of: torch.Tensor,
    num_groups: int,
    *,
    normalize: bool = True,
    leave_one_out: bool = False,
    eps: float = 1e-6,
    unbiased_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages of ``returns`` (M,) within groups ``group_of`` (M,) in ``[0, num_groups)``.

    Returns ``(advantage (M,) float32, zero_variance (num_groups,) bool)``; the formula is in
    docs/write-path.md ("What the group advantage computes"). Computed in float64 so the result does
    not depend on the order rows arrive in. ``zero_variance`` is exact (max == min), not ``std < eps``.
    """
    r = returns.to(torch.float64)
    count = torch.bincount(group_of, minlength=num_groups).to(torch.float64)  # (G,)
    total = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_of, r)
    mean = total / count
    centered = r - mean[group_of]
    if leave_one_out:
        n = count[group_of]
        if bool((n < 2).any()):
            raise ValueError("leave_one_out needs at least 2 trajectories per group")
        adv = r - (total[group_of] - r) / (n - 1)
    else:
        adv = centered
    lo = torch.full((num_groups,), torch.inf, dtype=torch.float64).scatter_reduce_(0, group_of, r, "amin")
    hi = torch.full((num_groups,), -torch.inf, dtype=torch.float64).scatter_reduce_(0, group_of, r, "amax")
    zero_variance = lo == hi
    if normalize:
        dof = (count - 1).clamp_min(1) if unbiased_std else count
        var = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_of, centered * centered) / dof
        adv = adv / var.sqrt().clamp_min(eps)[group_of]
    return adv.to(torch.float32), zero_variance


# ============================================================================ transform
class GroupAdvantage(WritePathTransform):
    """Holds rows until their group has ``group_size`` trajectories, then writes the group.

    Attach with ``rb.append_transform(GroupAdvantage(...), invert=True)``. A write
    (``rb.extend(batch)``) must hold whole trajectories (each ends in a ``done`` row);
    rows of incomplete groups wait in a durable pending state, and ``extend`` returns
    no indices until some group completes (torchrl skips the storage when the
    transform stack returns ``None``).

    Durability: the pending rows are this transform's state (``get_extra_state``), which a buffer
    made by ``make_replay_buffer`` publishes with every append as the store's ``writer_state`` and
    loads back when it is built on that store again (``storage/writer_state.py``), so a writer
    killed mid-run loses no acknowledged row and writes no group twice. ``state_dict()`` carries
    the same state for torchrl's ``rb.state_dict()`` / ``rb.dumps``.

    Args:
        group_size: trajectories per group (GRPO's G).
        normalize: divide by the group's std (GRPO); ``False`` is Dr. GRPO.
        leave_one_out: RLOO baseline (mean of the other trajectories of the group).
        eps: lower clamp of the std.
        unbiased_std: std with ``n - 1`` (torch / torchrl default) or ``n``.
        trajectory_return: ``"sum" | "mean" | "max" | "step"``, see docs/write-path.md.
        drop_zero_variance: drop groups whose returns are all equal (dynamic sampling).
        step_advantage: also write each row's ``"step"`` advantage as ``step_advantage`` (turn_advantage=mixed).
    """

    fills_fields = ("advantage",)

    def __init__(
        self,
        group_size: int,
        *,
        normalize: bool = True,
        leave_one_out: bool = False,
        eps: float = 1e-6,
        unbiased_std: bool = True,
        trajectory_return: TrajectoryReturn = "sum",
        drop_zero_variance: bool = False,
        step_advantage: bool = False,
    ) -> None:
        super().__init__()
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        if trajectory_return not in ("sum", "mean", "max", "step"):
            raise ValueError(f"trajectory_return must be 'sum', 'mean', 'max' or 'step', got {trajectory_return!r}")
        if leave_one_out and group_size < 2:
            raise ValueError("leave_one_out needs group_size >= 2")
        self.group_size = group_size
        self.normalize = normalize
        self.leave_one_out = leave_one_out
        self.eps = eps
        self.unbiased_std = unbiased_std
        self.trajectory_return = trajectory_return
        self.drop_zero_variance = drop_zero_variance
        self.step_advantage = step_advantage
        self.fills_fields = ("advantage", "step_advantage") if step_advantage else ("advantage",)
        # Ids of groups already written, so a late extra trajectory is an error rather
        # than a second, undersized group (~60 bytes per group, in memory only).
        self._completed_groups: set[int] = set()
        self._unconfirmed: list[int] = []  # completed by the last write: written once a next write comes
        self.pending = PendingGroups()
        self._counters = self.pending.counters  # shared: saved with every pending snapshot
        self._name_counters()

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict[str, int]:
        """Counters for ``charts/…`` metrics: groups written / dropped, rows pending."""
        return {**self._counters, "pending_rows": self.pending.num_rows, "pending_groups": self.pending.num_groups}

    # ------------------------------------------------------------------ write path
    def write(self, batch: TrajectoryBatch | None) -> TrajectoryBatch | None:
        if batch is None:
            return None
        if not isinstance(batch, TrajectoryBatch):
            raise TypeError(f"GroupAdvantage takes a TrajectoryBatch, got {type(batch).__name__}")
        self._completed_groups.update(self._unconfirmed)  # no rollback came: that write was published
        self._unconfirmed = []
        # ---- checks: everything that can reject the write runs before any state changes
        _check_rewards(batch)
        old = self.pending.rows
        n_old = 0 if old is None else len(old)
        if old is not None:
            _check_not_pending(batch, old)
            combined = TrajectoryBatch.cat([old, _align_fields(batch, old)])
        else:
            combined = batch
        traj_ids, traj_of_row = torch.unique(combined["trajectory_id"], return_inverse=True)
        num_traj = traj_ids.numel()
        group_of_traj = _check_trajectories(combined, traj_of_row, num_traj, n_old)
        group_ids, group_of_traj_dense = torch.unique(group_of_traj, return_inverse=True)
        traj_per_group = torch.bincount(group_of_traj_dense, minlength=group_ids.numel())
        self._check_group_sizes(group_ids, traj_per_group)
        new_traj = num_traj - (self.pending.num_trajectories if n_old else 0)

        complete_group = traj_per_group == self.group_size  # (G,)
        if not bool(complete_group.any()):
            rows = _validated(batch)
            self._count(rows_in=len(batch), trajectories_in=new_traj)
            self.pending.add(rows)
            return None

        group_of_row = group_of_traj_dense[traj_of_row]  # (N,)
        row_complete = complete_group[group_of_row]
        incoming_pending = ~row_complete
        incoming_pending[:n_old] = False
        new_pending_rows = None
        if bool(incoming_pending.any()):
            new_pending_rows = _validated(_take(combined, torch.nonzero(incoming_pending).squeeze(1)))
        advantage_rows, zero_var = self._advantages(combined, traj_of_row, num_traj, group_of_traj_dense,
                                                    group_of_row)
        keep_group = complete_group & ~zero_var if self.drop_zero_variance else complete_group
        dropped_group = complete_group & ~keep_group
        row_written = keep_group[group_of_row]
        num_out = int(row_written.sum())

        # ---- state changes
        completed = group_ids[complete_group].tolist()
        n_complete, n_dropped = len(completed), int(dropped_group.sum())
        self._count(rows_in=len(batch), trajectories_in=new_traj, groups_completed=n_complete,
                    groups_dropped_zero_variance=n_dropped, groups_written=n_complete - n_dropped,
                    rows_dropped=int(dropped_group[group_of_row].sum()), rows_written=num_out)
        if n_old:
            self.pending.complete(group_ids[torch.unique(group_of_row[:n_old][row_complete[:n_old]])])
        if new_pending_rows is not None:
            self.pending.add(new_pending_rows)
        self._unconfirmed = completed

        if num_out == 0:
            return None
        columns = {"advantage": advantage_rows}
        if self.step_advantage:
            columns["step_advantage"] = self._advantages(combined, traj_of_row, num_traj, group_of_traj_dense,
                                                         group_of_row, "step")[0]
        if num_out == len(combined):
            out = combined
        else:
            idx = torch.nonzero(row_written).squeeze(1)
            out, columns = _take(combined, idx), {name: values[idx] for name, values in columns.items()}
        return out.with_columns(**columns)

    def _count(self, **increments: int) -> None:
        for name, value in increments.items():
            self._counters[name] += value

    def _name_counters(self) -> None:
        for name in ("trajectories_in", "rows_in", "groups_completed", "groups_written",
                     "groups_dropped_zero_variance", "rows_written", "rows_dropped"):
            self._counters.setdefault(name, 0)

    def _advantages(self, combined, traj_of_row, num_traj, group_of_traj, group_of_row, how=None):
        num_groups, how = int(group_of_traj.max()) + 1, how or self.trajectory_return
        reward = combined["reward"]
        if how == "step":
            return group_advantages(reward, group_of_row, num_groups, normalize=self.normalize,
                                    leave_one_out=self.leave_one_out, eps=self.eps,
                                    unbiased_std=self.unbiased_std)
        returns = trajectory_returns(reward, traj_of_row, num_traj, how)
        adv_traj, zero_var = group_advantages(returns, group_of_traj, num_groups, normalize=self.normalize,
                                              leave_one_out=self.leave_one_out and self.group_size > 1,
                                              eps=self.eps, unbiased_std=self.unbiased_std)
        return adv_traj[traj_of_row], zero_var

    def _check_group_sizes(self, group_ids: torch.Tensor, traj_per_group: torch.Tensor) -> None:
        over = torch.nonzero(traj_per_group > self.group_size)
        if over.numel():
            g = int(over[0])
            raise TrajectoryValidationError(
                f"group {int(group_ids[g])} has {int(traj_per_group[g])} trajectories (pending + this write) "
                f"but group_size is {self.group_size}; give each prompt's group a fresh group_id or raise "
                "group_size", field="group_id")
        if self._completed_groups:
            late = [g for g in group_ids.tolist() if g in self._completed_groups]
            if late:
                raise TrajectoryValidationError(
                    f"group {late[0]} was already completed and written with {self.group_size} trajectories; "
                    "a further trajectory would exceed group_size. Use a fresh group_id per prompt sampling",
                    field="group_id")

    # ------------------------------------------------------------------ state
    def state_dict_payload(self) -> dict[str, Any]:
        return self.pending.to_payload()

    def load_payload(self, payload: Mapping[str, Any]) -> None:
        """A published state (a restart), or the one before a write that raised: the groups that
        write completed were not written."""
        self.pending.load_payload(payload)
        self._name_counters()
        self._unconfirmed = []


# ============================================================================ checks
def _check_rewards(batch: TrajectoryBatch) -> None:
    reward = batch["reward"]
    bad = torch.nonzero(~torch.isfinite(reward))
    if bad.numel():
        i = int(bad[0])
        raise TrajectoryValidationError(
            f"reward {float(reward[i])} is not finite; score failed completions with a finite value "
            "(e.g. 0) so the group advantage stays defined", row=i, field="reward")


def _check_not_pending(batch: TrajectoryBatch, pending: TrajectoryBatch) -> None:
    again = torch.isin(batch["trajectory_id"], pending["trajectory_id"])
    if bool(again.any()):
        i = int(torch.nonzero(again)[0])
        raise TrajectoryValidationError(
            f"trajectory {int(batch['trajectory_id'][i])} is already pending in its group (written by an "
            "earlier extend); after a restart, resend only trajectories not in "
            "GroupAdvantage.pending.trajectory_ids()", row=i, field="trajectory_id")


def _check_trajectories(combined: TrajectoryBatch, traj_of_row: torch.Tensor, num_traj: int,
                        n_old: int) -> torch.Tensor:
    """Each trajectory: one group, exactly one done row, on its last step. Returns (T,) group ids."""
    group_id = combined["group_id"]
    done = combined["done"]
    n = len(combined)
    if num_traj == n:  # single-turn fast path: one row per trajectory
        not_done = torch.nonzero(~done)
        if not_done.numel():
            i = int(not_done[0]) - n_old
            raise TrajectoryValidationError(
                f"trajectory {int(combined['trajectory_id'][i + n_old])} is not done in this write; "
                "extend the buffer with whole trajectories (last row done=True)", row=i, field="done")
        out = torch.empty(num_traj, dtype=group_id.dtype)
        out[traj_of_row] = group_id
        return out
    g_lo = torch.full((num_traj,), torch.iinfo(torch.int64).max).scatter_reduce_(0, traj_of_row, group_id, "amin")
    g_hi = torch.full((num_traj,), torch.iinfo(torch.int64).min).scatter_reduce_(0, traj_of_row, group_id, "amax")
    mixed = torch.nonzero(g_lo != g_hi)
    if mixed.numel():
        t = int(mixed[0])
        i = int(torch.nonzero(traj_of_row == t)[0]) - n_old
        raise TrajectoryValidationError(
            "rows of one trajectory carry different group_id values; every step of a trajectory belongs "
            "to its prompt's group", row=i, field="group_id")
    n_done = torch.bincount(traj_of_row, weights=done.to(torch.float64), minlength=num_traj)
    step = combined["step"].to(torch.int64)
    last_step = torch.full((num_traj,), -1, dtype=torch.int64).scatter_reduce_(0, traj_of_row, step, "amax")
    done_on_last = (done & (step == last_step[traj_of_row])).to(torch.float64)
    ok_last = torch.bincount(traj_of_row, weights=done_on_last, minlength=num_traj)
    bad = torch.nonzero((n_done != 1) | (ok_last != 1))
    if bad.numel():
        t = int(bad[0])
        i = int(torch.nonzero(traj_of_row == t)[0]) - n_old
        raise TrajectoryValidationError(
            f"trajectory {int(combined['trajectory_id'][i + n_old])} has {int(n_done[t])} done rows in this "
            "write; extend with whole trajectories: exactly one done row, on its last step",
            row=i, field="done")
    return g_lo


def _take(batch: TrajectoryBatch, idx: torch.Tensor) -> TrajectoryBatch:
    """``batch.select(idx)``, but views instead of a gather when ``idx`` is one contiguous run.

    Streaming writes complete groups in order, so the rows written are nearly always a
    run (pending head + most of the write); the gather would copy every token again.
    """
    a, b = int(idx[0]), int(idx[-1]) + 1
    if b - a != idx.numel():
        return batch.select(idx)
    out: dict[str, Any] = {}
    for name, col in batch.columns.items():
        if isinstance(col, RaggedTensor):
            lo, hi = int(col.offsets[a]), int(col.offsets[b])
            out[name] = RaggedTensor(col.values[lo:hi], col.offsets[a : b + 1] - lo)
        else:
            out[name] = col[a:b]
    return TrajectoryBatch(out)


def _align_fields(batch: TrajectoryBatch, like: TrajectoryBatch) -> TrajectoryBatch:
    if batch.field_names != like.field_names:
        raise TrajectoryValidationError(
            f"this write has fields {list(batch.field_names)} but the pending rows of earlier writes have "
            f"{list(like.field_names)}; every extend into one buffer must carry the same fields")
    return batch


def _validated(rows: TrajectoryBatch) -> TrajectoryBatch:
    """Pending rows are checked now: a bad row must fail its own extend, not block its group later."""
    return validate_batch(rows, StoreSchema.for_batch(rows))
