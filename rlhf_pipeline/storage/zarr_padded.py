"""Fused read-and-pad for the Zarr store: sampled rows copied from decoded units into the learner tensors.

``ZarrTrajectoryStore.read_padded(positions)`` returns exactly
``pad_batch(store.read(positions, fields=padded_fields(store.schema)), pad_token_id=...)``
(same keys, dtypes, values and views), without the intermediate ``TrajectoryBatch``:
each unit (sealed segment or fragment) the batch touches is taken from the store's
decoded-unit cache (:mod:`.segment_cache`; decoded on a miss), its rows' spans are
looked up vectorized in its offsets, and :func:`~.padded_rows.fill_padded` (shared with
the memmap store) copies each row's slices straight into the padded tensors.

Memory: the decoded units stay referenced until the copy loop ends. A unit the cache
did not keep (one larger than the whole cache) is reduced at once to the sampled rows'
slices, so, as with ``store.read``, a batch never holds more than those slices of the
units the cache dropped.

A unit deleted under a reader (compacted or evicted) raises the store's ``_UnitGone``
from ``store._unit``; the store's ``_read_global`` refreshes and retries, as for ``read``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from tensordict import TensorDict

from rlhf_pipeline.storage.padded_rows import RowSpans, field_plan, fill_padded, read_padded

if TYPE_CHECKING:
    from rlhf_pipeline.storage.zarr_store import ZarrTrajectoryStore


def store_read_padded(store: ZarrTrajectoryStore, positions: torch.Tensor | list[int], *, pad_token_id: int = 0,
                      pin_memory: bool = False, device: torch.device | str | None = None) -> TensorDict:
    """``ZarrTrajectoryStore.read_padded``: ``pad_batch(store.read(positions,
    fields=padded_fields(store.schema)), pad_token_id=...)``, fused (module docstring)."""
    return read_padded(store, positions, pad_token_id=pad_token_id, pin_memory=pin_memory, device=device)


def gather_padded(store: ZarrTrajectoryStore, ids: np.ndarray, view, pad_token_id: int) -> TensorDict:
    """The padded batch of rows ``ids`` (global, all published in ``view``), in that order."""
    float_names, row_fields = field_plan(store.schema)
    spans = RowSpans(len(ids), row_fields)  # raises on an empty batch, as pad_batch does
    units, starts = view
    which = np.searchsorted(starts, ids, side="right") - 1
    sources = []  # per unit: (prompt values, response values, response-aligned float values...)
    for number, k in enumerate(np.unique(which).tolist()):
        unit = units[k]
        arrays = store._unit(unit).arrays
        rows = np.flatnonzero(which == k)
        local = ids[rows] - unit.first_row
        for name, row_starts, lengths in (("prompt_offsets", spans.prompt_start, spans.prompt_len),
                                          ("response_offsets", spans.response_start, spans.response_len)):
            offsets = arrays[name]
            first = offsets[local]
            row_starts[rows] = first
            lengths[rows] = offsets[local + 1] - first
        spans.source[rows] = number
        for (name, _), out in zip(row_fields, spans.row_values):
            out[rows] = arrays[name][local]
        values = tuple(arrays[name] for name in ("prompt_tokens", "response_tokens", *float_names))
        if unit.name not in store.cache:  # too big to be kept: hold only the sampled rows' slices
            values = _compact(values, spans, rows)
        sources.append(values)
    return fill_padded(spans, sources, float_names, pad_token_id)


def _compact(values: tuple[np.ndarray, ...], spans: RowSpans, rows: np.ndarray) -> tuple[np.ndarray, ...]:
    """Copies of just ``rows``' prompt and response slices; their spans are rewritten to match."""
    out = []
    for start, length, arrays in ((spans.prompt_start, spans.prompt_len, values[:1]),
                                  (spans.response_start, spans.response_len, values[1:])):
        first, count = start[rows].tolist(), length[rows].tolist()
        for array in arrays:
            out.append(np.concatenate([array[a : a + n] for a, n in zip(first, count)]))
        new_start = np.zeros(len(rows), dtype=np.int64)
        np.cumsum(length[rows][:-1], out=new_start[1:])
        start[rows] = new_start
    return tuple(out)
