"""``rlhf-pipeline repair`` of a Zarr store: rebuild the commit record from the units, in a local directory
or at an ``s3://`` or ``az://`` URL.

Without a record, the configuration comes from the units' metadata and the rows from every unit, lowest
row first, a sealed segment preferred to fragments of the same rows; rows no readable unit holds stay
published as lost, so later rows keep their ids. With an intact record it checks every published unit and
reports what it cannot fix. Either way it rewrites a unit's damaged or missing metadata with the bytes its
writer wrote. It writes under the writer lock (at a URL the leased lock, and the record with ``If-Match``),
copies the replaced record to ``repair-<time>/`` and deletes nothing; other URLs are refused.
Design: docs/zarr-layout.md#damage-and-repair."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from rlhf_pipeline.storage.errors import StoreCorruptedError
from rlhf_pipeline.storage.reports import Progress, RepairReport
from rlhf_pipeline.storage.zarr.layout import (
    CHECKSUM,
    FORMAT_VERSION,
    FRAGMENT_CODEC,
    PACKED_ATTRS_KEY,
    UNITS_PREFIX,
    arrays_json,
    arrays_of,
)
from rlhf_pipeline.storage.zarr.location import publish, resolve
from rlhf_pipeline.storage.zarr.unit_constants import RECORD_KEY as CONSTANTS_KEY
from rlhf_pipeline.storage.zarr.units import (
    FRAGMENT,
    PACKED_FRAGMENT,
    ROOT_META,
    SEALED,
    SEALED_PACKED,
    UnitCodecs,
    UnitGone,
    UnitRef,
    parse_unit_name,
    read_unit,
)

BACKEND = "zarr"


def repair(location: str, *, apply: bool = False, progress: Progress | None = None) -> RepairReport:
    """Rebuilds the commit record of the Zarr store at ``location`` (a dry run unless ``apply``)."""
    from rlhf_pipeline.storage.zarr.inspection import check_units, open_record

    report = RepairReport(str(location), BACKEND, applied=apply, rows_before=None, rows_after=None)
    try:
        loc, record = open_record(str(location))
    except StoreCorruptedError as exc:
        report.notes.append(str(exc))
    else:
        try:
            check, fixes = check_units(loc, record, str(location), progress)
        finally:
            loc.kv.close()
        report.rows_before = report.rows_after = int(record["next_row"]) - int(record["first_row"])
        fixed = {fix.problem for fix in fixes}
        damage = [p for p in check.problems if p not in check.record_problems and p not in fixed]
        report.unrecoverable += damage
        report.notes += check.notes
        if damage:
            report.notes.append("the commit record is intact: repair cannot restore damaged chunks; restore the "
                                "store (or the units named) from a snapshot")
        if check.record_problems:
            # the rows are intact and the record names them: only what it says of their values is wrong
            report.actions.append(f"write {location}/zarr.json without its '{CONSTANTS_KEY}' "
                                  f"({len(check.record_problems)} problem(s)): reads of those fields then decode "
                                  f"the units")
        if (check.record_problems or fixes) and (refused := _unwritable(str(location))):
            report.unrecoverable.append(refused)
            return report
        if apply and check.record_problems:
            backup = _write_record(str(location), lambda current: _without_constants(current, str(location)))
            report.notes.append(_backup_note(location, backup))
        _rewrite_metadata(str(location), fixes, report, apply=apply)
        return report

    if refused := _unwritable(str(location)):
        report.unrecoverable.append(refused)
        return report
    loc = resolve(str(location), read_only=True, storage_options=None)
    try:
        candidates = [u for u in (parse_unit_name(n) for n in loc.kv.list_dir(UNITS_PREFIX) if n != ROOT_META)
                      if u is not None]
        config = _config_from_units(loc, candidates, report)
        if config is None:
            return report
        layout = arrays_of(config, str(location))
        codecs = UnitCodecs(config["codec"], config["fragment_codec"])
        segment_rows = config["segment_rows"]
        candidates = [_with_kind(u, segment_rows) for u in candidates if u.rows > 0]
        # a unit the chain does not take (a fragment a seal replaced) is an orphan the next writer deletes
        chain, lost, row = _chain(loc, candidates, layout, codecs, segment_rows, report, progress)
        first = chain[0].first_row if chain else 0
        record = dict(config, first_row=first, next_row=row, units=[[u.first_row, u.rows, u.kind] for u in chain])
        report.rows_after = row - first
        report.actions.append(f"write {location}/zarr.json: a commit record rebuilt from {len(chain) - len(lost)} "
                              f"unit(s), rows {first}..{row - 1}")
        report.notes.append(
            "no commit record: every readable unit is published, including fragments a writer killed before its "
            "publish may have left (they were never acknowledged)")
        fixes = check_units(loc, record, str(location))[1]  # the metadata of the units it names, as zarr reads it
    finally:
        loc.kv.close()
    if apply:
        backup = _write_record(str(location), lambda _: record)
        report.notes.append(_backup_note(location, backup))
    _rewrite_metadata(str(location), fixes, report, apply=apply)
    return report


def _unwritable(location: str) -> str | None:
    """Why repair may not write at ``location``; None where it may (a directory, an s3:// or az:// URL)."""
    from rlhf_pipeline.storage.zarr.object_store import is_object_store_url

    if "://" in location and not is_object_store_url(location):
        return (f"{location}: repair writes a commit record only in a local directory or at an s3:// or az:// URL, "
                f"where a writer lock keeps every writer out meanwhile; give the store's local path instead")
    if "://" not in location and not Path(location).is_dir():
        return f"{location}: repair rebuilds the records of directory stores only (unzip a .zip store first)"
    return None


def _rewrite_metadata(location: str, fixes, report: RepairReport, *, apply: bool) -> None:
    """Rewrites each damaged or missing metadata file in ``fixes`` (a unit's ``zarr.json``) with the
    bytes its writer wrote, under the writer lock, for the units the record still names."""
    if not fixes:
        return
    shown = ", ".join(fix.key for fix in fixes[:3]) + (f" and {len(fixes) - 3} more" if len(fixes) > 3 else "")
    report.actions.append(f"rewrite {len(fixes)} metadata file(s) of {location} from their units ({shown}): "
                          f"plain zarr reads those units again")
    if not apply:
        return
    from rlhf_pipeline.files.atomic import write_atomic
    from rlhf_pipeline.storage.zarr.inspection import units_of
    from rlhf_pipeline.storage.zarr.location import lock_for, parse_root

    loc = resolve(location, read_only=False, storage_options=None)
    try:
        lock = lock_for(loc, location)
        try:
            # a writer may have compacted or evicted a unit since the check: its metadata is not written back
            named = {u.name for u in units_of(parse_root(loc.kv.get(ROOT_META), location), location)}
            for fix in fixes:
                if fix.unit is not None and fix.unit not in named:
                    continue
                if loc.local_root is not None:
                    write_atomic(loc.local_root / fix.key, lambda f, data=fix.data: f.write(data))
                    continue
                # an object store creates unit keys only; under the lock a damaged one is replaced,
                # conditionally on the version read
                found = loc.kv.read_object(fix.key)
                if found is None:
                    loc.kv.create_object(fix.key, fix.data)
                else:
                    loc.kv.replace_object(fix.key, fix.data, found.etag)
        finally:
            lock.release()
    finally:
        loc.kv.close()


def _write_record(location: str, make_record) -> str:
    """Publishes ``make_record(the zarr.json held now, or None)`` under the writer lock, the replaced
    zarr.json copied to ``repair-<time>/`` first; returns that folder's name."""
    from rlhf_pipeline.storage.zarr.layout import GROUP_METADATA
    from rlhf_pipeline.storage.zarr.location import lock_for

    loc = resolve(location, read_only=False, storage_options=None)
    try:
        # locally an flock; at a URL the leased lock object, whose taking fences earlier writers and
        # remembers the version of zarr.json that the publish below may replace (If-Match)
        lock = lock_for(loc, location)
        try:
            backup = time.strftime("repair-%Y%m%d-%H%M%S")
            replaced = loc.kv.get(ROOT_META)
            if "://" in location:
                if replaced is not None:  # created, never overwritten (the object-store keys are create-only)
                    loc.kv.put_many({f"{backup}/{ROOT_META}": bytes(replaced)}, durable=True)
            else:
                root = Path(location)
                (root / backup).mkdir(exist_ok=True)
                if (root / ROOT_META).exists():
                    shutil.copy2(root / ROOT_META, root / backup / ROOT_META)
            if loc.kv.get(f"{UNITS_PREFIX}/{ROOT_META}") is None:
                loc.kv.put_many({f"{UNITS_PREFIX}/{ROOT_META}": GROUP_METADATA}, durable=True)
            publish(loc, make_record(replaced), durable=True)
        finally:
            lock.release()
    finally:
        loc.kv.close()
    return backup


def _without_constants(raw, location: str) -> dict[str, Any]:
    """The record in ``raw`` (read under the lock: a writer may have published since the check)
    without its unit constants."""
    from rlhf_pipeline.storage.zarr.location import parse_root

    record = dict(parse_root(raw, location))
    record.pop(CONSTANTS_KEY, None)
    return record


def _backup_note(location, backup: str) -> str:
    if "://" in str(location):
        return f"a copy of the replaced zarr.json (if any) is in {str(location).rstrip('/')}/{backup}"
    return f"a copy of the replaced zarr.json (if any) is in {Path(location) / backup}"


def _chain(loc, candidates: list[UnitRef], layout, codecs: UnitCodecs, segment_rows: int, report: RepairReport,
           progress: Progress | None) -> tuple[list[UnitRef], list[UnitRef], int]:
    """``(units, lost, next_row)``: a chain of units from the lowest row to the highest row any unit holds.

    Every readable unit is kept at its rows, so no row id a readable row holds is ever given to
    an append again. Where no unit at a row decodes, the rows stay published as lost: the best
    unit there (sealed first) when it exists, else a placeholder unit per segment of the gap
    whose chunks are missing; reads of them raise :class:`StoreCorruptedError`, as reads of a
    deleted memmap segment do (repair of both backends keeps the same rows).
    """
    by_start: dict[int, list[UnitRef]] = {}
    for unit in candidates:
        by_start.setdefault(unit.first_row, []).append(unit)
    end = max((u.first_row + u.rows for u in candidates), default=0)
    chain: list[UnitRef] = []
    lost: list[UnitRef] = []
    row = min(by_start, default=0)
    while row < end:
        options = sorted(by_start.get(row, []), key=lambda u: (not u.sealed, -u.rows))
        chosen = None
        for unit in options:
            try:
                read_unit(loc.kv, unit, layout, codecs)
                chosen = unit
                break
            except (UnitGone, StoreCorruptedError) as exc:
                report.unrecoverable.append(f"unit {unit.name} cannot be read ({exc}): rows "
                                            f"{unit.first_row}..{unit.first_row + unit.rows - 1} are lost (they "
                                            f"stay published; reads of them raise StoreCorruptedError)")
        if chosen is None and options:
            chosen = options[0]
            lost.append(chosen)
        elif chosen is None:
            following = min((start for start in by_start if start > row), default=end)
            segment_end = row - row % segment_rows + segment_rows
            stop = min(following, segment_end)
            whole = row % segment_rows == 0 and stop == segment_end
            chosen = UnitRef(row, stop - row, SEALED_PACKED if whole else PACKED_FRAGMENT)
            lost.append(chosen)
            report.unrecoverable.append(f"rows {row}..{stop - 1} are in no unit (deleted): they are lost; they stay "
                                        f"published (reads of them raise StoreCorruptedError) so that no append "
                                        f"reuses their row ids")
        chain.append(chosen)
        row += chosen.rows
        if progress is not None:
            progress(len(chain), len(candidates))
    return chain, lost, row


def _with_kind(unit: UnitRef, segment_rows: int) -> UnitRef:
    """Unsuffixed (format 1) units are sealed segments when they hold a whole aligned segment."""
    if unit.kind == SEALED and not (unit.rows == segment_rows and unit.first_row % segment_rows == 0):
        return UnitRef(unit.first_row, unit.rows, FRAGMENT)
    return unit


def _config_from_units(loc, units: list[UnitRef], report: RepairReport) -> dict[str, Any] | None:
    """The record's configuration from the units' metadata: codec, arrays, fields, segment size."""
    from rlhf_pipeline.schema import FIELDS, StoreSchema
    from rlhf_pipeline.storage.zarr.layout import field_layout, unit_arrays

    if not units:
        report.unrecoverable.append("no units under units/: there are no rows to rebuild a record from")
        return None
    names: set[str] = set()
    codec: dict[str, Any] | None = None
    sealed = [u for u in units if u.kind in (SEALED_PACKED, SEALED)]
    for unit in sorted(units, key=lambda u: u.kind not in (SEALED_PACKED, SEALED)):
        meta_keys = ([f"{unit.prefix}/rows/{ROOT_META}", f"{unit.prefix}/values/{ROOT_META}"]
                     if unit.kind == SEALED_PACKED else [f"{unit.prefix}/{ROOT_META}"])
        for raw in loc.kv.get_many(meta_keys):
            try:
                meta = json.loads(raw)
            except (TypeError, ValueError):
                continue
            names |= set(meta.get("attributes", {}).get(PACKED_ATTRS_KEY, {}))
            if unit.kind == SEALED_PACKED and codec is None:
                codec = _codec_config(meta.get("codecs", []))
        if unit.kind in (SEALED, FRAGMENT):  # format 1: one array per field, each with its codecs
            arrays = set(loc.kv.list_dir(unit.prefix)) - {ROOT_META}
            names |= arrays
            if unit.kind == SEALED and codec is None and "response_tokens" in arrays:
                raw = loc.kv.get(f"{unit.prefix}/response_tokens/{ROOT_META}")
                try:
                    codec = _codec_config(json.loads(raw).get("codecs", []))
                except (TypeError, ValueError):
                    pass
        if names and (codec is not None or not sealed):
            break
    fields = {n for n in names if not n.endswith("_offsets")}
    optional = tuple(f.name for f in FIELDS if not f.required and f.name in fields)
    schema = StoreSchema(optional=optional)
    segment_rows = max((u.rows for u in sealed), default=None)
    if segment_rows is None:
        segment_rows = 4096
        report.notes.append("no sealed segment: segment_rows set to the default, 4096")
    codec = codec or {"name": "blosc", "cname": "zstd", "clevel": 1, "shuffle": "shuffle", "blocksize": 2**20}
    report.notes.append(f"configuration rebuilt from the units: segment_rows={segment_rows}, codec {codec['name']}, "
                        f"optional fields {list(optional)}; capacity_rows is unknown and set to none (unbounded)")
    return {"backend": BACKEND, "format_version": FORMAT_VERSION, "schema": schema.to_json(), "codec": codec,
            "segment_rows": segment_rows, "capacity_rows": None,
            "fragment_codec": codec if codec["name"] == "none" else FRAGMENT_CODEC,
            "fields": field_layout(schema), "arrays": arrays_json(unit_arrays(schema)), "chunk_checksum": CHECKSUM}


def _codec_config(codecs: list[dict[str, Any]]) -> dict[str, Any] | None:
    for codec in codecs:
        config = codec.get("configuration", {})
        if codec.get("name") == "blosc":
            return {"name": "blosc", "cname": config["cname"], "clevel": config["clevel"],
                    "shuffle": config["shuffle"], "blocksize": config.get("blocksize", 0)}
        if codec.get("name") == "zstd":
            return {"name": "zstd", "level": config["level"]}
    return {"name": "none"}


__all__ = ["repair"]
