"""Ragged tensors as flat values plus offsets: the in-memory twin of the on-disk layout.

A ``RaggedTensor`` holds N variable-length 1-D sequences as one flat ``values``
tensor and an ``offsets`` tensor of N+1 int64 positions (``offsets[0] == 0``,
``offsets[-1] == len(values)``); sequence ``i`` is ``values[offsets[i]:offsets[i+1]]``.
Every operation here is vectorized: no Python loop over rows, so gathering a
batch of 64 sequences costs a handful of tensor ops whatever their lengths.
Design: docs/schema.md#in-memory-trajectorybatch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def lengths_to_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """(N,) lengths -> (N+1,) int64 offsets starting at 0."""
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths.to(torch.int64), dim=0, out=offsets[1:])
    return offsets


def gather_ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Flat positions of the ranges ``[starts[i], starts[i] + lengths[i])``, concatenated.

    The vectorized replacement for ``torch.cat([arange(s, s + n) for s, n in ...])``.
    """
    lengths = lengths.to(torch.int64)
    total = int(lengths.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64)
    # position within the output minus the output offset of its range, plus the range start
    out_offsets = lengths_to_offsets(lengths)[:-1]
    shift = (starts.to(torch.int64) - out_offsets).repeat_interleave(lengths, output_size=total)
    return torch.arange(total, dtype=torch.int64) + shift


@dataclass(frozen=True)
class RaggedTensor:
    """N variable-length 1-D sequences stored as ``values`` (T,) and ``offsets`` (N+1,)."""

    values: torch.Tensor  # (T,) T = total elements over all rows
    offsets: torch.Tensor  # (N+1,) int64, offsets[0] == 0, non-decreasing

    def __post_init__(self) -> None:
        if self.values.dim() != 1:
            raise ValueError(f"RaggedTensor.values must be 1-D, got shape {tuple(self.values.shape)}")
        if self.offsets.dim() != 1 or self.offsets.numel() < 1 or self.offsets.dtype != torch.int64:
            raise ValueError("RaggedTensor.offsets must be a 1-D int64 tensor of N+1 positions")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_sequences(cls, sequences: Sequence, dtype: torch.dtype | None = None) -> RaggedTensor:
        """Builds from a list of 1-D tensors, arrays or lists (a convenience, not a hot path)."""
        tensors = [torch.as_tensor(s, dtype=dtype).reshape(-1) for s in sequences]
        lengths = torch.tensor([t.numel() for t in tensors], dtype=torch.int64)
        if tensors:
            values = torch.cat(tensors)
        else:
            values = torch.zeros(0, dtype=dtype or torch.float32)
        if dtype is not None:
            values = values.to(dtype)
        return cls(values, lengths_to_offsets(lengths))

    @classmethod
    def from_lengths(cls, values: torch.Tensor, lengths: torch.Tensor) -> RaggedTensor:
        return cls(values, lengths_to_offsets(lengths))

    @classmethod
    def from_padded(cls, padded: torch.Tensor, mask: torch.Tensor) -> RaggedTensor:
        """(N, L) padded tensor and (N, L) bool mask of valid entries -> ragged (row-major order)."""
        lengths = mask.sum(dim=1)
        return cls(padded[mask.bool()], lengths_to_offsets(lengths))

    @classmethod
    def cat(cls, parts: Sequence[RaggedTensor]) -> RaggedTensor:
        if not parts:
            raise ValueError("RaggedTensor.cat needs at least one part")
        values = torch.cat([p.values for p in parts])
        lengths = torch.cat([p.lengths() for p in parts])
        return cls(values, lengths_to_offsets(lengths))

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        return self.offsets.numel() - 1

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    def lengths(self) -> torch.Tensor:
        """(N,) int64 length of each sequence."""
        return self.offsets[1:] - self.offsets[:-1]

    def row(self, i: int) -> torch.Tensor:
        return self.values[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def to_list(self) -> list[torch.Tensor]:
        return [self.row(i) for i in range(len(self))]

    def index(self, idx: torch.Tensor | Sequence[int] | slice) -> RaggedTensor:
        """Rows ``idx`` (any order, repeats allowed) as a new, compact RaggedTensor."""
        if isinstance(idx, slice):
            idx = torch.arange(len(self))[idx]
        idx = torch.as_tensor(idx, dtype=torch.int64).reshape(-1)
        starts = self.offsets[idx]
        lengths = self.offsets[idx + 1] - starts
        return RaggedTensor(self.values[gather_ranges(starts, lengths)], lengths_to_offsets(lengths))

    def to(self, dtype: torch.dtype) -> RaggedTensor:
        return RaggedTensor(self.values.to(dtype), self.offsets)

    def to_padded(
        self, pad_value: float | int = 0, side: str = "right", length: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(padded (N, L), mask (N, L) bool)``; ``side`` is ``"right"`` or ``"left"``.

        ``length`` forces L (>= the longest row); by default L is the longest row.
        """
        if side not in ("left", "right"):
            raise ValueError(f"side must be 'left' or 'right', got {side!r}")
        lengths = self.lengths()
        n = len(self)
        longest = int(lengths.max()) if n else 0
        width = longest if length is None else length
        if width < longest:
            raise ValueError(f"to_padded(length={length}) is shorter than the longest row ({longest})")
        padded = torch.full((n, width), pad_value, dtype=self.values.dtype)
        mask = torch.zeros((n, width), dtype=torch.bool)
        if n == 0 or self.values.numel() == 0:
            return padded, mask
        row_of = torch.arange(n).repeat_interleave(lengths, output_size=self.values.numel())
        col = torch.arange(self.values.numel()) - self.offsets[:-1].repeat_interleave(
            lengths, output_size=self.values.numel()
        )
        if side == "left":
            col = col + (width - lengths).repeat_interleave(lengths, output_size=self.values.numel())
        padded[row_of, col] = self.values
        mask[row_of, col] = True
        return padded, mask

    def equal(self, other: RaggedTensor) -> bool:
        return torch.equal(self.offsets, other.offsets) and torch.equal(self.values, other.values)
