"""Telling this project's stores from torchrl's own storages by what they can do.

``AppendWriter`` and ``PrioritizedSampler`` are torchrl components that also run over torchrl's
storages (a ``ListStorage``, a ``LazyMemmapStorage``). Over one of ours (any backend, a sharded
reader, a selection) they append where the store decides and read rows by global position. They
ask the storage for that capability instead of checking its class: ``storage/base.py`` attaches
them as a ``ReplayBuffer``'s defaults, so they must not import it back.

Design: docs/torchrl.md.
"""

from __future__ import annotations

from typing import Any


def is_trajectory_store(storage: Any) -> bool:
    """True when ``storage`` is one of ours: it appends at positions it decides (``next_row``) and
    reads rows by global position (``read_global``)."""
    return callable(getattr(storage, "read_global", None)) and hasattr(type(storage), "next_row")
