"""The on-disk layout of a memmap store, read with json and numpy only (no torch).

What the store (:mod:`.store`), ``inspect``, ``inspect --verify`` and ``repair`` share: names of files and
directories, the per-field files of a segment, the published state (``manifest.json`` + the two state
slots) and how a damaged slot is told apart from a writer's normal crash (:func:`read_published`). The
manifest's ``"fields"`` gives each field's kind and dtype, so summaries and checks need only the files.
Design: docs/storage.md#segment-files."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from rlhf_pipeline.storage.errors import NotAStoreError, StoreCorruptedError, StoreNotFoundError
from rlhf_pipeline.storage.memmap.state_slots import SlotDamage, SlotReading, StateSlots

log = logging.getLogger("rlhf_pipeline.storage.memmap")

BACKEND = "memmap"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
STATE_STEM = "state"  # state.0 / state.1: every append's publish (see StateSlots)
CHECKSUMS_NAME = "checksums.json"  # in a sealed segment's directory (see .checksums)
# state key: [segment id, [file, size, crc32c, file, ...]] of the open segment's published bytes
OPEN_SEGMENT_CHECKSUMS = "open_segment_checksums"
# state key: the first segment id from which every sealed segment has a checksums.json (stores made
# before it record none: their older segments may have been sealed before checksums existed)
CHECKSUMS_FROM = "checksums_from_segment"
# manifest key: both state slot files were created with the store, so a missing one is damage
# (stores made before it created each slot file at its first publish)
SLOT_FILES_CREATED = "state_slot_files_created"
ENDS_DTYPE = np.dtype("<i8")
SEGMENT_PREFIX = "seg-"


def segment_dir_name(segment_id: int) -> str:
    return f"{SEGMENT_PREFIX}{segment_id:08d}"


def segment_id_of(name: str) -> int | None:
    """The id in a ``seg-NNNNNNNN`` directory name; None for anything else."""
    if not name.startswith(SEGMENT_PREFIX):
        return None
    digits = name[len(SEGMENT_PREFIX):]
    return int(digits) if digits.isdigit() else None


def segment_ids_on_disk(path: Path) -> list[int]:
    """Ids of the segment directories under ``path``, ascending (held, evicted or orphaned)."""
    ids = []
    for entry in os.scandir(path):
        seg_id = segment_id_of(entry.name)
        if seg_id is not None and entry.is_dir():
            ids.append(seg_id)
    return sorted(ids)


@dataclass(frozen=True)
class SegmentState:
    """What the published state says about one segment: its rows and value counts."""

    id: int
    rows: int
    elements: dict[str, int] = field(default_factory=dict)  # ragged field -> published values

    def to_json(self) -> list:
        return [self.id, self.rows, self.elements]

    @classmethod
    def from_json(cls, data: list) -> SegmentState:
        seg_id, rows, elements = data
        return cls(int(seg_id), int(rows), {k: int(v) for k, v in elements.items()})


def open_segment_checksums(state: dict[str, Any]) -> tuple[int, dict[str, tuple[int, int]]] | None:
    """``(segment id, file -> (size, crc32c))`` a publish recorded for its open segment; None when
    it recorded none (a publish by a version before them, by repair, or with no open segment)."""
    entry = state.get(OPEN_SEGMENT_CHECKSUMS)
    if entry is None:
        return None
    try:
        seg_id, flat = entry
        return int(seg_id), {str(flat[i]): (int(flat[i + 1]), int(flat[i + 2])) for i in range(0, len(flat), 3)}
    except (TypeError, ValueError, IndexError) as exc:
        raise ValueError(f"malformed {OPEN_SEGMENT_CHECKSUMS!r}: {exc}") from None


# ============================================================================ fields and files
@dataclass(frozen=True)
class FieldFiles:
    """One field as its segment files see it: kind (token, row, text) and numpy dtype."""

    name: str
    kind: str
    dtype: np.dtype

    @property
    def ragged(self) -> bool:
        return self.kind in ("token", "text")


def fields_json(fields: list[FieldFiles]) -> dict[str, dict[str, str]]:
    """The manifest's ``"fields"`` entry."""
    return {f.name: {"kind": f.kind, "dtype": f.dtype.str} for f in fields}


