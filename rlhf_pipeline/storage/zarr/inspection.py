"""``inspect`` and ``inspect --verify`` of a Zarr store from its keys alone (json, numpy, numcodecs, no torch).

:func:`stats` summarizes the published rows from each unit's small per-row arrays (the store's
``stats()`` is :func:`summarize`); :func:`verify` decodes every chunk of every published unit (its
CRC32C, exact size and offsets), checks each unit's metadata (``zarr.json``, which plain zarr needs and
this library never reads) against what its arrays imply, and lists the units no record names;
:func:`check_units` hands ``repair`` the bytes to rewrite damaged metadata with.
Design: docs/zarr-layout.md#damage-and-repair."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rlhf_pipeline.storage.errors import NotAStoreError, StoreCorruptedError
from rlhf_pipeline.storage.reports import CheckReport, Progress
from rlhf_pipeline.storage.summary import StoreStats, disk_usage, summarize_trajectories
from rlhf_pipeline.storage.zarr.layout import ATTRS_KEY, GROUP_METADATA, NP_DTYPE_BY_NAME, UNITS_PREFIX, arrays_of
from rlhf_pipeline.storage.zarr.location import Location, has_units, parse_root, raise_if_being_created, resolve
from rlhf_pipeline.storage.zarr.unit_constants import disagreements, parse_constants
from rlhf_pipeline.storage.zarr.units import ROOT_META, UnitCodecs, UnitGone, UnitRef, read_unit, unit_metadata

BACKEND = "zarr"
__all__ = ["detect", "stats", "summarize", "verify"]
_ROW_SUMMARY = ("group_id", "reward", "policy_version", "trajectory_id")


def detect(location: str) -> bool:
    """True when ``location`` holds a Zarr replay buffer, or a damaged one (a root ``zarr.json``
    that does not parse, or units without a root document); never raises."""
    location = str(location)
    try:
        if "://" in location or location.endswith(".zip"):
            loc = resolve(location, read_only=True, storage_options=None)
            try:
                parse_root(loc.kv.get(ROOT_META), location)
            except StoreCorruptedError:
                return True  # a root document that does not parse: a damaged store, which repair takes
            except NotAStoreError:
                return has_units(loc)  # units without a root document: the same
            finally:
                loc.kv.close()
            return True
        path = Path(location)
        if not path.is_dir():
            return False
        try:
            raw = (path / ROOT_META).read_bytes()
        except FileNotFoundError:
            return _has_unit_dirs(path)
        try:
            doc = json.loads(raw)
        except ValueError:
            return True  # a root document that does not parse: ours if units sit next to it, or empty
        if isinstance(doc, dict) and ATTRS_KEY in doc.get("attributes", {}):
            return True
        return _has_unit_dirs(path)
    except Exception:  # noqa: BLE001 - detection never raises
        return False


def _has_unit_dirs(path: Path) -> bool:
    try:
        return any(entry.name != ROOT_META for entry in os.scandir(path / UNITS_PREFIX))
    except OSError:
        return False


def open_record(location: str, storage_options: dict | None = None) -> tuple[Location, dict[str, Any]]:
    """The location and its commit record (``StoreCorruptedError`` when it is damaged)."""
    loc = resolve(location, read_only=True, storage_options=storage_options)
    try:
        raw = loc.kv.get(ROOT_META)
        try:
            return loc, parse_root(raw, location)
        except NotAStoreError:
            if has_units(loc):
                parse_root(raw, location, units_exist=True)  # raises StoreCorruptedError
            if raw is None:
                raise_if_being_created(loc)
            raise
    except BaseException:
        loc.kv.close()
        raise


def units_of(record: dict[str, Any], location: str) -> list[UnitRef]:
    try:
        return [UnitRef(int(a), int(b), int(c)) for a, b, c in record["units"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise StoreCorruptedError(f"{location}/zarr.json has a malformed commit record: {exc!r}") from None


def codecs_of(record: dict[str, Any]) -> UnitCodecs:
    return UnitCodecs(record["codec"], record.get("fragment_codec", record["codec"]))


# ======================================================================== stats
def stats(location: str, storage_options: dict | None = None) -> StoreStats:
    """Summary of the published rows of the store at ``location``."""
    loc, record = open_record(str(location), storage_options)
    try:
        return summarize(loc, record, str(location))
    finally:
        loc.kv.close()


def summarize(loc: Location, record: dict[str, Any], location: str) -> StoreStats:
    """Counts, rewards, versions and sizes of the published units (one record, read already)."""
    layout = arrays_of(record, location)
    codecs = codecs_of(record)
    units = units_of(record, location)
    offsets = [s.name for s in layout if s.length_of == "rows+1"]
    itemsize = {s.name: NP_DTYPE_BY_NAME[s.dtype].itemsize for s in layout}
    optional = list(record["schema"].get("optional", []))
    wanted = _ROW_SUMMARY + tuple(name for name in ("termination_reason", "tool_calls", "tool_errors",
                                                    "tool_error_kinds") if name in optional)
    columns: dict[str, list[np.ndarray]] = {name: [] for name in wanted}
    prompt_tokens = response_tokens = raw = 0
    for unit in units:
        try:
            decoded = read_unit(loc.kv, unit, layout, codecs, names=set(wanted) | set(offsets))
        except UnitGone as gone:
            raise StoreCorruptedError(f"{location}: chunk {gone} of a published unit is missing") from None
        for name in wanted:
            columns[name].append(decoded[name])
        prompt_tokens += int(decoded["prompt_offsets"][-1])
        response_tokens += int(decoded["response_offsets"][-1])
        for spec in layout:  # the raw payload: values and row fields, no offsets
            if spec.length_of == "rows":
                raw += unit.rows * itemsize[spec.name]
            elif spec.length_of != "rows+1":
                raw += int(decoded[spec.length_of][-1]) * itemsize[spec.name]
    joined = {name: np.concatenate(parts) if parts else np.zeros(0) for name, parts in columns.items()}
    reward = joined["reward"]
    versions, counts = np.unique(joined["policy_version"], return_counts=True)
    sealed = sum(u.sealed for u in units)
    return StoreStats(
        backend=BACKEND, location=location, rows=int(record["next_row"]) - int(record["first_row"]),
        first_row=int(record["first_row"]), next_row=int(record["next_row"]),
        groups=int(np.unique(joined["group_id"]).size),
        prompt_tokens=prompt_tokens, response_tokens=response_tokens, bytes_on_disk=_bytes_on_disk(loc),
        raw_bytes=raw, segments=sealed + int(sealed < len(units)),
        reward_mean=float(reward.mean()) if reward.size else None,
        reward_std=float(reward.std()) if reward.size else None,
        reward_min=float(reward.min()) if reward.size else None,
        reward_max=float(reward.max()) if reward.size else None,
        policy_versions={int(v): int(c) for v, c in zip(versions, counts)},
        optional_fields=optional,
        trajectories=summarize_trajectories(joined["trajectory_id"], joined.get("termination_reason"),
                                            joined.get("tool_calls"), joined.get("tool_errors"),
                                            joined.get("tool_error_kinds")),
        extra={"codec": record["codec"], "segment_rows": int(record["segment_rows"]),
               "tail_fragments": len(units) - sealed, "capacity_rows": record.get("capacity_rows"),
               "zarr_format": 3, "format_version": record["format_version"],
               "chunk_checksum": record.get("chunk_checksum", "none")},
    )


def _live_writer(loc: Location) -> str | None:
    """Who holds the store's writer lock now (``"process 4242 on node-7"``), else None: a look, not a take."""
    if loc.local_root is not None:
        from rlhf_pipeline.storage.locking import LOCK_FILE_NAME, writer_holding

        return writer_holding(loc.local_root / LOCK_FILE_NAME)
    from rlhf_pipeline.storage.zarr.object_store import ObjectStoreKV, live_writer

    return live_writer(loc.kv) if isinstance(loc.kv, ObjectStoreKV) else None


