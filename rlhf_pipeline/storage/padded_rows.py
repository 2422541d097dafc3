"""Backend-neutral core of the fused reads (``TrajectoryStore.read_padded`` and ``read_ragged``).

``store.read_padded(positions)`` returns exactly ``pad_batch(store.read(positions,
fields=padded_fields(store.schema)))`` without the intermediate ``TrajectoryBatch``: the backend locates
the rows (:class:`LocatedRows`: the unit holding each, its prompt and response slices, its row fields),
then :func:`fill_padded` copies each row's slices into the padded tensors, or :func:`fill_ragged` end to
end into flat arrays (the packed learner's input), in a loop over the sampled rows, never the store.

Design: docs/storage.md#reading-straight-into-the-batch.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from tensordict import TensorDict

from rlhf_pipeline.schema.padding import RESPONSE_FLOAT_KEYS, assemble_padded
from rlhf_pipeline.schema import FIELDS_BY_NAME, NUMPY_DTYPES, StoreSchema, TrajectoryBatch
from rlhf_pipeline.schema.ragged import RaggedTensor, lengths_to_offsets

ROW_FIELDS = ("reward", "done", "terminated", "truncated", "group_id", "trajectory_id", "step",
              "policy_version", "advantage")
_INT32, _FLOAT32 = np.dtype("<i4"), np.dtype("<f4")

# One unit's values, as fill_padded reads them: (prompt tokens, response tokens,
# (response-aligned float fields in field_plan order)), each a flat memoryview.
UnitSource = tuple[memoryview, memoryview, tuple[memoryview, ...]]


@functools.lru_cache(maxsize=64)
def field_plan(schema: StoreSchema) -> tuple[tuple[str, ...], tuple[tuple[str, np.dtype], ...]]:
    """(response-aligned float fields, (row field, numpy dtype) pairs) that ``schema`` holds."""
    floats = tuple(name for name in RESPONSE_FLOAT_KEYS if name in schema.field_names)
    rows = tuple((name, NUMPY_DTYPES[FIELDS_BY_NAME[name].dtype]) for name in ROW_FIELDS
                 if name in schema.field_names)
    return floats, rows


def located_fields(schema: StoreSchema) -> tuple[str, ...]:
    """The fields a located row carries, so :func:`fill_ragged` gives (and ``read_ragged`` reads):
    tokens, the response-aligned float fields and the row fields the padded batch holds."""
    floats, rows = field_plan(schema)
    return ("prompt_tokens", "response_tokens", *floats, *(name for name, _ in rows))


def unit_source(prompt_values: np.ndarray, response_values: np.ndarray,
                float_values: Sequence[np.ndarray]) -> UnitSource:
    """A unit's flat value arrays as the memoryviews :func:`fill_padded` copies from.

    The copy loop assigns memoryview slices, which needs equal formats on both sides:
    tokens as int32 (as stored), floats as float32.
    """
    return (memoryview(np.ascontiguousarray(prompt_values, dtype=_INT32)),
            memoryview(np.ascontiguousarray(response_values, dtype=_INT32)),
            tuple(memoryview(np.ascontiguousarray(v, dtype=_FLOAT32)) for v in float_values))


@dataclass
class LocatedRows:
    """Where each of B sampled rows is: what :func:`fill_padded` copies from.

    Row ``b`` lives in unit ``sources[source[b]]`` (an entry no row points at may be None);
    its prompt is
    ``prompt values[prompt_start[b] : prompt_start[b] + prompt_len[b]]`` there, its response
    (and every response-aligned float field, validated to the same lengths)
    ``[response_start[b] : response_start[b] + response_len[b]]``.
    """

    float_names: tuple[str, ...]  # response-aligned float fields, in field_plan order
    source: np.ndarray  # (B,) int64 index into sources
    prompt_start: np.ndarray  # (B,) int64
    prompt_len: np.ndarray  # (B,) int64
    response_start: np.ndarray  # (B,) int64
    response_len: np.ndarray  # (B,) int64
    rows: dict[str, np.ndarray]  # row field -> (B,) values in the schema's dtype
    sources: list[UnitSource | None] = field(default_factory=list)

    @classmethod
    def empty(cls, num_rows: int, schema: StoreSchema) -> LocatedRows:
        """Uninitialised arrays for ``num_rows`` rows, for a backend that fills them unit by unit."""
        float_names, row_fields = field_plan(schema)
        spans = [np.empty(num_rows, dtype=np.int64) for _ in range(5)]
        return cls(float_names, *spans, {name: np.empty(num_rows, dtype=dtype) for name, dtype in row_fields})

    def __len__(self) -> int:
        return len(self.source)

    @classmethod
    def merge(cls, parts: Sequence[tuple[np.ndarray, LocatedRows]], num_rows: int,
              schema: StoreSchema) -> LocatedRows:
        """One answer from several ``(where, part)`` answers: ``part``'s rows go to rows ``where``."""
        out = cls.empty(num_rows, schema)
        for where, part in parts:
            out.source[where] = part.source + len(out.sources)
            out.sources.extend(part.sources)
            for name in ("prompt_start", "prompt_len", "response_start", "response_len"):
                getattr(out, name)[where] = getattr(part, name)
            for name, values in part.rows.items():
                out.rows[name][where] = values
        return out