def fields_of(manifest: dict[str, Any], path: Path) -> list[FieldFiles]:
    """The stored fields, from the manifest's ``"fields"`` (or, for older stores, from the schema)."""
    recorded = manifest.get("fields")
    if isinstance(recorded, dict):
        try:
            return [FieldFiles(name, spec["kind"], np.dtype(spec["dtype"])) for name, spec in recorded.items()]
        except (KeyError, TypeError) as exc:
            raise StoreCorruptedError(f"{path / MANIFEST_NAME} has a malformed 'fields' entry: {exc!r}") from None
    from rlhf_pipeline.storage.manifest import schema_from_manifest  # imports torch: older stores only

    return field_files(schema_from_manifest(manifest, path / MANIFEST_NAME))


def field_files(schema) -> list[FieldFiles]:
    """The fields of a ``StoreSchema`` (needs ``rlhf_pipeline.schema``, hence torch)."""
    from rlhf_pipeline.schema import NUMPY_DTYPES

    return [FieldFiles(s.name, s.kind, np.dtype(NUMPY_DTYPES[s.dtype]).newbyteorder("<")) for s in schema.fields]


def segment_files(fields: list[FieldFiles], state: SegmentState) -> dict[str, tuple[np.dtype, int]]:
    """File name -> (dtype, published element count) for every file of a segment."""
    files: dict[str, tuple[np.dtype, int]] = {}
    for f in fields:
        if f.ragged:
            files[f"{f.name}.values"] = (f.dtype, state.elements[f.name])
            files[f"{f.name}.ends"] = (ENDS_DTYPE, state.rows)
        else:
            files[f"{f.name}.col"] = (f.dtype, state.rows)
    return files


def raw_payload_bytes(fields: list[FieldFiles], state: SegmentState) -> int:
    """The segment's raw payload: values of token and text fields, row values; no end offsets."""
    total = 0
    for f in fields:
        count = state.elements[f.name] if f.ragged else state.rows
        total += count * f.dtype.itemsize
    return total


# ============================================================================ the manifest
def looks_like_store(path: Path) -> bool:
    """True when ``path`` holds a manifest or, without one, what only a memmap store holds
    (state slots next to segment directories): a damaged store is still recognized."""
    if (path / MANIFEST_NAME).exists():
        return True
    has_slots = any((path / f"{STATE_STEM}.{i}").exists() for i in (0, 1))
    return has_slots and bool(segment_ids_on_disk(path))


def detect(location: str) -> bool:
    """True when ``location`` is (or looks like a damaged) memmap store; never raises."""
    path = Path(location)
    try:
        if "://" in location or not path.is_dir() or not looks_like_store(path):
            return False
        raw = (path / MANIFEST_NAME).read_bytes()
    except FileNotFoundError:
        return True  # slots and segments but no manifest: ours, damaged
    except OSError:
        return False
    try:
        data = json.loads(raw)
    except ValueError:
        return True  # a manifest.json that does not parse: ours, damaged
    return not isinstance(data, dict) or data.get("backend", BACKEND) == BACKEND


def read_manifest(path: Path) -> dict[str, Any]:
    """``manifest.json``; ``NotAStoreError`` when ``path`` holds no store at all,
    ``StoreCorruptedError`` naming the file when it is damaged or missing from a store."""
    manifest_path = path / MANIFEST_NAME
    if not path.exists():
        raise StoreNotFoundError(f"{path} does not exist")
    if not path.is_dir():
        raise NotAStoreError(f"{path} is not a replay buffer: it is a file, not a directory")
    try:
        raw = manifest_path.read_bytes()
    except FileNotFoundError:
        if looks_like_store(path):
            raise StoreCorruptedError(
                f"{manifest_path} is missing, but {path} holds state slots and segments: the store was "
                f"damaged outside this library. `rlhf-pipeline repair {path}` rebuilds the manifest."
            ) from None
        raise NotAStoreError(
            f"{path} is not a memmap replay buffer: {MANIFEST_NAME} is missing. Create one first, or check the path."
        ) from None
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        what = "is empty" if not raw else f"is not valid JSON ({exc})"
        raise StoreCorruptedError(
            f"{manifest_path} {what}: the store's manifest was damaged outside this library. "
            f"`rlhf-pipeline repair {path}` rebuilds it from the state slots and segments."
        ) from None
    if not isinstance(data, dict):
        raise StoreCorruptedError(f"{manifest_path} holds a JSON {type(data).__name__}, expected an object")
    return data