def _bytes_on_disk(loc: Location) -> int:
    """What ``du`` counts for a local store; the object sizes for a remote one; the file for a zip."""
    if loc.local_root is not None:
        return disk_usage(loc.local_root)
    path = getattr(loc.kv.store, "path", None)
    if isinstance(path, (str, os.PathLike)) and str(path).endswith(".zip") and os.path.isfile(path):
        return disk_usage(path)
    return loc.kv.size_of(UNITS_PREFIX) + len(loc.kv.get(ROOT_META) or b"")


# ======================================================================== verify
@dataclass(frozen=True)
class MetadataFix:
    """A damaged or missing ``zarr.json`` of a unit (or of ``units/``), and the bytes its writer wrote."""

    key: str
    data: bytes
    unit: str | None  # the unit's name; None for units/zarr.json
    problem: str  # as :func:`verify` reports it


def verify(location: str, progress: Progress | None = None, storage_options: dict | None = None) -> CheckReport:
    """Decodes and checks every chunk of every published unit and its metadata; every problem names
    the chunk or file."""
    report = CheckReport(str(location), BACKEND)
    try:
        loc, record = open_record(str(location), storage_options)
    except StoreCorruptedError as exc:
        report.problems.append(str(exc))
        report.notes.append(f"without a readable commit record the units cannot be checked; "
                            f"`rlhf-pipeline repair {location}` rebuilds it from the units")
        return report
    try:
        return check_units(loc, record, str(location), progress)[0]
    finally:
        loc.kv.close()


