"""Locating sampled rows of a Zarr store for the fused padded read (``store.read_padded``).

Each unit the batch touches comes from the decoded-unit cache (:mod:`.unit_cache`; decoded on a miss), its
rows' spans and row fields are looked up vectorized, and its value arrays become one source of the
:class:`~.padded_rows.LocatedRows` that :func:`~.padded_rows.fill_padded` copies from. Units stay
referenced until the copy ends, so one the cache did not keep is reduced at once to the sampled rows'
slices. A unit deleted under a reader raises the store's ``_UnitGone`` from ``store._unit``; the store
refreshes and retries, as for ``read``. Design: docs/zarr-layout.md#reading-from-decoded-units."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from rlhf_pipeline.storage.padded_rows import LocatedRows, UnitSource, unit_source
from rlhf_pipeline.storage.zarr.unit_cache import DecodedUnit

if TYPE_CHECKING:
    from rlhf_pipeline.storage.zarr.store import ZarrTrajectoryStore


def locate_rows(store: ZarrTrajectoryStore, ids: np.ndarray, view) -> LocatedRows:
    """Where the rows ``ids`` (global, all published in ``view``) are, in that order."""
    located = LocatedRows.empty(len(ids), store.schema)
    units, starts = view
    which = np.searchsorted(starts, ids, side="right") - 1
    for number, k in enumerate(np.unique(which).tolist()):
        unit = units[k]
        decoded = store._unit(unit)
        arrays = decoded.arrays
        rows = np.flatnonzero(which == k)
        local = ids[rows] - unit.first_row
        for name, row_starts, lengths in (("prompt_offsets", located.prompt_start, located.prompt_len),
                                          ("response_offsets", located.response_start, located.response_len)):
            offsets = arrays[name]
            first = offsets[local]
            row_starts[rows] = first
            lengths[rows] = offsets[local + 1] - first
        located.source[rows] = number
        for name, out in located.rows.items():
            out[rows] = arrays[name][local]
        if unit.name in store.cache:
            located.sources.append(_cached_source(decoded, located.float_names))
        else:  # too big to be kept: hold only the sampled rows' slices
            values = _compact(_values(arrays, located.float_names), located, rows)
            located.sources.append(unit_source(values[0], values[1], values[2:]))
    return located


def _values(arrays: dict[str, np.ndarray], float_names: tuple[str, ...]) -> tuple[np.ndarray, ...]:
    return tuple(arrays[name] for name in ("prompt_tokens", "response_tokens", *float_names))


def _cached_source(decoded: DecodedUnit, float_names: tuple[str, ...]) -> UnitSource:
    """The unit's copy source, made once per decoded unit the cache holds (~2 us per unit and batch)."""
    if decoded.padded_source is None:
        values = _values(decoded.arrays, float_names)
        decoded.padded_source = unit_source(values[0], values[1], values[2:])
    return decoded.padded_source


def _compact(values: tuple[np.ndarray, ...], located: LocatedRows, rows: np.ndarray) -> tuple[np.ndarray, ...]:
    """Copies of just ``rows``' prompt and response slices; their spans are rewritten to match."""
    out = []
    for start, length, arrays in ((located.prompt_start, located.prompt_len, values[:1]),
                                  (located.response_start, located.response_len, values[1:])):
        first, count = start[rows].tolist(), length[rows].tolist()
        for array in arrays:
            out.append(np.concatenate([array[a : a + n] for a, n in zip(first, count)]))
        new_start = np.zeros(len(rows), dtype=np.int64)
        np.cumsum(length[rows][:-1], out=new_start[1:])
        start[rows] = new_start
    return tuple(out)
