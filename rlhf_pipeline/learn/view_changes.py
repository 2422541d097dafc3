"""Commit records sent from rank 0 to the other data-parallel ranks, each part at most once.

Rank 0 sends the commit records its refresh read (``rank_slices.py``): at setup every shard's, then
with each draw those that changed. A record is mostly what its shard was made with (schema, codecs,
the units' layout: ~1.8 KB, the same in every shard a run makes) and a small part its writer
changes (``first_row``, ``next_row``, the units and their constants). Sent whole, 640 changed shards
are ~1.2 MB a step and 6,400 are ~12 MB (docs/scaling.md, section 5). :class:`ViewChanges` carries
each shard's changing keys, and a fixed part only where the receiving ranks do not hold it: once
per distinct fixed part at setup, then only for a shard that is new or whose fixed part changed (a
writer that upgraded a format 1 store). Rank 0 (:func:`pack_changes`, against the records it sent
before) and each other rank (:class:`ReceivedRecords`, holding the records it was sent) keep the same
records draw after draw, since draws are shared in order; so a rank rebuilds exactly rank 0's
records, as if they had been sent whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: what a shard's writers change in its commit record (an object store's records name the writer that
#: published them); the rest is fixed when the shard is made
CHANGING_KEYS = frozenset({"first_row", "next_row", "units", "unit_constants", "writer"})
#: in :attr:`ViewChanges.records`: the receiver holds this shard's fixed part already
AS_HELD = -1

Records = dict[str, dict[str, Any]]


@dataclass
class ViewChanges:
    """Changed commit records by shard key, as sent to the other ranks."""

    fixed: list[dict[str, Any]]  # each distinct fixed part not held by the receivers, once
    records: dict[str, tuple[int, dict[str, Any]]]  # key -> (index into fixed, or AS_HELD; the changing keys)

    def __len__(self) -> int:
        return len(self.records)


def split_record(record: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(fixed part, changing part)`` of a commit record."""
    fixed, changing = {}, {}
    for key, value in record.items():
        (changing if key in CHANGING_KEYS else fixed)[key] = value
    return fixed, changing


def pack_changes(changed: Records, held: Records) -> ViewChanges:
    """``changed`` records for receivers that hold ``held`` (the records sent to them before)."""
    fixed_parts: list[dict[str, Any]] = []
    records: dict[str, tuple[int, dict[str, Any]]] = {}
    for key, record in changed.items():
        fixed, changing = split_record(record)
        before = held.get(key)
        if before is not None and split_record(before)[0] == fixed:
            records[key] = (AS_HELD, changing)
            continue
        index = next((i for i, part in enumerate(fixed_parts) if part == fixed), None)
        if index is None:
            fixed_parts.append(fixed)
            index = len(fixed_parts) - 1
        records[key] = (index, changing)
    return ViewChanges(fixed_parts, records)


class ReceivedRecords:
    """Another rank's copy of the records rank 0 has sent it; turns :class:`ViewChanges` into records."""

    def __init__(self) -> None:
        self._held: Records = {}

    def unpack(self, changes: ViewChanges) -> Records:
        """The whole records ``changes`` stands for, now held."""
        out: Records = {}
        for key, (index, changing) in changes.records.items():
            if index == AS_HELD:
                before = self._held.get(key)
                if before is None:
                    raise RuntimeError(f"rank 0 sent the changes of shard {key}'s commit record, whose fixed part "
                                       f"this rank was never sent: were draws shared out of order?")
                fixed = split_record(before)[0]
            else:
                fixed = changes.fixed[index]
            out[key] = {**fixed, **changing}
        self._held.update(out)
        return out
