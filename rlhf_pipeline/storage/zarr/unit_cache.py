"""Decoded units (segments and tail fragments) in memory (:class:`DecodedUnit`), and a byte-bounded LRU
of them (:class:`SegmentCache`).

Reading one sequence straight from Zarr costs ~1 ms per array, so samplers read from whole decoded units:
one batch of GETs decodes a unit, and a batch of 64 random rows then costs a few vectorized gathers per
unit it touches. The cache bounds the memory this takes to ``capacity_bytes`` whatever the store's size;
a unit larger than the whole cache is still decoded (and served) but not kept.
Design: docs/zarr-layout.md#reading-from-decoded-units."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rlhf_pipeline.schema.ragged import RaggedTensor
from rlhf_pipeline.schema import FieldSpec, StoreSchema, TrajectoryBatch


@dataclass
class DecodedUnit:
    """Columns of one unit, decoded: ``arrays`` maps a layout array name to its values."""

    first_row: int
    rows: int
    arrays: dict[str, np.ndarray]
    # what the fused padded read copies from, made on its first use (zarr.padded._cached_source)
    padded_source: Any = field(default=None, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def gather_rows(schema: StoreSchema, names: tuple[str, ...], n: int,
                parts: Iterable[tuple[np.ndarray, np.ndarray, Callable[[], DecodedUnit]]]) -> TrajectoryBatch:
    """Rows spread over several units, assembled directly in the requested order.

    ``parts`` yields ``(out_positions, local_rows, load_unit)`` per unit touched. Each
    unit is loaded, its rows copied out, and released before the next one is loaded,
    so a batch touching many units never holds more than one that the cache dropped.
    Row fields are one fancy-index per unit; ragged fields are numpy slices (well under
    a microsecond each, far below one torch op) joined once at the end.
    """
    specs = [f for f in schema.fields if f.name in names]
    if n == 0:
        return _empty_batch(specs)
    rows_out: dict[str, np.ndarray] = {}
    pieces: dict[str, list] = {f.name: [None] * n for f in specs if f.kind != "row"}
    lengths: dict[str, np.ndarray] = {}
    for positions, local, load in parts:
        unit = load()
        spans: dict[str, tuple[list[int], list[int]]] = {}
        for spec in specs:
            values = unit.arrays[spec.name]
            if spec.kind == "row":
                if spec.name not in rows_out:
                    rows_out[spec.name] = np.empty(n, dtype=values.dtype)
                rows_out[spec.name][positions] = values[local]
                continue
            offsets_name = f"{spec.aligned_with}_offsets" if spec.kind == "token" else f"{spec.name}_offsets"
            if offsets_name not in spans:
                offsets = unit.arrays[offsets_name]
                starts, stops = offsets[local], offsets[local + 1]
                lengths.setdefault(offsets_name, np.zeros(n, dtype=np.int64))[positions] = stops - starts
                spans[offsets_name] = (starts.tolist(), stops.tolist())
            starts, stops = spans[offsets_name]
            out = pieces[spec.name]
            if spec.kind == "token":
                for p, a, b in zip(positions.tolist(), starts, stops):
                    out[p] = values[a:b].copy()  # a copy: a view would keep the whole unit alive
            else:
                for p, a, b in zip(positions.tolist(), starts, stops):
                    out[p] = bytes(values[a:b]).decode("utf-8")
        del unit
    columns: dict = {}
    for spec in specs:
        if spec.kind == "row":
            columns[spec.name] = torch.from_numpy(rows_out[spec.name])
        elif spec.kind == "token":
            offsets_name = f"{spec.aligned_with}_offsets"
            offsets = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(lengths[offsets_name], out=offsets[1:])
            columns[spec.name] = RaggedTensor(torch.from_numpy(np.concatenate(pieces[spec.name])),
                                              torch.from_numpy(offsets))
        else:
            columns[spec.name] = pieces[spec.name]
    return TrajectoryBatch(columns)


def _empty_batch(specs: Iterable[FieldSpec]) -> TrajectoryBatch:
    columns: dict = {}
    for spec in specs:
        if spec.kind == "token":
            columns[spec.name] = RaggedTensor(torch.zeros(0, dtype=spec.dtype), torch.zeros(1, dtype=torch.int64))
        elif spec.kind == "row":
            columns[spec.name] = torch.zeros(0, dtype=spec.dtype)
        else:
            columns[spec.name] = []
    return TrajectoryBatch(columns)


def encode_columns(batch: TrajectoryBatch, schema: StoreSchema) -> dict[str, np.ndarray]:
    """A validated batch -> the arrays of one unit (the inverse of :meth:`DecodedUnit.gather`)."""
    arrays: dict[str, np.ndarray] = {}
    for spec in schema.fields:
        col = batch[spec.name]
        if spec.kind == "row":
            arrays[spec.name] = col.numpy()
        elif spec.kind == "token":
            arrays[spec.name] = col.values.numpy()
            # fields aligned with the same side share offsets (validation guarantees equality)
            arrays.setdefault(f"{spec.aligned_with}_offsets", col.offsets.numpy())
        else:
            encoded = [s.encode("utf-8") for s in col]
            lengths = np.fromiter((len(b) for b in encoded), dtype=np.int64, count=len(encoded))
            offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            arrays[spec.name] = np.frombuffer(b"".join(encoded), dtype=np.uint8).copy()
            arrays[f"{spec.name}_offsets"] = offsets
    # torch tensors may share memory with the caller's batch: copy so later edits cannot leak in
    return {name: np.array(a, copy=True) for name, a in arrays.items()}


def concat_arrays(parts: list[dict[str, np.ndarray]], layout) -> dict[str, np.ndarray]:
    """Units' arrays end to end (offsets shifted), without building a ``TrajectoryBatch``."""
    if len(parts) == 1:
        return parts[0]
    out: dict[str, np.ndarray] = {}
    for spec in layout:
        pieces = [p[spec.name] for p in parts]
        if spec.length_of == "rows+1":
            shifted, base = [pieces[0]], int(pieces[0][-1])
            for piece in pieces[1:]:
                shifted.append(piece[1:] + base)
                base += int(piece[-1])
            pieces = shifted
        out[spec.name] = np.concatenate(pieces)
    return out


