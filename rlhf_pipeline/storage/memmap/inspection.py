"""``inspect`` and ``inspect --verify`` of a memmap store, from its files alone (json + numpy, no torch).

:func:`stats` summarizes the published rows (the store's ``stats()`` is this function); :func:`verify`
checks every held segment, sealed ones byte for byte against their recorded checksums and all of them
for structure, plus the manifest and the state slots. Design: docs/storage.md#checksums-and-checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rlhf_pipeline.storage.errors import StoreCorruptedError
from rlhf_pipeline.storage.memmap import checksums
from rlhf_pipeline.storage.memmap.layout import (
    BACKEND,
    CHECKSUMS_FROM,
    CHECKSUMS_NAME,
    ENDS_DTYPE,
    MANIFEST_NAME,
    STATE_STEM,
    FieldFiles,
    SegmentState,
    detect,
    fields_of,
    open_segment_checksums,
    raw_payload_bytes,
    read_manifest,
    read_published,
    segment_dir_name,
    segment_files,
)
from rlhf_pipeline.storage.memmap.state_slots import StateSlots
from rlhf_pipeline.storage.reports import CheckReport, Progress
from rlhf_pipeline.storage.summary import StoreStats, disk_usage, summarize_trajectories

__all__ = ["PublishedView", "check_segment", "detect", "stats", "verify"]



class PublishedView:
    """The published state of a store as plain values: what both functions below read."""

    def __init__(self, path: Path):
        self.path = path
        manifest = read_manifest(path)
        self.fields: list[FieldFiles] = fields_of(manifest, path)
        slots = StateSlots(path, stem=STATE_STEM)
        try:
            published = read_published(path, slots, manifest, self.fields)
        finally:
            slots.close()
        state = published.state if published is not None else manifest
        self.rollback = published.rollback if published is not None else None
        try:
            self.segment_rows = int(state["segment_rows"])
            self.capacity_rows = state.get("capacity_rows")
            self.first_row = int(state["first_row"])
            self.next_row = int(state["next_row"])
            self.segments = [SegmentState.from_json(s) for s in state["segments"]]
            self.evicted = list(state.get("evicted", []))
            self.open_checksums = open_segment_checksums(state)
            checksums_from = state.get(CHECKSUMS_FROM)
            self.checksums_from = None if checksums_from is None else int(checksums_from)
            self.optional = list(state["schema"].get("optional", []))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            source = published.source if published is not None else path / MANIFEST_NAME
            raise StoreCorruptedError(f"{source} is missing or has a malformed entry: {exc!r}") from None

    def column(self, name: str) -> np.ndarray:
        """A row field over every held row (read straight from the ``.col`` files)."""
        spec = next(f for f in self.fields if f.name == name)
        parts = []
        for state in self.segments:
            file = self.path / segment_dir_name(state.id) / f"{name}.col"
            try:
                part = np.fromfile(file, dtype=spec.dtype, count=state.rows)
            except FileNotFoundError:
                raise StoreCorruptedError(
                    f"{self.path}: segment {segment_dir_name(state.id)} holds published rows but {file.name} "
                    f"is missing (its directory was deleted or damaged); `rlhf-pipeline repair {self.path}` "
                    f"reports what is lost"
                ) from None
            if part.size != state.rows:
                raise StoreCorruptedError(f"{file} holds {part.size} rows, the published state says {state.rows}")
            parts.append(part)
        return np.concatenate(parts) if parts else np.empty(0, dtype=spec.dtype)


def stats(location: str) -> StoreStats:
    """Summary of the published rows: counts, rewards, policy versions, sizes (see :mod:`..summary`)."""
    view = PublishedView(Path(location))
    held = view.segments
    rows = view.next_row - view.first_row
    rewards = view.column("reward")
    versions, counts = np.unique(view.column("policy_version"), return_counts=True)
    out = StoreStats(
        backend=BACKEND, location=str(location), rows=rows, first_row=view.first_row, next_row=view.next_row,
        groups=int(np.unique(view.column("group_id")).size),
        prompt_tokens=sum(s.elements["prompt_tokens"] for s in held),
        response_tokens=sum(s.elements["response_tokens"] for s in held),
        bytes_on_disk=disk_usage(location),
        raw_bytes=sum(raw_payload_bytes(view.fields, s) for s in held),
        segments=len(held),
        policy_versions={int(v): int(c) for v, c in zip(versions, counts)},
        optional_fields=view.optional,
        trajectories=summarize_trajectories(
            view.column("trajectory_id"),
            *(view.column(name) if name in view.optional else None
              for name in ("termination_reason", "tool_calls", "tool_errors", "tool_error_kinds"))),
        extra={"segment_rows": view.segment_rows, "capacity_rows": view.capacity_rows,
               "evicted_segments_pending_delete": len(view.evicted)},
    )
    if rows:
        out.reward_mean = float(rewards.mean())
        out.reward_std = float(rewards.std())
        out.reward_min = float(rewards.min())
        out.reward_max = float(rewards.max())
    return out


# ============================================================================ verify
def verify(location: str, progress: Progress | None = None) -> CheckReport:
    """Checks the whole store; every problem names the file. Raises nothing for damage."""
    path = Path(location)
    report = CheckReport(str(location), BACKEND)
    try:
        view = PublishedView(path)
    except StoreCorruptedError as exc:
        report.problems.append(str(exc))
        report.notes.append("without a readable published state the segments cannot be checked; "
                            f"`rlhf-pipeline repair {location}` rebuilds it from the segment files")
        return report
    if view.rollback is not None:
        report.problems.append(view.rollback.describe(path))
    total = sum(_segment_bytes(view, s) for s in view.segments)
    sealed = unsummed = 0
    open_checked = False
    for number, state in enumerate(view.segments, 1):
        is_sealed = state.rows == view.segment_rows
        sealed += is_sealed
        directory = path / segment_dir_name(state.id)
        if not directory.is_dir():
            report.problems.append(f"{directory} is missing: rows {_rows_of(view, state)} are lost")
            continue
        sums = None
        if is_sealed:
            try:
                sums = checksums.read_checksums(directory)
            except StoreCorruptedError as exc:
                report.problems.append(str(exc))
            if sums is None and (directory / CHECKSUMS_NAME).exists():
                pass  # damaged: reported above
            elif sums is None and view.checksums_from is not None and state.id >= view.checksums_from:
                report.problems.append(checksums.missing_message(directory))
            elif sums is None:
                unsummed += 1
        elif view.open_checksums is not None and view.open_checksums[0] == state.id:
            open_checked = True
            report.problems += check_published_prefixes(directory, view.open_checksums[1])
        report.problems += check_segment(directory, view.fields, state, sums)
        if progress is not None:
            progress(number, len(view.segments))
    report.checked = {"segments": len(view.segments), "sealed segments with checksums": sealed - unsummed,
                      "rows": view.next_row - view.first_row, "bytes": total}
    if unsummed:
        report.notes.append(f"{unsummed} sealed segment(s) have no checksums (sealed by a version before "
                            f"checksums): checked for structure only")
    if view.segments and view.segments[-1].rows < view.segment_rows and not open_checked:
        report.notes.append(f"the open segment {segment_dir_name(view.segments[-1].id)} was published without "
                            f"checksums (by a version before them, or by repair): checked for structure only")
    return report


def check_published_prefixes(directory: Path, sums: dict[str, tuple[int, int]]) -> list[str]:
    """Problems of an open segment's files against the CRC32C of their published bytes recorded
    by the last publish (the files may hold more: an append in progress, or grown-ahead space)."""
    problems = []
    for name, (size, crc) in sorted(sums.items()):
        file = directory / name
        try:
            data = np.fromfile(file, dtype=np.uint8, count=size)
        except FileNotFoundError:
            problems.append(f"{file} is missing (segment {directory.name}, field {name.split('.')[0]!r})")
            continue
        if data.size < size:
            problems.append(f"{file} holds {data.size} bytes, the published state needs {size}")
        elif checksums.crc32c(data) != crc:
            problems.append(f"{file} fails its crc32c checksum (recorded by the last publish of the open segment "
                            f"{directory.name}): its bytes were damaged on disk; reads of its rows may return wrong "
                            f"values. Restore it from a snapshot")
    return problems


def check_segment(directory: Path, fields: list[FieldFiles], state: SegmentState,
                  sums: dict[str, tuple[int, int]] | None) -> list[str]:
    """Problems of one held segment's files (each names the file); empty when it is intact."""
    problems = []
    for name, (dtype, count) in segment_files(fields, state).items():
        file = directory / name
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            problems.append(f"{file} is missing (segment {directory.name}, field {name.split('.')[0]!r})")
            continue
        if size < count * dtype.itemsize:
            problems.append(f"{file} holds {size} bytes, the published state needs {count * dtype.itemsize}")
            continue
        if sums is not None and name in sums:
            try:
                checksums.check_bytes(file, np.fromfile(file, dtype=np.uint8), sums[name])
            except StoreCorruptedError as exc:
                problems.append(str(exc))
                continue
    if problems:
        return problems
    for f in fields:
        if not f.ragged:
            continue
        ends = np.fromfile(directory / f"{f.name}.ends", dtype=ENDS_DTYPE, count=state.rows)
        previous = np.concatenate([[0], ends[:-1]])
        grows = ends > previous if f.kind == "token" else ends >= previous
        if state.rows and (not grows.all() or ends[-1] != state.elements[f.name]):
            row = int(np.flatnonzero(~grows)[0]) if not grows.all() else state.rows - 1
            problems.append(f"{directory / (f.name + '.ends')} is damaged: end offset of row {row} is "
                            f"{int(ends[row])} (the previous is {int(previous[row])}; {state.elements[f.name]} "
                            f"values are published)")
            continue
        if f.kind == "text":
            raw = np.fromfile(directory / f"{f.name}.values", dtype=np.uint8, count=state.elements[f.name])
            try:
                raw.tobytes().decode("utf-8")
            except UnicodeDecodeError as exc:
                problems.append(f"{directory / (f.name + '.values')} is damaged: byte {exc.start} is not valid UTF-8")
    return problems


def _segment_bytes(view: PublishedView, state: SegmentState) -> int:
    return sum(c * d.itemsize for d, c in segment_files(view.fields, state).values())


def _rows_of(view: PublishedView, state: SegmentState) -> str:
    first = state.id * view.segment_rows
    return f"{first}..{first + state.rows - 1}"
