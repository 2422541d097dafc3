"""``rlhf-pipeline repair`` of a memmap store: rebuild the published state from the segment files.

A store needs ``manifest.json`` and a state slot to be read, and both follow from the segment files (sealed
files are trimmed to their size, the open segment's end offsets count its complete rows:
:func:`~.layout.complete_rows`). With an intact newest slot repair publishes exactly the rows it covers;
without one (damaged, or lost: :func:`~.layout.lost_slot`) it walks the segments from the first held one,
keeping a missing or short segment before later ones as lost rows. It rewrites a damaged manifest and both
slots under the writer lock, records a lost ``checksums.json`` again, copies what it replaces to
``repair-<time>/`` and deletes nothing; a damaged file's contents it cannot fix.
Design: docs/storage.md#repair-step-by-step."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from rlhf_pipeline.files.atomic import publish_json
from rlhf_pipeline.storage.errors import StoreCorruptedError
from rlhf_pipeline.storage.memmap import checksums
from rlhf_pipeline.storage.memmap.inspection import check_segment
from rlhf_pipeline.storage.memmap.layout import (
    BACKEND,
    CHECKSUMS_FROM,
    CHECKSUMS_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    SLOT_FILES_CREATED,
    STATE_STEM,
    FieldFiles,
    SegmentState,
    complete_rows,
    complete_rows_beyond,
    fields_json,
    fields_of,
    lost_slot,
    read_manifest,
    segment_dir_name,
    segment_files,
    segment_ids_on_disk,
)
from rlhf_pipeline.storage.memmap.state_slots import StateSlots
from rlhf_pipeline.storage.segmented import WRITER_STATE_KEY
from rlhf_pipeline.storage.reports import Progress, RepairReport

_CONFIG_KEYS = ("schema", "segment_rows", "capacity_rows", "evict_grace_s")


def repair(location: str, *, apply: bool = False, progress: Progress | None = None) -> RepairReport:
    """Rebuilds the published state of the memmap store at ``location`` (a dry run unless ``apply``)."""
    path = Path(location)
    report = RepairReport(str(location), BACKEND, applied=apply, rows_before=None, rows_after=None)

    # ---- what is published now, and what is damaged
    manifest, manifest_ok = None, False
    try:
        manifest = read_manifest(path)
        manifest_ok = all(k in manifest for k in _CONFIG_KEYS) and manifest.get("backend") == BACKEND
    except StoreCorruptedError as exc:
        report.notes.append(str(exc))
    slots = StateSlots(path, stem=STATE_STEM)
    try:
        reading = slots.read(0)
    finally:
        slots.close()
    intact = reading.state
    current = intact if intact is not None else (manifest if manifest_ok and not reading.damaged else None)
    if current is not None:
        report.rows_before = int(current["next_row"]) - int(current["first_row"])
    claimed = [d.claimed_state for d in reading.damaged if d.claimed_state is not None]
    config_source = next((c for c in (intact, manifest if manifest_ok else None, *claimed)
                          if c is not None and all(k in c for k in _CONFIG_KEYS)), None)
    if config_source is None:
        config_source = _infer_config(path, report)
        if config_source is None:
            return report
    fields = _fields(manifest if manifest_ok else None, config_source, path)
    segment_rows = int(config_source["segment_rows"])
    # a lost slot may have held the newest publish: the remaining one is no record of what was acknowledged
    lost = lost_slot(path, reading, manifest if manifest_ok else {}, fields)
    checksums_from = (current or config_source).get(CHECKSUMS_FROM)

    # ---- walk the segment files
    # segment states to trust: only an intact publish's (a damaged slot's payload may be wrong)
    known = {s[0]: SegmentState.from_json(s) for s in (current or {}).get("segments", [])}
    # an intact newest slot is the record of what was acknowledged: rows past it were never
    # acknowledged (a collector writes that round again), so it bounds what is published
    # (so is the manifest of a store no publish has reached yet: one killed in its first append)
    record = intact if intact is not None else (current if not reading.slots_in_use else None)
    acknowledged = int(record["next_row"]) if record is not None and not reading.damaged and lost is None else None
    first_row = int((current or config_source).get("first_row", 0))
    on_disk = segment_ids_on_disk(path)
    first_seg = first_row // segment_rows
    if (current is None or (lost is not None and config_source["capacity_rows"] is not None)) and on_disk:
        # no state, or one that a lost publish may have moved on: evictions since may have deleted segments
        first_seg = max(first_seg, on_disk[0])
    segments: list[SegmentState] = []
    resum: list[tuple[Path, SegmentState]] = []  # sealed segments whose lost checksums.json is recorded again
    seg_id = first_seg
    total = sum(1 for i in on_disk if i >= first_seg) or 1
    while True:
        directory = path / segment_dir_name(seg_id)
        later = any(i > seg_id for i in on_disk)
        if not directory.is_dir():
            if later and (seg_id in known or acknowledged is None):
                # keep it published: later segments keep their row ids, and no append reuses one
                state = known.get(seg_id) or SegmentState(seg_id, segment_rows, {f.name: 0 for f in fields if f.ragged})
                segments.append(state)
                report.unrecoverable.append(
                    f"{directory} is missing: rows {seg_id * segment_rows}..{seg_id * segment_rows + state.rows - 1}"
                    f" are lost (reads of them raise StoreCorruptedError; the other segments read)")
                seg_id += 1
                continue
            break
        if acknowledged is not None and seg_id not in known:
            if seg_id == first_seg and not segments:
                segments.append(SegmentState(seg_id, 0, {f.name: 0 for f in fields if f.ragged}))
            break  # nothing of it was published
        if acknowledged is not None:
            rows, elements = known[seg_id].rows, dict(known[seg_id].elements)
        else:
            rows, elements = complete_rows(directory, fields, limit=segment_rows)
        if rows == segment_rows or (seg_id in known and known[seg_id].rows == segment_rows):
            # a full segment: counts from an intact publish (even when its end offsets are damaged),
            # else from its end offsets (right even if a killed writer never trimmed its files)
            full = seg_id in known and known[seg_id].rows == segment_rows
            state = known[seg_id] if full else SegmentState(seg_id, rows, elements)
            sums, sums_problem = _sealed_checksums(directory)
            damage = check_segment(directory, fields, state, sums)
            for problem in damage:
                report.unrecoverable.append(f"{problem} (rows {seg_id * segment_rows}..{(seg_id + 1) * segment_rows - 1}"
                                            f" of this segment raise StoreCorruptedError when read)")
            if sums is None and not damage:
                if sums_problem is not None or (checksums_from is not None and seg_id >= int(checksums_from)):
                    # sealed with checksums, which were lost: recorded again from the files as they are
                    resum.append((directory, state))
                    report.actions.append(
                        f"record {directory / CHECKSUMS_NAME} again ({sums_problem or 'it is missing'}): from the "
                        f"files as they are now, which pass the structural checks; a byte damaged before this "
                        f"cannot be told")
                else:
                    report.notes.append(f"{directory.name} is sealed but has no checksums (sealed before checksums "
                                        f"existed)")
            segments.append(state)
        elif acknowledged is None and later:
            # short, yet segments follow: damaged (a segment is full before the next one starts). It
            # stays published whole so that the later segments keep their row ids
            elements = {f.name: (directory / f"{f.name}.values").stat().st_size // f.dtype.itemsize
                        for f in fields if f.ragged and (directory / f"{f.name}.values").exists()}
            segments.append(SegmentState(seg_id, segment_rows, elements))
            report.unrecoverable.append(
                f"{directory} holds {rows} complete rows of {segment_rows} although segments follow it: its files are "
                f"damaged; rows {seg_id * segment_rows}..{(seg_id + 1) * segment_rows - 1} stay published and reads of "
                f"them raise StoreCorruptedError")
        else:
            if rows or seg_id == first_seg:
                segments.append(SegmentState(seg_id, rows, elements))
            break
        seg_id += 1
        if progress is not None:
            progress(len(segments), total)
    next_row = (segments[-1].id * segment_rows + segments[-1].rows) if segments else first_seg * segment_rows
    unacknowledged = 0
    if acknowledged is not None:
        # left by a writer killed mid-append, or after writing and before publishing: the next
        # writer truncates them, so they are neither published nor moved
        unacknowledged = complete_rows_beyond(path, fields, segment_rows, next_row, segments)
    first_row = (segments[0].id * segment_rows) if segments else next_row
    report.rows_after = next_row - first_row
    evicted = [e for e in (current or {}).get("evicted", []) if int(e[0]) < first_seg]
    rebuilt = {"backend": BACKEND, "format_version": FORMAT_VERSION, "schema": config_source["schema"],
               "segment_rows": segment_rows, "capacity_rows": config_source["capacity_rows"],
               "evict_grace_s": float(config_source["evict_grace_s"]), "first_row": first_row, "next_row": next_row,
               "segments": [s.to_json() for s in segments], "evicted": evicted}
    if checksums_from is not None:
        rebuilt[CHECKSUMS_FROM] = int(checksums_from)
    if current is not None and WRITER_STATE_KEY in current and int(current["next_row"]) == next_row:
        rebuilt[WRITER_STATE_KEY] = current[WRITER_STATE_KEY]  # it goes with these rows: the writer resumes from it

    # ---- what to do
    same = current is not None and _same_rows(current, rebuilt)
    republish = not same or bool(reading.damaged) or lost is not None
    # both slot files exist once republished: the manifest then says so
    rewrite_manifest = not manifest_ok or "fields" not in (manifest or {}) or \
        (republish and not (manifest or {}).get(SLOT_FILES_CREATED))
    if rewrite_manifest:
        why = "rebuilt: it is damaged or missing" if not manifest_ok else "adds the field layout and slot files"
        report.actions.insert(0, f"write {path / MANIFEST_NAME} ({why})")
    if republish:
        before = "no readable state" if current is None else f"rows up to {current['next_row']}"
        report.actions.append(f"publish the state rebuilt from the segment files into {STATE_STEM}.0 and "
                              f"{STATE_STEM}.1 ({before} -> rows {first_row}..{next_row - 1})")
    if unacknowledged:
        from rlhf_pipeline.storage.locking import LOCK_FILE_NAME, writer_holding

        writer = writer_holding(path / LOCK_FILE_NAME)
        if writer is not None:
            report.notes.append(
                f"{unacknowledged} complete row(s) past the published end (row {next_row}) are being appended by the "
                f"live writer, {writer}, which holds the writer lock: its next publish acknowledges them; nothing "
                f"to repair")
        else:
            report.notes.append(
                f"{unacknowledged} complete row(s) past the published end (row {next_row}) were never acknowledged "
                f"(a writer was killed before publishing them; a collector writes that round again): they are not "
                f"published, and the next writer discards them")
    elif acknowledged is None and not same:
        report.notes.append(
            f"{'a state slot was lost' if lost is not None else 'no intact state slot'}: every complete row in the "
            f"segment files is published, including rows a writer killed before its last publish may have left "
            f"(they may never have been acknowledged)")
    if lost is not None:
        report.notes.append(f"lost state slot: {lost}")
    if reading.damaged:
        for damage in reading.damaged:
            report.notes.append(f"damaged state slot: {damage.describe()}")
    if not apply or not report.actions:
        return report

    # ---- apply, under the writer lock
    from rlhf_pipeline.storage.locking import LOCK_FILE_NAME, WriterLock

    with WriterLock(path / LOCK_FILE_NAME):
        backup = path / time.strftime("repair-%Y%m%d-%H%M%S")
        backup.mkdir(exist_ok=True)
        for name in (MANIFEST_NAME, f"{STATE_STEM}.0", f"{STATE_STEM}.1"):
            if (path / name).exists():
                shutil.copy2(path / name, backup / name)
        for directory, state in resum:
            _record_checksums(directory, fields, state, backup)
        if rewrite_manifest:
            base = dict(rebuilt, first_row=0, next_row=0, segments=[], evicted=[]) if not manifest_ok else dict(manifest)
            if republish:
                StateSlots(path, stem=STATE_STEM).create_files()
                base[SLOT_FILES_CREATED] = True
            publish_json(path / MANIFEST_NAME, {**base, "fields": fields_json(fields)}, durable=True)
        if republish:
            # above every publish either slot may have held (a lost one held at most one more)
            seq = max([reading.seq or 0, *(d.claimed_seq or 0 for d in reading.damaged)]) + 1
            slots = StateSlots(path, stem=STATE_STEM)
            try:
                slots.publish(seq, rebuilt, durable=True)
                slots.publish(seq + 1, rebuilt, durable=True)  # both slots intact: no damaged one is left
            finally:
                slots.close()
        report.notes.append(f"copies of the replaced files are in {backup}")
    return report


def _sealed_checksums(directory: Path) -> tuple[dict[str, tuple[int, int]] | None, str | None]:
    """A sealed segment's checksums, and what is wrong with its checksums.json when it is damaged."""
    if not (directory / CHECKSUMS_NAME).exists():
        return None, None
    try:
        return checksums.read_checksums(directory), None
    except StoreCorruptedError:
        return None, "it is damaged"