def slice_arrays(arrays: dict[str, np.ndarray], layout, start: int, stop: int) -> dict[str, np.ndarray]:
    """Rows ``[start, stop)`` of a unit's arrays, as compact copies with offsets rebased to 0."""
    out: dict[str, np.ndarray] = {}
    for spec in layout:
        values = arrays[spec.name]
        if spec.length_of == "rows":
            out[spec.name] = values[start:stop].copy()
        elif spec.length_of == "rows+1":
            out[spec.name] = values[start:stop + 1] - values[start]
        else:
            offsets = arrays[spec.length_of]
            out[spec.name] = values[offsets[start]:offsets[stop]].copy()
    return out


def _malloc_trim():
    """glibc's ``malloc_trim``, or None. Freed decoded units are large heap blocks that glibc
    keeps (its mmap threshold rises after big frees); trimming returns them to the OS, so
    RSS follows the cache bound instead of the peak of everything ever decoded."""
    import ctypes

    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    return fn


_MALLOC_TRIM = _malloc_trim()


def release_freed_memory() -> None:
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


class SegmentCache:
    """Byte-bounded LRU of :class:`DecodedUnit` keyed by unit name; thread-safe."""

    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._units: OrderedDict[str, DecodedUnit] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._dropped = False
        self.hits = 0
        self.misses = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._units)

    def __contains__(self, name: str) -> bool:
        return name in self._units

    def get(self, name: str, load: Callable[[], DecodedUnit]) -> DecodedUnit:
        with self._lock:
            unit = self._units.get(name)
            if unit is not None:
                self._units.move_to_end(name)
                self.hits += 1
                return unit
            self.misses += 1
        # a miss: memory of units dropped since the last miss is handed back first
        if self._dropped:
            self._dropped = False
            release_freed_memory()
        unit = load()  # outside the lock: decoding is slow and releases the GIL
        self.put(name, unit)
        return unit

    def put(self, name: str, unit: DecodedUnit) -> None:
        size = unit.nbytes
        with self._lock:
            old = self._units.pop(name, None)
            if old is not None:
                self._bytes -= old.nbytes
            if size > self.capacity_bytes:
                self._dropped = True  # served once by the caller, then freed
                return
            self._units[name] = unit
            self._bytes += size
            while self._bytes > self.capacity_bytes:
                _, dropped = self._units.popitem(last=False)
                self._bytes -= dropped.nbytes
                self._dropped = True

    def retain(self, names: set[str]) -> None:
        """Drops units no longer published (compacted fragments, evicted segments)."""
        with self._lock:
            for name in [n for n in self._units if n not in names]:
                self._bytes -= self._units.pop(name).nbytes

    def clear(self) -> None:
        with self._lock:
            self._units.clear()
            self._bytes = 0