def fill_padded(located: LocatedRows, pad_token_id: int, index_dtype: torch.dtype = torch.int64) -> TensorDict:
    """The padded batch of the rows ``located`` describes (docs/storage.md#reading-straight-into-the-batch);
    token ids and ``position_ids`` in ``index_dtype`` (the ids are copied as int32, as stored, and widened
    only for int64)."""
    num_rows = len(located)
    if num_rows == 0:
        raise ValueError("pad_batch got an empty batch; sample at least one row")
    prompt_len, response_len = located.prompt_len, located.response_len
    prompt_width = int(prompt_len.max())
    width = prompt_width + int(response_len.max())
    tokens32 = torch.full((num_rows, width), pad_token_id, dtype=torch.int32)
    floats_full = {name: torch.zeros((num_rows, width), dtype=torch.float32) for name in located.float_names}
    tokens_out = memoryview(tokens32.view(-1).numpy())
    floats_out = tuple(memoryview(values.view(-1).numpy()) for values in floats_full.values())

    # flat destinations: each prompt ends at column P of its row, each response starts there
    response_at = np.arange(num_rows, dtype=np.int64) * width + prompt_width
    prompt_stop, response_stop = located.prompt_start + prompt_len, located.response_start + response_len
    sources = located.sources
    for source, p_start, p_stop, r_start, r_stop, p_at, r_at, r_end in zip(
        located.source.tolist(), located.prompt_start.tolist(), prompt_stop.tolist(),
        located.response_start.tolist(), response_stop.tolist(), (response_at - prompt_len).tolist(),
        response_at.tolist(), (response_at + response_len).tolist(),
    ):
        prompt_values, response_values, float_values = sources[source]
        tokens_out[p_at:r_at] = prompt_values[p_start:p_stop]
        tokens_out[r_at:r_end] = response_values[r_start:r_stop]
        for out, values in zip(floats_out, float_values):
            out[r_at:r_end] = values[r_start:r_stop]

    rows = {name: torch.from_numpy(values) for name, values in located.rows.items()}
    return assemble_padded(
        tokens32 if index_dtype == torch.int32 else tokens32.to(index_dtype), prompt_width, torch.from_numpy(prompt_len), torch.from_numpy(response_len),
        floats_full, rows,
    )


def fill_ragged(located: LocatedRows) -> TrajectoryBatch:
    """The rows ``located`` describes as ragged columns (:func:`located_fields`), in their order:
    each row's prompt, response and response-aligned float slices copied end to end into one flat
    array per field (tokens int32 and floats float32, as stored), no padding anywhere."""
    prompt_len, response_len = located.prompt_len, located.response_len
    prompt_offsets = lengths_to_offsets(torch.from_numpy(prompt_len))
    response_offsets = lengths_to_offsets(torch.from_numpy(response_len))
    prompt_values = torch.empty(int(prompt_offsets[-1]), dtype=torch.int32)
    response_values = torch.empty(int(response_offsets[-1]), dtype=torch.int32)
    float_values = [torch.empty(response_values.numel(), dtype=torch.float32) for _ in located.float_names]
    prompt_out, response_out = memoryview(prompt_values.numpy()), memoryview(response_values.numpy())
    floats_out = tuple(memoryview(values.numpy()) for values in float_values)
    sources = located.sources
    for source, p_start, p_stop, r_start, r_stop, p_at, p_end, r_at, r_end in zip(
        located.source.tolist(), located.prompt_start.tolist(), (located.prompt_start + prompt_len).tolist(),
        located.response_start.tolist(), (located.response_start + response_len).tolist(),
        prompt_offsets[:-1].tolist(), prompt_offsets[1:].tolist(), response_offsets[:-1].tolist(),
        response_offsets[1:].tolist(),
    ):
        prompt_source, response_source, float_sources = sources[source]
        prompt_out[p_at:p_end] = prompt_source[p_start:p_stop]
        response_out[r_at:r_end] = response_source[r_start:r_stop]
        for out, values in zip(floats_out, float_sources):
            out[r_at:r_end] = values[r_start:r_stop]
    columns = {
        "prompt_tokens": RaggedTensor(prompt_values, prompt_offsets),
        "response_tokens": RaggedTensor(response_values, response_offsets),
        **{name: RaggedTensor(values, response_offsets) for name, values in zip(located.float_names, float_values)},
        **{name: torch.from_numpy(values) for name, values in located.rows.items()},
    }
    return TrajectoryBatch(columns)
