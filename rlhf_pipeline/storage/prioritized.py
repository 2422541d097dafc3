"""A prioritized sampler on torchrl's ``Sampler`` contract that works here (no compiled extension).

Why one file: a torchrl ``Sampler`` must be one class (its contract: sample, update_priority,
state_dict over the storage's parts); the sum tree is already apart (:mod:`.sum_tree`).

:class:`PrioritizedSampler` draws row ``i`` with probability proportional to ``(p_i + eps)^alpha``, with
torchrl's importance weights; first priorities come from stored fields (:class:`RowPriority`), rows of our
stores are tracked by row key through eviction and across shards, and ``state_dict`` can hold only the
updated priorities (torchrl 0.14.1's own needs compiled segment trees that do not load against torch
2.13). Design: docs/curation.md#prioritized-sampling.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torchrl.data.replay_buffers.samplers import Sampler

from rlhf_pipeline.storage.capabilities import is_trajectory_store
from rlhf_pipeline.storage.row_keys import Part, keys_of, parts_of
from rlhf_pipeline.storage.sum_tree import SumMinTree

_READ_ROWS = 4096  # rows read at once when new rows get their priorities


class NothingToSampleError(RuntimeError):
    """The storage is empty, or no row has a positive probability (see ``min_version``)."""


# ====================================================================== row priorities
@dataclass
class RowPriority:
    """A row's priority as a function of its stored fields: ``compute(columns) -> (N,) float64 >= 0``.

    ``whole_groups``: ``compute`` needs every row of a group in the same call (rows of a group
    are written together, so a call never ends inside a group unless the rows end there).
    """

    name: str
    fields: tuple[str, ...]
    compute: Callable[[dict[str, np.ndarray]], np.ndarray]
    whole_groups: bool = False
    log2_scale: bool = False  # compute returns log2 of the priority (see RECENCY)


def _abs_advantage(columns: dict[str, np.ndarray]) -> np.ndarray:
    return np.abs(columns["advantage"].astype(np.float64))


def _group_reward_std(columns: dict[str, np.ndarray]) -> np.ndarray:
    groups, inverse = np.unique(columns["group_id"], return_inverse=True)
    rewards = columns["reward"].astype(np.float64)
    count = np.bincount(inverse, minlength=groups.size)
    mean = np.bincount(inverse, weights=rewards, minlength=groups.size) / count
    var = np.bincount(inverse, weights=(rewards - mean[inverse]) ** 2, minlength=groups.size) / count
    return np.sqrt(var)[inverse]


def recency(half_life_versions: float = 10.0) -> RowPriority:
    """``p = 2^(policy_version / half_life)``: a row's priority halves for every ``half_life``
    versions newer data has. Kept as log2 and rescaled when it grows large (the sampling
    distribution only depends on ratios, which a common factor leaves unchanged)."""
    if not half_life_versions > 0:
        raise ValueError(f"recency half-life must be > 0 versions, got {half_life_versions}")
    return RowPriority("recency", ("policy_version",),
                       lambda c: c["policy_version"].astype(np.float64) / half_life_versions, log2_scale=True)


#: Named priorities for ``PrioritizedSampler(priority=...)`` and the learner's ``priority`` setting.
PRIORITIES: dict[str, Callable[[], RowPriority]] = {
    "abs_advantage": lambda: RowPriority("abs_advantage", ("advantage",), _abs_advantage),
    "group_reward_std": lambda: RowPriority("group_reward_std", ("group_id", "reward"), _group_reward_std,
                                            whole_groups=True),
    "recency": recency,
}


def make_priority(priority: str | RowPriority | None) -> RowPriority | None:
    if priority is None or isinstance(priority, RowPriority):
        return priority
    try:
        return PRIORITIES[priority]()
    except KeyError:
        raise ValueError(f"unknown priority {priority!r}; choose from {sorted(PRIORITIES)} or pass a "
                         f"RowPriority") from None


# ====================================================================== per-part state
class _PartPriorities:
    """Priorities of one part's rows, leaf ``k`` = global row ``base + k`` (NumPy: small-array
    operations cost less than torch's, and a step is made of small operations)."""

    def __init__(self, base: int) -> None:
        self.base = base
        self.known = 0
        self._raw = np.zeros(1024)  # priorities as set (or log2 of them); grows by doubling
        self._versions = np.zeros(1024, dtype=np.int64)  # policy_version, for min_version
        self._updated = np.zeros(1024, dtype=bool)  # raw is history (update_priority), not a function of the row
        self.tree = SumMinTree()

    @property
    def raw(self) -> np.ndarray:
        return self._raw[: self.known]

    @property
    def versions(self) -> np.ndarray:
        return self._versions[: self.known]

    @property
    def updated(self) -> np.ndarray:
        return self._updated[: self.known]

    def drop_before(self, first_row: int) -> bool:
        """Forgets rows evicted from the part; True when anything was dropped."""
        if first_row <= self.base:
            return False
        drop = min(first_row - self.base, self.known)
        self._raw = self._raw[drop:].copy()
        self._versions = self._versions[drop:].copy()
        self._updated = self._updated[drop:].copy()
        self.known -= drop
        self.base = first_row
        return True

    def append(self, raw: np.ndarray, versions: np.ndarray, updated: bool | np.ndarray = False) -> None:
        need = self.known + raw.size
        if need > self._raw.size:
            size = max(need, 2 * self._raw.size)
            self._raw = np.concatenate([self._raw[: self.known], np.zeros(size - self.known)])
            self._versions = np.concatenate([self._versions[: self.known], np.zeros(size - self.known, dtype=np.int64)])
            self._updated = np.concatenate([self._updated[: self.known], np.zeros(size - self.known, dtype=bool)])
        self._raw[self.known: need] = raw
        self._versions[self.known: need] = versions
        self._updated[self.known: need] = updated
        self.known = need


