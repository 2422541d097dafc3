"""The layout of stored row ids: which collector wrote a row is in its id's high bits.

``group_id`` and ``trajectory_id`` are ``(collector_index << ID_COUNTER_BITS) | counter``:
collector ``k`` counts its groups and trajectories from 0, and the index in the high bits
keeps ids unique across the shards of one buffer (one collector per shard) and across
restarts (the counters are part of a collector's saved position). Readers (the learner's
``collectors_in_batch`` metric, curation by collector) take the index back with
:func:`collector_index_of`, so this layout is a property of stored rows, like the schema.
Design: docs/architecture.md#rows-and-the-padded-batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the launcher checks --collectors against MAX_COLLECTORS without loading torch
    import torch

ID_COUNTER_BITS = 40  # 1.1e12 trajectories per collector before ids would collide
MAX_COLLECTORS = 2 ** (63 - ID_COUNTER_BITS)  # ids stay positive int64


def id_base(collector_index: int) -> int:
    """The first id of collector ``collector_index``; its ids are ``id_base(k) + counter``."""
    if not 0 <= collector_index < MAX_COLLECTORS:
        raise ValueError(f"collector index must be in [0, {MAX_COLLECTORS}), got {collector_index}")
    return collector_index << ID_COUNTER_BITS


def collector_index_of(ids: torch.Tensor) -> torch.Tensor:
    """The index of the collector that wrote each id (same shape as ``ids``)."""
    return ids >> ID_COUNTER_BITS
