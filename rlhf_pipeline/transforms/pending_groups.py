"""Rows of GRPO groups not whole yet (:class:`PendingGroups`), held by the group-advantage transform until
their group is. They are part of the write path's state, which the buffer publishes with every append
as the store's ``writer_state`` (``storage/writer_state.py``) in the same atomic step as the rows, so a
writer killed at any moment restarts with exactly the pending rows that go with the rows stored. The
snapshot holds tensors only (token fields as values + offsets, text as UTF-8 bytes + offsets, never
pickled objects), so it loads with ``weights_only=True``. Design: docs/write-path.md#the-transforms.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rlhf_pipeline.schema.ragged import RaggedTensor
from rlhf_pipeline.schema import FIELDS_BY_NAME, TrajectoryBatch

FORMAT_VERSION = 2


class PendingGroups:
    """Rows of incomplete groups (``rows``), and the transform's counters saved with them."""

    def __init__(self) -> None:
        self.rows: TrajectoryBatch | None = None
        # metrics counters saved with the snapshot; the owning transform shares this dict
        self.counters: dict[str, int] = {}

    # ------------------------------------------------------------------ views
    @property
    def num_rows(self) -> int:
        return 0 if self.rows is None else len(self.rows)

    @property
    def num_groups(self) -> int:
        return 0 if self.rows is None else int(torch.unique(self.rows["group_id"]).numel())

    @property
    def num_trajectories(self) -> int:
        return 0 if self.rows is None else int(torch.unique(self.rows["trajectory_id"]).numel())

    def trajectory_ids(self) -> torch.Tensor:
        """Trajectory ids held pending (a resuming writer must not send these again)."""
        if self.rows is None:
            return torch.zeros(0, dtype=torch.int64)
        return torch.unique(self.rows["trajectory_id"])

    # ------------------------------------------------------------------ mutation
    def add(self, rows: TrajectoryBatch) -> None:
        self.rows = rows if self.rows is None else TrajectoryBatch.cat([self.rows, rows])

    def complete(self, done_groups: torch.Tensor) -> None:
        """The pending rows of ``done_groups`` leave (their groups are whole in this write)."""
        if self.rows is None or done_groups.numel() == 0:
            return
        keep = torch.nonzero(~torch.isin(self.rows["group_id"], done_groups)).squeeze(1)
        self.rows = self.rows.select(keep) if keep.numel() else None

    # ------------------------------------------------------------------ state
    def to_payload(self) -> dict[str, Any]:
        return {"format_version": FORMAT_VERSION, "rows": None if self.rows is None else encode_batch(self.rows),
                "counters": dict(self.counters)}

    def load_payload(self, payload: Mapping[str, Any]) -> None:
        version = payload.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(f"pending-group state has format version {version}; this code reads {FORMAT_VERSION}")
        self.counters.clear()
        self.counters.update({k: int(v) for k, v in payload.get("counters", {}).items()})
        self.rows = None if payload["rows"] is None else decode_batch(payload["rows"])


# ============================================================================ encoding
def encode_batch(batch: TrajectoryBatch) -> dict[str, torch.Tensor]:
    """A batch as a flat dict of tensors (safe for ``torch.load(weights_only=True)``)."""
    out: dict[str, torch.Tensor] = {}
    for name in batch.field_names:
        col = batch[name]
        if isinstance(col, RaggedTensor):
            out[f"{name}.values"], out[f"{name}.offsets"] = col.values, col.offsets
        elif isinstance(col, torch.Tensor):
            out[name] = col
        else:
            encoded = [s.encode("utf-8") for s in col]
            lengths = torch.tensor([len(b) for b in encoded], dtype=torch.int64)
            blob = b"".join(encoded)
            out[f"{name}.bytes"] = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else \
                torch.zeros(0, dtype=torch.uint8)
            out[f"{name}.offsets"] = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return out


def decode_batch(data: Mapping[str, torch.Tensor]) -> TrajectoryBatch:
    columns: dict[str, Any] = {}
    names = {key.split(".", 1)[0] for key in data}
    for name in names:
        kind = FIELDS_BY_NAME[name].kind
        if kind == "token":
            columns[name] = RaggedTensor(data[f"{name}.values"], data[f"{name}.offsets"])
        elif kind == "row":
            columns[name] = data[name]
        else:
            blob = data[f"{name}.bytes"].numpy().tobytes()
            offsets = data[f"{name}.offsets"].tolist()
            columns[name] = [blob[a:b].decode("utf-8") for a, b in zip(offsets[:-1], offsets[1:])]
    return TrajectoryBatch(columns)

