"""Packing plans: which sampled rows share one packed sequence of at most ``budget`` tokens.

The packed learner (``learn/packed.py``) lays the rows of a micro-batch end to end in one
sequence instead of padding them to a rectangle; this module only decides which rows go
together. The plan is first-fit decreasing (FFD) on each row's token count (prompt +
response):

1. order the rows by length, longest first; equal lengths keep their row order (a stable
   sort), so the plan is a pure function of the lengths and the budget: no RNG, and an exact
   resume or a replay packs the same rows the same way;
2. put each row into the first open sequence (in the order they were opened) with room for
   it, or open a new sequence;
3. a row longer than the budget on its own gets a sequence of its own (the only way a
   sequence exceeds the budget), as the padded micro-batching does with such a row.

FFD uses at most ``11/9 * OPT + 6/9`` sequences (Dósa 2007) and, on GRPO-like lengths, fills
them to within a few percent of the ``ceil(total / budget)`` lower bound (see
``tests/learn/test_packing.py``). Inside a sequence, rows are listed in ascending row order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PackPlan:
    """Rows of each packed sequence, and what the plan costs."""

    sequences: tuple[tuple[int, ...], ...]
    """Row indices of each packed sequence, ascending within a sequence; every row exactly once."""
    lengths: tuple[int, ...]
    """Tokens of each row (prompt + response), as planned."""
    budget: int
    """Most tokens of one sequence, except a sequence holding a single longer row."""

    @property
    def sequence_tokens(self) -> list[int]:
        """Tokens of each packed sequence."""
        return [sum(self.lengths[i] for i in rows) for rows in self.sequences]

    @property
    def oversized(self) -> list[int]:
        """Rows longer than the budget (each alone in its sequence)."""
        return [i for i, n in enumerate(self.lengths) if n > self.budget]

    @property
    def utilisation(self) -> float:
        """Tokens over the capacity of the sequences used (``len(sequences) * budget``; an
        over-long row's sequence counts its own length as capacity)."""
        capacity = sum(max(self.budget, tokens) for tokens in self.sequence_tokens)
        return sum(self.lengths) / capacity if capacity else 1.0

    @property
    def lower_bound(self) -> int:
        """No plan can use fewer sequences: the over-long rows, plus the rest's tokens over the budget."""
        fitting = sum(n for n in self.lengths if n <= self.budget)
        return len(self.oversized) + -(-fitting // self.budget)


def plan_packs(lengths: Sequence[int], budget: int) -> PackPlan:
    """First-fit-decreasing plan of rows of ``lengths`` tokens into sequences of ``budget`` tokens.

    Runs in ``O(n log n + n * s)`` for n rows and s sequences; the first-fit search keeps, per
    open sequence, its remaining room and stops at the first that fits.
    """
    if budget < 1:
        raise ValueError(f"budget must be >= 1 token (got {budget})")
    lengths = tuple(int(n) for n in lengths)
    if any(n < 0 for n in lengths):
        raise ValueError(f"row lengths must be >= 0 (got {min(lengths)})")
    # longest first; a stable sort keeps row order among equal lengths (determinism)
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rooms: list[int] = []  # remaining room of each open sequence, in opening order
    members: list[list[int]] = []
    alone: list[list[int]] = []  # over-long rows, each in its own sequence
    for i in order:
        n = lengths[i]
        if n > budget:
            alone.append([i])
            continue
        for k, room in enumerate(rooms):
            if room >= n:
                rooms[k] -= n
                members[k].append(i)
                break
        else:
            rooms.append(budget - n)
            members.append([i])
    sequences = tuple(tuple(sorted(rows)) for rows in alone + members)
    return PackPlan(sequences=sequences, lengths=lengths, budget=budget)