# ============================================================================ the published state
@dataclass(frozen=True)
class RollBack:
    """The newest intact publish is older than a damaged slot, and rows would be lost with it."""

    damaged: tuple[SlotDamage, ...]
    intact_next_row: int  # rows the intact publish covers
    damaged_next_row: int | None  # what the damaged slot's payload says, when it still parses
    rows_on_disk: int  # complete rows the segment files hold beyond the intact publish

    def describe(self, path: Path) -> str:
        slots = "; ".join(d.describe() for d in self.damaged)
        claimed = (f" (its damaged record reads next_row {self.damaged_next_row})"
                   if self.damaged_next_row is not None else "")
        lost_to = self.intact_next_row + self.rows_on_disk
        return (f"{path}: the newest state slot is damaged: {slots}{claimed}. The intact older publish ends "
                f"at row {self.intact_next_row}, but the segment files hold complete rows up to {lost_to}: "
                f"opened there, rows {lost_to} -> {self.intact_next_row} (rolled back). Nothing was deleted; "
                f"`rlhf-pipeline repair {path}` shows what the segment files hold and `--apply` republishes it")


@dataclass(frozen=True)
class Published:
    """The state a store opens at: ``seq`` 0 is the manifest itself; ``rollback`` when damaged."""

    seq: int
    state: dict[str, Any]
    source: Path  # the file the state was read from: manifest.json or a state slot
    rollback: RollBack | None = None


def read_published(path: Path, slots: StateSlots, manifest: dict[str, Any], fields: list[FieldFiles], *,
                   after: int = 0, seen: set | None = None) -> Published | None:
    """The newest publish above ``after`` (None when there is none).

    Raises :class:`StoreCorruptedError` naming both files when every state slot in use is
    damaged. When a damaged slot may be newer than the intact one, the segment files decide:
    if they hold complete rows beyond the intact state, opening there rolls those rows back,
    which ``rollback`` describes (readers warn and read; a writer refuses, see the store).
    """
    reading = slots.read(after)
    if seen is not None and reading.damaged:
        # damage this reader was told about already: not looked into again on every refresh
        fresh = tuple(d for d in reading.damaged if (d.path, d.claimed_seq) not in seen)
        seen.update((d.path, d.claimed_seq) for d in reading.damaged)
        reading = replace(reading, damaged=fresh)
    if after == 0:
        lost = lost_slot(path, reading, manifest, fields)
        if lost is not None:
            raise StoreCorruptedError(
                f"{lost}. Opened at what is left, published rows could be rolled back and overwritten; "
                f"`rlhf-pipeline repair {path} --apply` rebuilds the state from the segment files"
            )
    if reading.damaged and reading.seq is None and after == 0:
        names = " and ".join(str(p) for p in slots.paths)
        found = "; ".join(d.describe() for d in reading.damaged)
        raise StoreCorruptedError(
            f"{path}: no intact state slot ({names}): {found}. The store's published state is lost; "
            f"`rlhf-pipeline repair {path}` rebuilds it from the segment files"
        )
    if reading.seq is None:
        if after == 0 and not reading.slots_in_use:
            return Published(0, manifest, path / MANIFEST_NAME)  # never appended to, or a snapshot
        return None
    rollback = None
    if reading.damaged:
        rollback = _rollback(path, reading, fields)
    return Published(reading.seq, reading.state, reading.path, rollback)


def lost_slot(path: Path, reading: SlotReading, manifest: dict[str, Any], fields: list[FieldFiles]) -> str | None:
    """What says a state slot was lost outside this library (None when nothing does).

    A crash never deletes a slot file, and a lost slot may have held the newest publish: (1) the
    store was made with both slot files and one is missing; (2) the other slot holds publish 2 or
    later, so this one held the publish before or after it, yet it is missing or holds none. Stores
    made before slot files came with the store have none until their first two publishes: there
    (3) a missing slot is damage when the segment files hold complete rows past the remaining
    state, since its publish may have covered them (a writer killed before its first publishes
    may also have written them: the files cannot tell which).
    """
    if manifest.get(SLOT_FILES_CREATED) and reading.missing:
        return (f"{path}: {_slots(reading.missing)} missing, yet the store was created with both slot files: "
                f"deleted outside this library")
    absent = reading.missing + reading.unpublished
    if reading.seq is not None and reading.seq >= 2 and absent:
        what = "missing" if reading.missing else "empty (no publish)"
        return (f"{path}: {_slots(absent)} {what}, but {reading.path} holds publish {reading.seq}, so it held "
                f"publish {reading.seq - 1} or {reading.seq + 1}: it was lost outside this library")
    if reading.missing and not manifest.get(SLOT_FILES_CREATED) and not reading.damaged:
        state = reading.state if reading.state is not None else manifest
        try:
            segment_rows, next_row = int(state["segment_rows"]), int(state["next_row"])
            held = [SegmentState.from_json(s) for s in state["segments"]]
        except (KeyError, TypeError, ValueError):
            return None  # the state's own check fails later, with its own message
        beyond = complete_rows_beyond(path, fields, segment_rows, next_row, held)
        if beyond:
            return (f"{path}: {_slots(reading.missing)} missing and the segment files hold "
                    f"{beyond} complete row(s) past row {next_row}, where the remaining state ends: a lost slot "
                    f"may have published them")
    return None