def _record_checksums(directory: Path, fields: list[FieldFiles], state: SegmentState, backup: Path) -> None:
    """Writes a sealed segment's checksums.json from its files (a damaged one is kept in ``backup``)."""
    if (directory / CHECKSUMS_NAME).exists():
        shutil.copy2(directory / CHECKSUMS_NAME, backup / f"{directory.name}-{CHECKSUMS_NAME}")
    sums = {}
    for name in segment_files(fields, state):
        data = np.fromfile(directory / name, dtype=np.uint8)  # the whole file, as readers check it
        sums[name] = (data.size, checksums.crc32c(data))
    partial = checksums.write_checksums(directory, sums)
    fd = os.open(partial, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    checksums.publish_checksums(directory, durable=True)


def _same_rows(current: dict[str, Any], rebuilt: dict[str, Any]) -> bool:
    keys = ("first_row", "next_row")

    def held(state: dict[str, Any]) -> list[list]:
        return [list(s[:2]) for s in state["segments"] if s[1]]  # an empty segment holds nothing

    return all(int(current[k]) == int(rebuilt[k]) for k in keys) and held(current) == held(rebuilt)


def _fields(manifest: dict[str, Any] | None, config: dict[str, Any], path: Path) -> list[FieldFiles]:
    if manifest is not None and "fields" in manifest:
        return fields_of(manifest, path)
    return fields_of({"schema": config["schema"]}, path)  # from the schema table (imports torch)


def _infer_config(path: Path, report: RepairReport) -> dict[str, Any] | None:
    """The configuration from the segment files alone: optional fields from the file names, the
    segment size from a sealed segment (one before the last). None when it cannot be told."""
    from rlhf_pipeline.schema import FIELDS, StoreSchema

    ids = segment_ids_on_disk(path)
    if len(ids) < 2:
        report.unrecoverable.append(
            f"{path}: no intact state slot, no usable manifest and fewer than two segments: the segment size "
            f"cannot be told from the files. Nothing was changed.")
        return None
    directory = path / segment_dir_name(ids[0])
    names = {p.name.split(".")[0] for p in directory.iterdir() if p.suffix in (".values", ".col")}
    optional = tuple(f.name for f in FIELDS if not f.required and f.name in names)
    schema = StoreSchema(optional=optional)
    segment_rows = (directory / "trajectory_id.col").stat().st_size // 8
    report.notes.append(f"configuration inferred from the files: segment_rows={segment_rows}, optional fields "
                        f"{list(optional)}; capacity_rows is unknown and set to none (unbounded)")
    return {"schema": schema.to_json(), "segment_rows": segment_rows, "capacity_rows": None,
            "evict_grace_s": 60.0, "first_row": ids[0] * segment_rows, "segments": []}
