"""A Zarr store's reader side (``ZarrReading``): rows read from whole decoded units, retried past a compaction.

Every chunk is checked as it is decoded (format 2's CRC32C, cheap next to decompression, and the exact
size the record implies): damage raises ``StoreCorruptedError`` naming the chunk, never wrong rows, and
only that unit's rows are unreadable. Rows come from whole decoded units in a byte-bounded LRU
(:mod:`.unit_cache`; one Zarr read costs ~1 ms); a read of fields the record knows to be constant in a
unit needs no unit (:mod:`.unit_constants`). A unit compacted or evicted after the record a read used is
read again from the newer record; rows evicted meanwhile give an ``IndexError`` naming them.
Design: docs/zarr-layout.md#reading-from-decoded-units."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from rlhf_pipeline.schema import TrajectoryBatch
from rlhf_pipeline.storage.base import StoreCorruptedError
from rlhf_pipeline.storage.padded_rows import LocatedRows
from rlhf_pipeline.storage.zarr.padded import locate_rows
from rlhf_pipeline.storage.zarr.unit_cache import DecodedUnit, gather_rows
from rlhf_pipeline.storage.zarr.unit_constants import answerable, unit_from_record
from rlhf_pipeline.storage.zarr.units import UnitGone, UnitRef


class ZarrReading:
    """The read path of :class:`~rlhf_pipeline.storage.zarr.store.ZarrTrajectoryStore`, which holds the
    published view (units and their first rows), the decoded-unit cache and the unit I/O."""

    def unit_bounds(self) -> list[tuple[int, int]]:
        """One range per published unit (sealed segment or tail fragment): a read decodes whole units."""
        units, _ = self._view
        first, stop = self._first_row, self._next_row
        return [(max(u.first_row, first) - first, min(u.first_row + u.rows, stop) - first)
                for u in units if min(u.first_row + u.rows, stop) > max(u.first_row, first)]

    def _read_global(self, global_ids: torch.Tensor, fields: tuple[str, ...] | None = None) -> TrajectoryBatch:
        names = self._schema.field_names if fields is None else fields
        return self._with_current_units(global_ids.numpy(), lambda ids, view: self._gather(ids, names, view))

    def _locate_rows(self, global_ids: torch.Tensor) -> LocatedRows:
        return self._with_current_units(global_ids.numpy(), lambda ids, view: locate_rows(self, ids, view))

    def _with_current_units(self, ids: np.ndarray, read: Callable[[np.ndarray, Any], Any]) -> Any:
        """``read(ids, units view)``, retried on a newer view when a unit was deleted under it."""
        self._check_open()
        view = self._view
        for _ in range(16):
            try:
                return read(ids, view)
            except UnitGone as gone:
                missing = gone
            # compacted or evicted after the record we read (a reader's last refresh, or a seal on
            # this writer's background thread): the rows live on in a unit the newer record names
            if not self._writable:
                self.refresh(force=True)
                if ids.size and int(ids.min()) < self._first_row:
                    raise IndexError(
                        f"rows from {int(ids.min())} were evicted while being read; the store now holds "
                        f"[{self._first_row}, {self._next_row})"
                    ) from None
            if self._view is view:
                break
            view = self._view
        raise StoreCorruptedError(
            f"{self._location}: chunk {missing} of a published unit is missing; the store was "
            f"damaged outside this library. The store's other units still read; "
            f"`rlhf-pipeline repair {self._location}` reports what is lost."
        ) from None

    def _gather(self, ids: np.ndarray, names: tuple[str, ...], view) -> TrajectoryBatch:
        units, starts = view
        which = np.searchsorted(starts, ids, side="right") - 1
        constants = self._constants if answerable(names) else {}

        def parts():
            for k in np.unique(which).tolist():
                positions = np.flatnonzero(which == k)
                unit = units[k]
                known = unit_from_record(unit, constants, names) if constants else None
                if known is not None:  # the record holds these fields' one value: no GET, no decode
                    yield positions, np.zeros(positions.size, dtype=np.int64), lambda known=known: known
                    continue
                yield positions, ids[positions] - unit.first_row, lambda unit=unit: self._unit(unit)

        return gather_rows(self._schema, names, ids.size, parts())

    def _unit(self, unit: UnitRef) -> DecodedUnit:
        return self._cache.get(unit.name, lambda: self._load_unit(unit))

    def _load_unit(self, unit: UnitRef) -> DecodedUnit:
        return DecodedUnit(unit.first_row, unit.rows, self.unit_io.read(unit))