def _slots(paths: tuple[Path, ...]) -> str:
    """``state slot A is`` / ``state slots A and B are``."""
    names = " and ".join(str(p) for p in paths)
    return f"state slot {names} is" if len(paths) == 1 else f"state slots {names} are"


def _rollback(path: Path, reading, fields: list[FieldFiles]) -> RollBack | None:
    state = reading.state
    try:
        segment_rows = int(state["segment_rows"])
        next_row = int(state["next_row"])
        held = [SegmentState.from_json(s) for s in state["segments"]]
    except (KeyError, TypeError, ValueError):
        return None  # the state's own check fails later, with its own message
    beyond = complete_rows_beyond(path, fields, segment_rows, next_row, held)
    if beyond == 0:
        return None  # the damaged slot held nothing the files do not: nothing is lost
    damaged_next = None
    for damage in reading.damaged:
        if damage.claimed_state is not None and isinstance(damage.claimed_state.get("next_row"), int):
            damaged_next = damage.claimed_state["next_row"]
    return RollBack(reading.damaged, next_row, damaged_next, beyond)


# ============================================================================ rows in segment files
def complete_rows(directory: Path, fields: list[FieldFiles], *, start: int = 0, limit: int | None = None,
                  first_ends: dict[str, int] | None = None) -> tuple[int, dict[str, int]]:
    """Complete rows in a segment's files from row ``start``: ``(rows, values per ragged field)``.

    A row is complete when every field's file holds it: the ends of ragged fields never
    decrease and point inside the values file, token fields hold at least one value per
    row (prompts and responses are never empty), row files are long enough. Files grown
    ahead by a writer hold zeros past the last row, which end the count. ``first_ends``
    gives each ragged field's end before ``start`` (0 at the segment's start).
    """
    rows = limit if limit is not None else None
    ends_of: dict[str, np.ndarray] = {}
    for f in fields:
        name = f"{f.name}.ends" if f.ragged else f"{f.name}.col"
        try:
            size = os.stat(directory / name).st_size
        except FileNotFoundError:
            return 0, {}
        itemsize = ENDS_DTYPE.itemsize if f.ragged else f.dtype.itemsize
        available = max(0, size // itemsize - start)
        rows = available if rows is None else min(rows, available)
    rows = rows or 0
    elements: dict[str, int] = {}
    for f in (f for f in fields if f.ragged):
        before = (first_ends or {}).get(f.name, 0)
        ends = np.fromfile(directory / f"{f.name}.ends", dtype=ENDS_DTYPE, count=rows, offset=start * 8)
        values_size = os.stat(directory / f"{f.name}.values").st_size // f.dtype.itemsize
        previous = np.concatenate([[before], ends[:-1]]) if len(ends) else ends
        ok = (ends <= values_size) & ((ends > previous) if f.kind == "token" else (ends >= previous))
        bad = np.flatnonzero(~ok)
        rows = min(rows, int(bad[0]) if bad.size else rows)
        ends_of[f.name] = ends
    for name, ends in ends_of.items():
        elements[name] = int(ends[rows - 1]) if rows else (first_ends or {}).get(name, 0)
    return rows, elements


def complete_rows_beyond(path: Path, fields: list[FieldFiles], segment_rows: int, next_row: int,
                         held: list[SegmentState]) -> int:
    """Complete rows the segment files hold beyond global row ``next_row`` (contiguous from it)."""
    by_id = {s.id: s for s in held}
    seg_id, total = next_row // segment_rows, 0
    while True:
        directory = path / segment_dir_name(seg_id)
        if not directory.is_dir():
            return total
        state = by_id.get(seg_id)
        start = state.rows if state is not None else 0
        first_ends = dict(state.elements) if state is not None else None
        rows, _ = complete_rows(directory, fields, start=start, limit=segment_rows - start, first_ends=first_ends)
        total += rows
        if start + rows < segment_rows:
            return total
        seg_id += 1
