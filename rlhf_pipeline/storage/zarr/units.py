"""Units of a Zarr store: what each kind holds, its keys, and how it is written and read; no torch.

A unit is what the commit record lists as ``[first_row, rows, kind]``: kind 3 (suffix ``s``) a sealed
segment of packed arrays ``rows`` and ``values`` (store codec + crc32c), kind 4 (``f``) a fragment of one
raw packed array + crc32c; format 1 kinds 0 and 1 (no suffix, one array per field) and 2 (``p``) are still
read. :class:`UnitIO` is one store's unit I/O: write, read, copy byte for byte (a snapshot).
:func:`read_unit` checks every chunk against what the record promises and raises
:class:`StoreCorruptedError` naming the chunk, or :class:`UnitGone` when a chunk is missing (compacted or
evicted since the record was read, or damage). Design: docs/zarr-layout.md#the-commit-record."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from rlhf_pipeline.storage.zarr.layout import (
    CHUNK_KEY,
    GROUP_METADATA,
    NP_DTYPE_BY_NAME,
    PACKS,
    UNITS_PREFIX,
    Codec,
    array_counts,
    array_metadata,
    check_offsets,
    crc32c_of_buffers,
    pack_array,
    pack_buffers,
    pack_layouts,
    packed_metadata,
    packed_ranges,
    packed_size,
    strip_checksum,
    unpack,
)

if TYPE_CHECKING:
    from rlhf_pipeline.storage.zarr.location import Location

FRAGMENT, SEALED, PACKED_FRAGMENT_V1, SEALED_PACKED, PACKED_FRAGMENT = 0, 1, 2, 3, 4
_SUFFIX = {FRAGMENT: "", SEALED: "", PACKED_FRAGMENT_V1: "p", SEALED_PACKED: "s", PACKED_FRAGMENT: "f"}
ROOT_META = "zarr.json"


class UnitGone(Exception):
    """A chunk of a published unit is missing: compacted or evicted since the record was read, or damage."""


@dataclass(frozen=True)
class UnitRef:
    """One published unit: rows ``[first_row, first_row + rows)`` of the given ``kind``."""

    first_row: int
    rows: int
    kind: int

    @property
    def sealed(self) -> bool:
        return self.kind in (SEALED, SEALED_PACKED)

    @property
    def checksummed(self) -> bool:
        return self.kind in (SEALED_PACKED, PACKED_FRAGMENT)

    @functools.cached_property
    def name(self) -> str:  # cached: every sampled batch looks its units up by name
        return f"{self.first_row:015d}-{self.rows:010d}{_SUFFIX[self.kind]}"

    @property
    def prefix(self) -> str:
        return f"{UNITS_PREFIX}/{self.name}"


def parse_unit_name(name: str) -> UnitRef | None:
    """The unit a directory name under ``units/`` stands for (kind 0/1 told apart by the caller:
    both have no suffix); None for anything else."""
    stem, suffix = (name[:-1], name[-1]) if name[-1:].isalpha() else (name, "")
    first, _, rows = stem.partition("-")
    if not (first.isdigit() and rows.isdigit() and len(first) == 15 and len(rows) == 10):
        return None
    kind = {"": SEALED, "p": PACKED_FRAGMENT_V1, "s": SEALED_PACKED, "f": PACKED_FRAGMENT}.get(suffix)
    return None if kind is None else UnitRef(int(first), int(rows), kind)


class UnitCodecs:
    """The codec of each kind of unit in one store (the record's ``codec`` and ``fragment_codec``)."""

    def __init__(self, codec: dict[str, Any], fragment_codec: dict[str, Any]):
        self.sealed_v1 = Codec(codec)
        self.fragment_v1 = Codec(fragment_codec)
        self.sealed = Codec(codec, checksum=True)
        self.raw = Codec({"name": "none"})
        self.raw_checked = Codec({"name": "none"}, checksum=True)
        self.config = dict(codec)

    def of(self, unit: UnitRef) -> Codec:
        return {FRAGMENT: self.fragment_v1, SEALED: self.sealed_v1, PACKED_FRAGMENT_V1: self.raw,
                SEALED_PACKED: self.sealed, PACKED_FRAGMENT: self.raw_checked}[unit.kind]


def unit_keys(unit: UnitRef, layout) -> list[str]:
    """Every key of a unit: group and array metadata, chunks."""
    if unit.kind in (PACKED_FRAGMENT_V1, PACKED_FRAGMENT):
        return [f"{unit.prefix}/{ROOT_META}", f"{unit.prefix}/{CHUNK_KEY}"]
    names = [name for name, _ in PACKS] if unit.kind == SEALED_PACKED else [s.name for s in layout]
    keys = [f"{unit.prefix}/{ROOT_META}"]
    for name in names:
        keys += [f"{unit.prefix}/{name}/{ROOT_META}", f"{unit.prefix}/{name}/{CHUNK_KEY}"]
    return keys


class UnitIO:
    """One store's units where it lives (``loc``), with its array ``layout`` and ``codecs``; writes
    are fsynced when ``durable``. The store owns one; a snapshot copies from one store's to another's."""

    def __init__(self, loc: Location, layout, codecs: UnitCodecs, *, durable: bool):
        self.loc = loc
        self.layout = layout
        self.codecs = codecs
        self.durable = durable

    def keys(self, unit: UnitRef) -> list[str]:
        """Every key of the unit (group and array metadata, chunks)."""
        return unit_keys(unit, self.layout)

    def write(self, unit: UnitRef, arrays: dict[str, np.ndarray], *, threaded: bool = True):
        """Writes a new unit (kind 3 or 4); returns what its publish still has to sync."""
        if unit.kind == PACKED_FRAGMENT:  # two files: written here, without the I/O thread
            items = fragment_items(unit, arrays, self.layout)
            return self.loc.kv.put_many(items, durable=self.durable, threaded=False, defer_sync=True)
        items = sealed_items(unit, arrays, self.layout, self.codecs.sealed)
        return self.loc.kv.put_many(items, durable=self.durable, threaded=threaded, defer_sync=True)

    def discard(self, units: list[UnitRef], *, published: set[str]) -> None:
        """Deletes the files of those ``units`` of a failed append that no record names (``published``),
        in a local store: a full disk gets their space back at once, and a retry writes new files. An
        object store's units are never overwritten: there the next writer deletes them."""
        if self.loc.local_root is not None:
            for unit in units:
                if unit.name not in published:
                    self.loc.kv.delete_prefix(unit.prefix)

    def read(self, unit: UnitRef) -> dict[str, np.ndarray]:
        """The unit's arrays, checked (:func:`read_unit`)."""
        return read_unit(self.loc.kv, unit, self.layout, self.codecs)

    def copy_to(self, target: UnitIO, units: list[UnitRef]) -> None:
        """Copies ``units``' files byte for byte into ``target``'s location, decoding nothing; a key
        a unit does not hold (an empty array has no chunk) is not written there either."""
        for unit in units:
            keys = self.keys(unit)
            blobs = self.loc.kv.get_many(keys)
            target.loc.kv.put_many({k: b for k, b in zip(keys, blobs) if b is not None}, durable=target.durable)


# ======================================================================== writing
def sealed_items(unit: UnitRef, arrays: dict[str, np.ndarray], layout, codec: Codec) -> Iterator[tuple[str, Any]]:
    """Keys and values of a sealed segment (kind 3), lazily: each pack is compressed while the
    previous one is written."""
    yield f"{unit.prefix}/{ROOT_META}", GROUP_METADATA
    for (name, typesize), pack in zip(PACKS, pack_layouts(layout).values()):
        buffer, ranges = pack_array(pack, arrays)
        yield f"{unit.prefix}/{name}/{ROOT_META}", _sealed_pack_metadata(ranges, buffer.size, codec, typesize)
        yield f"{unit.prefix}/{name}/{CHUNK_KEY}", codec.encode(buffer, typesize=typesize)


def fragment_items(unit: UnitRef, arrays: dict[str, np.ndarray], layout) -> list[tuple[str, Any]]:
    """Keys and values of a fragment (kind 4): two files, the chunk as buffers for one ``writev``."""
    buffers, ranges, size = pack_buffers(layout, arrays)
    buffers.append(crc32c_of_buffers(buffers))
    return [(f"{unit.prefix}/{ROOT_META}", _fragment_metadata(ranges, size)), (f"{unit.prefix}/{CHUNK_KEY}", buffers)]


def _sealed_pack_metadata(ranges, nbytes: int, codec: Codec, typesize: int) -> bytes:
    return packed_metadata(ranges, nbytes, codec.zarr_codecs(typesize, data_itemsize=1))


def _fragment_metadata(ranges, nbytes: int) -> bytes:
    return packed_metadata(ranges, nbytes, [{"name": "bytes"}, {"name": "crc32c"}])


def unit_metadata(unit: UnitRef, arrays: dict[str, np.ndarray], layout, codecs: UnitCodecs) -> dict[str, bytes]:
    """Every metadata key of a unit (the ``zarr.json`` of its group and of its arrays) with the bytes
    its writer wrote, from the unit's decoded arrays and the record's codecs. This library reads a
    unit without them; a plain zarr reader needs them, so ``repair`` rewrites one that is damaged."""
    if unit.kind in (PACKED_FRAGMENT, PACKED_FRAGMENT_V1):
        ranges, nbytes = packed_ranges(layout, arrays), packed_size(layout, arrays)
        meta = _fragment_metadata(ranges, nbytes) if unit.kind == PACKED_FRAGMENT else packed_metadata(ranges, nbytes)
        return {f"{unit.prefix}/{ROOT_META}": meta}
    out = {f"{unit.prefix}/{ROOT_META}": GROUP_METADATA}
    if unit.kind == SEALED_PACKED:
        for (name, typesize), pack in zip(PACKS, pack_layouts(layout).values()):
            out[f"{unit.prefix}/{name}/{ROOT_META}"] = _sealed_pack_metadata(
                packed_ranges(pack, arrays), packed_size(pack, arrays), codecs.sealed, typesize)
        return out
    for spec in layout:  # format 1: one array per field
        out[f"{unit.prefix}/{spec.name}/{ROOT_META}"] = array_metadata(spec.dtype, int(arrays[spec.name].size),
                                                                       codecs.of(unit))
    return out


# ======================================================================== reading
def read_unit(kv, unit: UnitRef, layout, codecs: UnitCodecs, *, names: set[str] | None = None
              ) -> dict[str, np.ndarray]:
    """The unit's arrays, checked. ``names`` asks for some arrays only (the unit's small per-row
    arrays, for ``inspect``): a unit may then decode less, but returns at least those."""
    codec = codecs.of(unit)
    if unit.kind in (PACKED_FRAGMENT_V1, PACKED_FRAGMENT):
        key = f"{unit.prefix}/{CHUNK_KEY}"
        raw = kv.get(key)
        if raw is None:
            raise UnitGone(key)
        if codec.checksum:
            raw = strip_checksum(raw, key)
        return unpack(layout, raw, unit.rows, key)
    if unit.kind == SEALED_PACKED:
        return _read_sealed_packed(kv, unit, layout, codec, names)
    return _read_per_field(kv, unit, layout, codec, names)


def _read_sealed_packed(kv, unit: UnitRef, layout, codec: Codec, names: set[str] | None) -> dict[str, np.ndarray]:
    packs = pack_layouts(layout)
    wanted = [(name, typesize) for name, typesize in PACKS
              if names is None or name == "rows" or any(s.name in names for s in packs[name])]
    keys = [f"{unit.prefix}/{name}/{CHUNK_KEY}" for name, _ in wanted]
    arrays: dict[str, np.ndarray] = {}
    for (name, typesize), key, raw in zip(wanted, keys, kv.get_many(keys)):
        if raw is None:
            raise UnitGone(key)
        pack = packs[name]
        size = packed_size(pack, array_counts(pack, unit.rows, arrays))
        buffer = codec.decode(raw, "uint8", size, key, typesize=typesize)
        unpack(pack, buffer, unit.rows, key, arrays)
    return arrays


def _read_per_field(kv, unit: UnitRef, layout, codec: Codec, names: set[str] | None) -> dict[str, np.ndarray]:
    if names is not None:
        needed = set(names) | {s.length_of for s in layout if s.name in names and s.length_of.endswith("_offsets")}
        specs = [s for s in layout if s.name in needed]
    else:
        specs = list(layout)
    keys = [f"{unit.prefix}/{spec.name}/{CHUNK_KEY}" for spec in specs]
    arrays: dict[str, np.ndarray] = {}
    for spec, key, raw in zip(specs, keys, kv.get_many(keys)):
        count = array_counts([spec], unit.rows, arrays)[spec.name]
        if raw is None:
            if count:
                raise UnitGone(key)
            arrays[spec.name] = np.zeros(0, dtype=NP_DTYPE_BY_NAME[spec.dtype])  # empty arrays have no chunk
            continue
        values = codec.decode(raw, spec.dtype, count, key)
        if spec.length_of == "rows+1":
            check_offsets(values, f"offsets in chunk {key}")
        arrays[spec.name] = values
    return arrays
