"""A sum tree and a min tree over a growing array of weights, vectorized with NumPy.

What a prioritized sampler needs, with no compiled extension: :meth:`SumMinTree.set` writes B leaves and
:meth:`SumMinTree.find` maps B masses to leaves, each O(B log N); :meth:`SumMinTree.rebuild` is O(N).
Nodes have ``FANOUT`` (32) children and float64 values; every node is recomputed from its children, so
the tree depends only on its current leaves and one rebuilt from saved leaves samples exactly as before.

Design: docs/curation.md#prioritized-sampling.
"""

from __future__ import annotations

import numpy as np

FANOUT = 32


class SumMinTree:
    """Sums and minima of ``capacity`` non-negative leaves (grows by doubling)."""

    def __init__(self, capacity: int = 1024) -> None:
        self._allocate(max(int(capacity), 1))

    def _allocate(self, capacity: int) -> None:
        capacity = -(-capacity // FANOUT) * FANOUT  # a whole number of sibling blocks
        self.capacity = capacity
        # levels[0] = leaves; levels[-1] = the root; each level padded to a multiple of FANOUT
        self.sums: list[np.ndarray] = []
        self.mins: list[np.ndarray] = []
        size = capacity
        while True:
            padded = -(-size // FANOUT) * FANOUT if size > 1 else 1
            self.sums.append(np.zeros(padded))
            self.mins.append(np.full(padded, np.inf))
            if size == 1:
                break
            size = -(-size // FANOUT)

    @property
    def depth(self) -> int:
        return len(self.sums) - 1

    def leaves(self, count: int | None = None) -> np.ndarray:
        """The first ``count`` leaves (a view; do not write to it)."""
        return self.sums[0][: self.capacity if count is None else count]

    def total(self) -> float:
        return float(self.sums[-1][0])

    def minimum(self) -> float:
        return float(self.mins[-1][0])

    def rebuild(self, values: np.ndarray) -> None:
        """Leaves ``[0, len(values))`` set to ``values``, every other leaf empty; capacity grows to fit."""
        values = np.asarray(values, dtype=np.float64).reshape(-1)
        if values.size > self.capacity:
            self._allocate(max(values.size, 2 * self.capacity))
        leaves, low = self.sums[0], self.mins[0]
        leaves[:] = 0.0
        leaves[: values.size] = values
        low[:] = np.where(leaves > 0, leaves, np.inf)
        for level in range(1, len(self.sums)):
            parents = self.sums[level - 1].size // FANOUT
            self.sums[level][:parents] = _block_sums(self.sums[level - 1], np.arange(parents))
            self.mins[level][:parents] = self.mins[level - 1].reshape(-1, FANOUT).min(axis=1)

    def set(self, index: np.ndarray, values: np.ndarray | float) -> None:
        """Leaves ``index`` set to ``values`` (a zero leaf is empty: never found, ignored by the min)."""
        index = np.asarray(index, dtype=np.int64).reshape(-1)
        if index.size == 0:
            return
        if int(index.max()) >= self.capacity:
            grown = self.leaves().copy()
            self._allocate(max(int(index.max()) + 1, 2 * self.capacity))
            self.rebuild(grown)
        values = np.broadcast_to(np.asarray(values, dtype=np.float64).reshape(-1), index.shape)
        self.sums[0][index] = values  # a repeated index keeps one of its values, as plain assignment does
        self.mins[0][index] = np.where(self.sums[0][index] > 0, self.sums[0][index], np.inf)
        node = np.unique(index // FANOUT)
        for level in range(1, len(self.sums)):
            self.sums[level][node] = _block_sums(self.sums[level - 1], node)
            self.mins[level][node] = self.mins[level - 1].reshape(-1, FANOUT)[node].min(axis=1)
            node = np.unique(node // FANOUT)

    def find(self, mass: np.ndarray) -> np.ndarray:
        """For each mass in ``[0, total)``: the leaf ``i`` with ``sum(leaves[:i]) <= mass < sum(leaves[:i+1])``.

        A mass that rounding pushed to ``total`` or beyond lands on the last non-empty leaf; an
        empty leaf is never returned while the total is positive.
        """
        mass = np.array(mass, dtype=np.float64).reshape(-1)
        node = np.zeros(mass.size, dtype=np.int64)
        rows = np.arange(mass.size)
        past = np.zeros(mass.size, dtype=bool)
        for level in range(len(self.sums) - 2, -1, -1):
            children = self.sums[level].reshape(-1, FANOUT)[node]  # (B, FANOUT)
            cumulative = np.cumsum(children, axis=1)
            choice = (cumulative <= mass[:, None]).sum(axis=1)
            # the mass reached the node's stored total (rounding; the running sum of the children
            # can round a leaf's end to just past it): the node's last non-empty child, and below it
            # the last non-empty child again, whatever the subtraction left (a last leaf of 5e-324
            # adds nothing to the total, and total - S0 can round to just below the last node's sum)
            past |= (choice == FANOUT) | (mass >= self.sums[level + 1][node])
            if past.any():
                choice[past] = FANOUT - 1 - np.argmax(children[past, ::-1] > 0, axis=1)
            mass -= np.where(choice > 0, cumulative[rows, choice - 1], 0.0)  # choice 0 reads column -1, unused
            np.maximum(mass, 0.0, out=mass)  # rounding must not send a mass below the first non-empty child
            node = node * FANOUT + choice
        return node

    def leaf_values(self, index: np.ndarray) -> np.ndarray:
        return self.sums[0][np.asarray(index, dtype=np.int64)]


def _block_sums(child: np.ndarray, parents: np.ndarray) -> np.ndarray:
    """Sum of each parent's FANOUT children: one reduction, whether for some parents or all."""
    return child.reshape(-1, FANOUT)[parents].sum(axis=1)
