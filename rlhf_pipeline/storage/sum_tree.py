"""A sum tree and a min tree over a growing array of weights, vectorized with torch.

What a prioritized sampler needs, with no compiled extension (torchrl 0.14.1's
``SumSegmentTreeFp32`` lives in a C++ extension that does not load against torch 2.13):

* :meth:`SumMinTree.set` writes B leaves and recomputes their ancestors: one vectorized
  step per tree level (~log2 N), each over the distinct nodes touched, so O(B log N);
* :meth:`SumMinTree.find` maps B masses in ``[0, total)`` to the leaf whose prefix-sum
  interval holds each mass, descending all B at once level by level: O(B log N);
* :meth:`SumMinTree.rebuild` rebuilds from an array of leaves, one vectorized pass per level.

Every internal node is recomputed from its two children (never updated by adding a
difference), so a node's value depends only on the current leaves, not on the order of
updates: a tree rebuilt from saved leaves samples exactly as the original (exact resume).
Values are float64; empty leaves hold 0 in the sum tree and +inf in the min tree.
"""

from __future__ import annotations

import torch


def _power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class SumMinTree:
    """Sums and minima of ``capacity`` non-negative leaves (grows by doubling)."""

    def __init__(self, capacity: int = 1024) -> None:
        self._allocate(_power_of_two(max(capacity, 2)))

    def _allocate(self, capacity: int) -> None:
        self.capacity = capacity
        self.sums = torch.zeros(2 * capacity, dtype=torch.float64)
        self.mins = torch.full((2 * capacity,), torch.inf, dtype=torch.float64)

    @property
    def depth(self) -> int:
        return self.capacity.bit_length() - 1

    def leaves(self, count: int | None = None) -> torch.Tensor:
        """The first ``count`` leaves (a view of the sum tree; do not write to it)."""
        return self.sums[self.capacity: self.capacity + (self.capacity if count is None else count)]

    def total(self) -> float:
        return float(self.sums[1])

    def minimum(self) -> float:
        return float(self.mins[1])

    def rebuild(self, values: torch.Tensor) -> None:
        """Leaves ``[0, len(values))`` set to ``values``, every other leaf empty; capacity grows to fit."""
        values = values.to(torch.float64).reshape(-1)
        if values.numel() > self.capacity:
            self._allocate(_power_of_two(values.numel()))
        else:
            self.sums.zero_()
            self.mins.fill_(torch.inf)
        cap = self.capacity
        self.sums[cap: cap + values.numel()] = values
        self.mins[cap: cap + values.numel()] = torch.where(values > 0, values, torch.inf)
        level = cap
        while level > 1:  # nodes [level/2, level) from their children [level, 2*level)
            half = level // 2
            self.sums[half:level] = self.sums[level: 2 * level: 2] + self.sums[level + 1: 2 * level: 2]
            self.mins[half:level] = torch.minimum(self.mins[level: 2 * level: 2], self.mins[level + 1: 2 * level: 2])
            level = half

    def set(self, index: torch.Tensor, values: torch.Tensor) -> None:
        """Leaves ``index`` set to ``values`` (a zero leaf is empty: never found, ignored by the min)."""
        index = torch.as_tensor(index, dtype=torch.int64).reshape(-1)
        if index.numel() == 0:
            return
        if int(index.max()) >= self.capacity:
            grown = self.leaves().clone()
            self._allocate(_power_of_two(int(index.max()) + 1))
            self.rebuild(grown)
        values = torch.as_tensor(values, dtype=torch.float64).reshape(-1).expand(index.numel())
        node = index + self.capacity
        self.sums[node] = values  # a repeated index keeps one of its values, as plain assignment does
        self.mins[node] = torch.where(self.sums[node] > 0, self.sums[node], torch.inf)
        node = torch.unique(node // 2)
        while node.numel() and int(node[-1]) >= 1:
            left, right = 2 * node, 2 * node + 1
            self.sums[node] = self.sums[left] + self.sums[right]
            self.mins[node] = torch.minimum(self.mins[left], self.mins[right])
            if int(node[0]) == 1:
                break
            node = torch.unique(node // 2)

    def find(self, mass: torch.Tensor) -> torch.Tensor:
        """For each mass in ``[0, total)``: the leaf ``i`` with ``sum(leaves[:i]) <= mass < sum(leaves[:i+1])``.

        A mass that rounding pushed to ``total`` or beyond lands on the last non-empty leaf; an
        empty leaf is never returned while the total is positive.
        """
        mass = torch.as_tensor(mass, dtype=torch.float64).reshape(-1).clone()
        node = torch.ones(mass.numel(), dtype=torch.int64)
        for _ in range(self.depth):
            left = 2 * node
            left_sum = self.sums[left]
            right_nonempty = self.sums[left + 1] > 0
            go_right = ((mass >= left_sum) & right_nonempty) | (left_sum <= 0)
            mass = torch.where(go_right, mass - left_sum, mass)
            node = left + go_right.to(torch.int64)
        return node - self.capacity