def check_units(loc: Location, record: dict[str, Any], location: str, progress: Progress | None = None
                ) -> tuple[CheckReport, list[MetadataFix]]:
    """:func:`verify` of the units ``record`` names; also the metadata files that rewriting fixes."""
    report = CheckReport(location, BACKEND)
    layout = arrays_of(record, location)
    codecs = codecs_of(record)
    units = units_of(record, location)
    total = int(record["next_row"]) - int(record["first_row"])
    unchecked = 0
    expected = int(record["first_row"])
    fixes = _metadata_fixes(loc, {f"{UNITS_PREFIX}/{ROOT_META}": GROUP_METADATA}, None, location)
    try:
        constants = parse_constants(record, location)
    except StoreCorruptedError as exc:
        constants = {}
        report.problems.append(str(exc))
        report.record_problems.append(str(exc))
    for number, unit in enumerate(units, 1):
        if unit.first_row != expected:
            report.problems.append(f"{location}/zarr.json: unit {unit.name} starts at row {unit.first_row}, "
                                   f"the previous unit ends at {expected}")
        expected = unit.first_row + unit.rows
        try:
            arrays = read_unit(loc.kv, unit, layout, codecs)
            for wrong in disagreements(unit, constants, arrays):  # reads of those fields would be wrong
                problem = (f"{location}/zarr.json: {wrong}; `rlhf-pipeline repair {location} --apply` "
                           f"rewrites the record without them")
                report.problems.append(problem)
                report.record_problems.append(problem)
            fixes += _metadata_fixes(loc, unit_metadata(unit, arrays, layout, codecs), unit, location)
        except UnitGone as gone:
            report.problems.append(f"chunk {gone} of published unit {unit.name} is missing: rows "
                                   f"{unit.first_row}..{unit.first_row + unit.rows - 1} are lost")
        except StoreCorruptedError as exc:
            report.problems.append(f"unit {unit.name} (rows {unit.first_row}..{unit.first_row + unit.rows - 1}): "
                                   f"{exc}")
        unchecked += not unit.checksummed
        if progress is not None:
            progress(number, len(units))
    report.problems += [fix.problem for fix in fixes]
    if expected != int(record["next_row"]):
        report.problems.append(f"{location}/zarr.json: its units end at row {expected}, its next_row is "
                               f"{record['next_row']}")
    report.checked = {"units": len(units), "units with checksums": len(units) - unchecked, "rows": total}
    if unchecked:
        report.notes.append(f"{unchecked} unit(s) were written in format 1, without checksums: checked for "
                            f"decodability, size and offsets only")
    published = {u.name for u in units}
    orphans = [n for n in loc.kv.list_dir(UNITS_PREFIX) if n != ROOT_META and n not in published]
    if orphans:
        writer = _live_writer(loc)
        why = (f"being written by the live writer, {writer}, which holds the writer lock: published by its next "
               f"publish, or deleted by it" if writer is not None else
               "a writer's leftovers: a writer was stopped before publishing them, and the next one deletes them")
        report.notes.append(f"{len(orphans)} unit(s) under units/ are not published ({why}): "
                            f"{', '.join(orphans[:5])}")
    return report, fixes


def _metadata_fixes(loc: Location, expected: dict[str, bytes], unit: UnitRef | None, location: str
                    ) -> list[MetadataFix]:
    """The keys of ``expected`` whose stored metadata a plain zarr reader cannot use as written:
    missing, not JSON, or saying other than the writer wrote (a shape, codec or byte range)."""
    fixes = []
    for (key, data), raw in zip(expected.items(), loc.kv.get_many(list(expected))):
        if raw is None:
            what = "is missing"
        else:
            try:
                found = json.loads(raw)
            except ValueError:
                found = None
            want = json.loads(data)
            if found == want:
                continue
            if not isinstance(found, dict):
                what = "is empty" if not raw else "is not valid JSON"
            else:
                differ = sorted(k for k in want.keys() | found.keys() if want.get(k) != found.get(k))
                what = (f"does not describe what the unit holds (its {', '.join(differ)} "
                        f"{'differs' if len(differ) == 1 else 'differ'})")
        whose = f"unit {unit.name}'s" if unit is not None else "the units group's"
        fixes.append(MetadataFix(key, data, None if unit is None else unit.name, (
            f"{location.rstrip('/')}/{key} ({whose} metadata) {what}: this library reads its rows without it, "
            f"plain zarr cannot; `rlhf-pipeline repair {location} --apply` rewrites it from the unit")))
    return fixes
