"""What a replay buffer publishes as its store's ``writer_state``: the writer's own state and its
write path's, in the append that stores the rows they go with.

Two parts: ``writer`` (what ``rb.extend(rows, writer_state=...)`` passes: a collector's position, id
counters, sampling RNG, pacing counts) and ``write_path`` (each stateful write-path transform's
``get_extra_state``). A transform's state moves forward only when its rows are published. The bytes are
a ``torch.save`` read back with ``weights_only=True``: a state planted in a shared buffer cannot run code.

Design: docs/storage.md#the-writers-state.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import torch

from rlhf_pipeline.files.state_files import load_state_bytes

FORMAT = 2
"""1 was the run's separate position and pending-group files, which a store's writer state replaced."""


def encode(writer: Mapping[str, Any] | None, write_path: list[Any]) -> bytes:
    """The ``writer_state`` bytes of a writer's state and its write path's (docs/storage.md#the-writers-state)."""
    buffer = io.BytesIO()
    torch.save({"format": FORMAT, "writer": None if writer is None else dict(writer),
                "write_path": list(write_path)}, buffer)
    return buffer.getvalue()


def decode(data: bytes | None, where: str, **remedy: str) -> dict[str, Any] | None:
    """``{"writer": ..., "write_path": [...]}`` of published ``writer_state`` bytes (None: none);
    ``remedy=``: what deleting damaged ones leaves (:func:`~rlhf_pipeline.files.state_files.load_state_bytes`)."""
    if data is None:
        return None
    payload = load_state_bytes(data, what="writer state", where=where, **remedy)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"the writer state published in {where} is not format {FORMAT} "
                         f"(found {payload.get('format') if isinstance(payload, dict) else type(payload).__name__})")
    return payload


def stateful_transforms(buffer: Any) -> list[torch.nn.Module]:
    """The buffer's write-path transforms that keep a state (their own ``get_extra_state``)."""
    transform = getattr(buffer, "_transform", None)
    if transform is None:
        return []
    return [m for m in transform.modules()
            if type(m).get_extra_state is not torch.nn.Module.get_extra_state]


def load_write_path(buffer: Any, published: dict[str, Any] | None, where: str) -> None:
    """Puts the published write-path state back into ``buffer``'s transforms (a restarted writer)."""
    if published is None:
        return
    transforms, states = stateful_transforms(buffer), published["write_path"]
    if len(states) != len(transforms):
        raise ValueError(f"the writer state published in {where} holds the state of {len(states)} write-path "
                         f"transforms, this buffer has {len(transforms)}: build it with the write path that "
                         f"wrote the store")
    for transform, state in zip(transforms, states):
        transform.set_extra_state(state)