def _same_positions(older: list[Part], newer: list[Part]) -> bool:
    """True when every position of ``older`` names the same row in ``newer`` (rows were only
    added at the ends of parts that nothing follows, or as new parts)."""
    held = {p.index: p for p in newer}
    return all(p.index in held and held[p.index].start == p.start and held[p.index].first_row == p.first_row
               and held[p.index].length >= p.length for p in older)


# ====================================================================== the sampler
class PrioritizedSampler(Sampler):
    """Prioritized sampling on torchrl's ``Sampler`` contract (docs/curation.md#prioritized-sampling)."""

    #: how torchrl's ``TensorDictReplayBuffer`` reduces a row's priority over extra dims
    reduction: str = "max"

    def __init__(self, alpha: float = 0.6, beta: float = 0.4, eps: float = 1e-6,
                 priority: str | RowPriority | None = None) -> None:
        if alpha < 0 or beta < 0 or eps < 0:
            raise ValueError(f"alpha, beta and eps must be >= 0, got {alpha}, {beta}, {eps}")
        self.alpha, self.beta, self.eps = float(alpha), float(beta), float(eps)
        self.priority = make_priority(priority)
        self.min_version: int | None = None
        self._empty()

    def _empty(self) -> None:
        self._parts: dict[int, _PartPriorities] = {}
        self._max_priority = 1.0
        self._log2_offset = 0.0  # log2_scale priorities are used as 2^(stored - offset)
        self._written: list[np.ndarray] = []  # positions extend()/add() marked (torchrl's own storages)
        self._last_layout: list[Part] | None = None
        self._wrote_since_sample = False  # a buffer wrote through extend()/add() since the last sample
        # updated priorities of rows not synced yet (loaded from a compact state): part -> (rows, raw)
        self._overrides: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __repr__(self) -> str:
        name = self.priority.name if self.priority else "default"
        return f"PrioritizedSampler(alpha={self.alpha}, beta={self.beta}, eps={self.eps}, priority={name!r})"

    @property
    def default_priority(self) -> float:
        return self._max_priority

    @property
    def layout(self) -> list[Part] | None:
        """The storage's parts as of the last ``sample``: what its positions refer to."""
        return self._last_layout

    def updated_rows(self) -> int:
        """Rows held whose priority was set by an update (or, without a priority function, by history)."""
        return sum(int(np.count_nonzero(s.updated)) for s in self._parts.values())

    # ---------------------------------------------------------------- keeping up with the storage
    def _layout(self, storage) -> list[Part]:
        if is_trajectory_store(storage):
            return parts_of(storage)
        return [Part(0, storage, 0, len(storage), 0)]

    def _leaf_values(self, part: _PartPriorities, rows: slice | np.ndarray = slice(None)) -> np.ndarray:
        """Tree leaves ``(p + eps)^alpha`` (0 below ``min_version``) of the part's ``rows``."""
        raw = part.raw[rows]
        if self.priority is not None and self.priority.log2_scale:
            raw = np.exp2(raw - self._log2_offset)
        values = (raw + self.eps) ** self.alpha
        if self.min_version is not None:
            values = np.where(part.versions[rows] >= self.min_version, values, 0.0)
        return values

    def _sync(self, layout: list[Part], storage) -> None:
        """Brings every part's priorities up to the rows the storage holds now."""
        for part in layout:
            state = self._parts.get(part.index)
            if state is None:
                state = self._parts[part.index] = _PartPriorities(part.first_row)
            if state.drop_before(part.first_row):
                state.tree.rebuild(self._leaf_values(state))
            if part.next_row > state.base + state.known:
                self._add_rows(state, part, storage)
            if part.index in self._overrides:
                self._apply_overrides(part.index, state)
        if self._written and not is_trajectory_store(storage):
            state = self._parts[0]
            written = np.unique(np.concatenate(self._written))
            written = written[written < state.known]
            state.raw[written] = self._max_priority
            state.updated[written] = True
            state.tree.set(written, self._leaf_values(state, written))
        self._written = []

    def _apply_overrides(self, index: int, state: _PartPriorities) -> None:
        rows, raw = self._overrides.pop(index)
        held = rows >= state.base  # rows evicted since the state was saved are gone
        rows, raw = rows[held], raw[held]
        later = rows >= state.base + state.known  # not synced yet: a group held back by the read
        if later.any():
            self._overrides[index] = (rows[later], raw[later])
        self._set_raw(state, rows[~later] - state.base, raw[~later])

    def _set_raw(self, state: _PartPriorities, leaf: np.ndarray, raw: np.ndarray) -> None:
        leaf, last = np.unique(leaf[::-1], return_index=True)  # a leaf given twice keeps its last value
        raw = raw[::-1][last]
        if leaf.size and leaf[0] < 0:  # evicted since they were named
            keep = leaf >= 0
            leaf, raw = leaf[keep], raw[keep]
        state.raw[leaf] = raw
        state.updated[leaf] = True
        state.tree.set(leaf, self._leaf_values(state, leaf))

    def _add_rows(self, state: _PartPriorities, part: Part, storage) -> None:
        first = state.base + state.known
        while first < part.next_row:
            stop = min(part.next_row, first + _READ_ROWS)
            raw, versions = self._priorities_of(part, storage, first, stop)
            stop = first + raw.size
            # without a priority function a row starts at the highest priority seen so far: history
            state.append(raw, versions, updated=self.priority is None)
            rows = slice(first - state.base, stop - state.base)
            state.tree.set(np.arange(rows.start, rows.stop), self._leaf_values(state, rows))
            first = stop

    def _priorities_of(self, part: Part, storage, first: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Raw priorities and policy versions of global rows ``[first, stop)`` of ``part`` (the
        range may come back shorter, ending before a group that continues after ``stop``)."""
        if not is_trajectory_store(storage):  # a torchrl storage: default priority, no versions
            return np.full(stop - first, self._max_priority), np.zeros(stop - first, dtype=np.int64)
        fields = set(self.priority.fields if self.priority else ()) | {"policy_version"}
        rows = part.store.read_global(torch.arange(first, stop), fields=tuple(sorted(fields)))
        columns = {name: rows[name].numpy() for name in fields}
        if self.priority is not None and self.priority.whole_groups and stop < part.next_row:
            groups = columns["group_id"]
            tail = np.flatnonzero(groups != groups[-1])
            if tail.size:  # hold back the last group: its other rows come with the next read
                keep = int(tail[-1]) + 1
                columns = {name: values[:keep] for name, values in columns.items()}
        versions = columns["policy_version"].astype(np.int64)
        if self.priority is None:
            return np.full(versions.size, self._max_priority), versions
        raw = np.asarray(self.priority.compute(columns), dtype=np.float64)
        if raw.shape != versions.shape or not np.isfinite(raw).all() or (not self.priority.log2_scale and
                                                                         (raw < 0).any()):
            raise ValueError(f"priority {self.priority.name!r} must give one finite value >= 0 per row, got "
                             f"{raw[:8]} for {versions.size} rows")
        if self.priority.log2_scale:
            self._keep_log2_in_range(raw)
        return raw, versions

    def _keep_log2_in_range(self, log2: np.ndarray) -> None:
        """Log2 priorities are used as ``2^(log2 - offset)``; the offset moves up (by whole powers
        of two) before that overflows. Stored values never change, so the leaves only depend on
        the stored rows and the offset, which the state keeps: a resumed run builds equal trees."""
        if log2.size and float(log2.max()) - self._log2_offset > 500.0:
            self._log2_offset = float(math.floor(float(log2.max())))
            for state in self._parts.values():
                state.tree.rebuild(self._leaf_values(state))

    # ---------------------------------------------------------------- the Sampler contract
    def sample(self, storage, batch_size: int, *, generator: torch.Generator | None = None
               ) -> tuple[torch.Tensor, dict[str, Any]]:
        """``batch_size`` positions drawn by priority (with replacement) and their importance weights."""
        len(storage)  # refreshes a read-only store: rows written since are sampled too
        layout = self._layout(storage)
        self._sync(layout, storage)
        states = [self._parts[p.index] for p in layout]
        totals = np.array([s.tree.total() for s in states])
        grand_total = float(totals.sum())
        if not grand_total > 0:
            raise NothingToSampleError(
                "nothing to sample: the storage is empty" if not any(p.length for p in layout) else
                f"no row has a positive priority (min_version={self.min_version} leaves none, or every "
                f"priority is 0 with eps=0)")
        generator = generator if generator is not None else self._rng
        mass = torch.rand(batch_size, dtype=torch.float64, generator=generator).numpy() * grand_total
        positions = np.empty(batch_size, dtype=np.int64)
        values = np.empty(batch_size)
        if len(states) == 1:
            slot = np.zeros(batch_size, dtype=np.int64)
        else:
            ends = np.cumsum(totals)
            slot = np.minimum(np.searchsorted(ends, mass, side="right"), len(states) - 1)
            while (totals[slot] <= 0).any():  # rounding at the very top: step back to a part with mass
                slot = np.where(totals[slot] <= 0, slot - 1, slot)
            mass = mass - (ends - totals)[slot]
        for k in np.unique(slot).tolist():
            mine = slot == k if len(states) > 1 else slice(None)
            leaf = states[k].tree.find(mass[mine])
            values[mine] = states[k].tree.leaf_values(leaf)
            positions[mine] = layout[k].start + states[k].base + leaf - layout[k].first_row
        smallest = min(s.tree.minimum() for s in states)
        weight = torch.from_numpy((values / smallest) ** -self.beta).to(torch.float32)
        self._last_layout = layout
        self._wrote_since_sample = False
        return torch.from_numpy(positions), {"priority_weight": weight}

    def update_priority(self, index, priority, *, storage=None) -> None:
        """Sets the priority of the rows at ``index``: positions of the last ``sample``, or of a write
        since (``rb.extend``/``rb.add`` return them; ``storage=``, which the buffer passes, maps them).

        Both are positions of the store's live window, and mean the same rows until rows are
        evicted (or, in a union of shards, a shard grows). When that happened between the last
        ``sample`` and a write through the buffer, ``index`` could be either: ValueError. Name
        the rows by key instead (:meth:`keys_of` right after sampling, then
        :meth:`update_priority_by_key`).
        """
        index = torch.as_tensor(index, dtype=torch.int64).reshape(-1).numpy()
        layout = self._layout_for_update(storage)
        if layout is None and index.size:
            raise RuntimeError("update_priority before any sample(): pass storage= so positions can be mapped")
        parts, rows = keys_of(None, index, parts=layout) if index.size else (index, index)
        self.update_priority_by_key(parts, rows, priority)

    def _layout_for_update(self, storage) -> list[Part] | None:
        """The layout positions given to :meth:`update_priority` refer to (see there)."""
        sampled = self._last_layout
        if storage is None:
            return sampled
        current = self._layout(storage)  # no refresh: a writer's store is current, a reader's as sampled
        if sampled is None or _same_positions(sampled, current):
            return current
        if not self._wrote_since_sample:
            return sampled  # rows moved by another process's writes: the positions are the sample's
        raise ValueError(
            "update_priority: rows were evicted (or a shard grew) between the last sample and a write "
            "through this buffer, so these positions could name either the sampled rows or the written "
            "ones: take sampler.keys_of(positions) right after sampling and call "
            "sampler.update_priority_by_key(parts, rows, priority)"
        )

    def keys_of(self, positions) -> tuple[np.ndarray, np.ndarray]:
        """``(part index, global row)`` of positions as of the last ``sample``: names that stay valid
        after the storage refreshes (for an update made later, :meth:`update_priority_by_key`)."""
        if self._last_layout is None:
            raise RuntimeError("keys_of before any sample()")
        return keys_of(None, torch.as_tensor(positions, dtype=torch.int64).numpy(), parts=self._last_layout)

    def update_priority_by_key(self, parts, rows, priority) -> None:
        """Sets the priority of the rows named by row keys (see :meth:`keys_of`); rows evicted since
        are ignored, rows not synced yet (after ``load_state_dict``) are set when they are. A row
        named twice keeps its last value."""
        parts = np.asarray(parts, dtype=np.int64).reshape(-1)
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        priority = np.broadcast_to(torch.as_tensor(priority, dtype=torch.float64).reshape(-1).numpy(), rows.shape)
        if rows.size == 0:
            return
        if (priority < 0).any() or not np.isfinite(priority).all():
            raise ValueError("priorities must be finite and >= 0")
        if self.priority is not None and self.priority.log2_scale:
            raise ValueError(f"priority {self.priority.name!r} is derived from stored versions; it takes no updates")
        for k in (np.unique(parts).tolist() if parts.size > 1 and (parts != parts[0]).any() else [int(parts[0])]):
            mine = parts == k
            state = self._parts.get(k)
            if state is not None and k not in self._overrides and int(rows[mine].max()) < state.base + state.known:
                self._set_raw(state, rows[mine] - state.base, priority[mine])  # rows evicted since: dropped below
                continue
            pending = self._overrides.get(k, (np.zeros(0, dtype=np.int64), np.zeros(0)))
            # after a load the rows are synced at the next sample(): the update waits with them
            self._overrides[k] = (np.concatenate([pending[0], rows[mine]]), np.concatenate([pending[1], priority[mine]]))
            if state is not None:
                self._apply_overrides(k, state)
        self._max_priority = max(self._max_priority, float(priority.max()))

    def set_min_version(self, min_version: int | None) -> None:
        """Rows sampled by a policy version below ``min_version`` get probability 0 (None: all rows)."""
        if min_version == self.min_version:
            return
        old, self.min_version = self.min_version, min_version
        low = -(2**62) if old is None else old
        high = -(2**62) if min_version is None else min_version
        for state in self._parts.values():
            changed = np.flatnonzero((state.versions >= low) != (state.versions >= high))
            state.tree.set(changed, self._leaf_values(state, changed))

    def add(self, index: int) -> None:
        self._written.append(np.asarray(index, dtype=np.int64).reshape(-1))
        self._wrote_since_sample = True

    def extend(self, index: torch.Tensor) -> None:
        self._written.append(torch.as_tensor(index, dtype=torch.int64).reshape(-1).numpy())
        self._wrote_since_sample = True

    def mark_update(self, index, *, storage=None) -> None:
        self.extend(index)

    # ---------------------------------------------------------------- state
    def state_dict(self, *, include_priorities: bool = True) -> dict[str, Any]:
        """Settings, and every part's priorities (``include_priorities=False``: only what cannot be
        re-derived from the stored rows: the updated rows, by row key)."""
        state = {"alpha": self.alpha, "beta": self.beta, "eps": self.eps, "min_version": self.min_version,
                 "max_priority": self._max_priority, "log2_offset": self._log2_offset}
        if include_priorities:
            state["parts"] = {index: {"base": s.base, "raw": torch.from_numpy(s.raw.copy()),
                                      "versions": torch.from_numpy(s.versions.copy()),
                                      "updated": torch.from_numpy(s.updated.copy())}
                              for index, s in self._parts.items()}
            state["updated"] = {index: {"rows": torch.from_numpy(rows), "raw": torch.from_numpy(raw)}
                                for index, (rows, raw) in self._overrides.items()}
            return state
        updated = {}
        for index in sorted(set(self._parts) | set(self._overrides)):
            rows, raw = self._overrides.get(index, (np.zeros(0, dtype=np.int64), np.zeros(0)))
            if index in self._parts:
                s = self._parts[index]
                leaf = np.flatnonzero(s.updated)
                rows, raw = np.concatenate([leaf + s.base, rows]), np.concatenate([s.raw[leaf], raw])
            if rows.size:
                updated[index] = {"rows": torch.from_numpy(rows), "raw": torch.from_numpy(raw.copy())}
        state["updated"] = updated
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._empty()
        self.alpha, self.beta, self.eps = state_dict["alpha"], state_dict["beta"], state_dict["eps"]
        self.min_version = state_dict["min_version"]
        self._max_priority = float(state_dict["max_priority"])
        self._log2_offset = float(state_dict["log2_offset"])
        for index, saved in state_dict.get("parts", {}).items():
            part = self._parts[int(index)] = _PartPriorities(int(saved["base"]))
            raw = torch.as_tensor(saved["raw"]).numpy().astype(np.float64)
            updated = torch.as_tensor(saved["updated"]).numpy() if "updated" in saved else np.ones(raw.size, bool)
            part.append(raw, torch.as_tensor(saved["versions"]).numpy().astype(np.int64), updated=updated)
            part.tree.rebuild(self._leaf_values(part))
        for index, saved in state_dict.get("updated", {}).items():
            self._overrides[int(index)] = (torch.as_tensor(saved["rows"]).numpy().astype(np.int64),
                                           torch.as_tensor(saved["raw"]).numpy().astype(np.float64))

    def dumps(self, path) -> None:
        from rlhf_pipeline.files.atomic import save_torch_atomic

        Path(path).mkdir(parents=True, exist_ok=True)
        save_torch_atomic(self.state_dict(), Path(path) / "prioritized_sampler.pt")

    def loads(self, path) -> None:
        self.load_state_dict(torch.load(Path(path) / "prioritized_sampler.pt", weights_only=True))
