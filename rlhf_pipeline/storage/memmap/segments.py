"""Files of one memmap segment: how rows are laid out, appended and mapped back.

A segment ``seg-<id>`` holds per field ``<field>.values`` and ``<field>.ends`` (token and text fields: flat
values and int64 end offsets) or ``<field>.col`` (row fields): raw little-endian data without a header, of
which the published state says how much is published. :class:`SegmentWriter` appends with ``pwrite``,
grows files ahead sparsely so readers rarely remap, and trims them when sealing; :func:`copy_segment`
copies a segment's published part (snapshots). Reads go through :class:`~.views.SegmentView`.
Design: docs/storage.md#segment-files."""

from __future__ import annotations

import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import google_crc32c
import numpy as np

from rlhf_pipeline.schema import FieldSpec, StoreSchema, TrajectoryBatch
from rlhf_pipeline.storage.errors import StoreCorruptedError
from rlhf_pipeline.storage.memmap import checksums
from rlhf_pipeline.storage.memmap.layout import (  # noqa: F401 - SegmentState, segment_dir_name re-exported
    ENDS_DTYPE,
    SegmentState,
    field_files,
    segment_dir_name,
)
from rlhf_pipeline.storage.memmap.layout import segment_files as _files_of
from rlhf_pipeline.storage.memmap.mapping import MADV_POPULATE_READ
from rlhf_pipeline.storage.memmap.views import SegmentView

_GROW_MIN = 64 * 1024
_GROW_MAX_STEP = 256 * 1024 * 1024


_pool: tuple[int, ThreadPoolExecutor] | None = None


def _sync_pool() -> ThreadPoolExecutor:
    """Threads that issue fsyncs concurrently; recreated after a fork (threads do not survive one)."""
    global _pool
    if _pool is None or _pool[0] != os.getpid():
        _pool = (os.getpid(), ThreadPoolExecutor(max_workers=8, thread_name_prefix="memmap-fsync"))
    return _pool[1]


def is_ragged(spec: FieldSpec) -> bool:
    return spec.kind in ("token", "text")


def empty_segment(segment_id: int, schema: StoreSchema) -> SegmentState:
    return SegmentState(segment_id, 0, {s.name: 0 for s in schema.fields if is_ragged(s)})


def segment_files(schema: StoreSchema, state: SegmentState) -> dict[str, tuple[np.dtype, int]]:
    """File name -> (dtype, published element count) for every file of a segment."""
    return _files_of(field_files(schema), state)


def check_spans(directory: Path, name: str, starts: np.ndarray, stops: np.ndarray, published: int,
                local: np.ndarray) -> None:
    """Raises StoreCorruptedError naming the segment and field when end offsets read from
    ``<name>.ends`` cannot be right: a span that runs backwards or past the published values."""
    bad = (starts > stops) | (stops > published) | (starts < 0)
    if bad.any():
        row = int(local[np.flatnonzero(bad)[0]])
        raise StoreCorruptedError(
            f"{directory / (name + '.ends')} is damaged: row {row} of segment {directory.name} spans "
            f"values [{int(starts[np.flatnonzero(bad)[0]])}, {int(stops[np.flatnonzero(bad)[0]])}) of the "
            f"{published} published in field {name!r}. The store's other segments still read; "
            f"`rlhf-pipeline inspect --verify` checks them all"
        )


def missing_segment_file(path: Path, filename: str | None) -> StoreCorruptedError:
    """The error for a file of a held segment that is not there (a deleted segment directory or file)."""
    missing = Path(filename) if filename else path
    segment = missing.parent if missing.parent != path else missing
    what = "its directory is missing" if not segment.exists() else f"{missing.name} is missing"
    return StoreCorruptedError(
        f"{path}: segment {segment.name} holds published rows but {what} (field "
        f"{missing.name.split('.')[0]!r}); it was deleted outside this library. The store's other segments "
        f"still read; `rlhf-pipeline repair {path}` reports what is lost"
    )


# ============================================================================ writing
class SegmentWriter:
    """The open tail segment of a writer: appends rows to its files with ``pwrite``.

    Opening truncates every file to its published size, which drops whatever an
    interrupted append left behind; the next append then starts on a clean end.
    """

    def __init__(self, directory: Path, schema: StoreSchema, state: SegmentState, *, durable: bool,
                 written: dict[str, tuple[int, int]] | None = None):
        self.directory = directory
        self.schema = schema
        self._durable = durable
        created = not directory.exists()
        directory.mkdir(exist_ok=True)
        self._fds: dict[str, int] = {}
        self._allocated: dict[str, int] = {}
        # file -> (bytes, CRC32C of them) written so far: each publish records them for the open
        # segment, so that `inspect --verify` catches bit rot before the segment is sealed
        self._written_crc: dict[str, tuple[int, int] | None] = {}
        try:
            for name, (dtype, count) in segment_files(schema, state).items():
                fd = os.open(directory / name, os.O_RDWR | os.O_CREAT, 0o644)
                self._fds[name] = fd
                size = count * dtype.itemsize
                on_disk = os.fstat(fd).st_size
                if on_disk < size:
                    raise StoreCorruptedError(
                        f"{directory / name} holds {on_disk} bytes but the manifest "
                        f"publishes {size}; the file was truncated outside this library"
                    )
                if on_disk > size:
                    # only when there is something to drop: ext4 marks a file truncated to 0
                    # bytes and, on close, allocates and starts writing back all its data
                    # (auto_da_alloc), which made sealing a new segment cost 0.3-7 ms per file
                    os.ftruncate(fd, size)
                self._allocated[name] = size
                # the CRCs the segment was published with (``written``), else those of the files
                recorded = (written or {}).get(name)
                self._written_crc[name] = recorded if recorded is not None and recorded[0] == size \
                    else (size, _fd_crc32c(fd, size))
        except BaseException:
            self.close()
            raise
        if created and durable:
            from rlhf_pipeline.files.atomic import fsync_dir

            fsync_dir(directory)
            fsync_dir(directory.parent)

    def append(self, batch: TrajectoryBatch, start: int, stop: int, state: SegmentState) -> SegmentState:
        """Writes rows ``[start, stop)`` of a validated batch after ``state``; returns the new state."""
        elements = dict(state.elements)
        rows = state.rows
        for spec in self.schema.fields:
            column = batch[spec.name]
            name = spec.name
            if spec.kind == "token":
                offsets = column.offsets
                first, last = int(offsets[start]), int(offsets[stop])
                values = column.values[first:last].numpy()
                ends = (offsets[start + 1 : stop + 1] - (first - elements[name])).numpy()
            elif spec.kind == "text":
                encoded = [s.encode("utf-8") for s in column[start:stop]]
                lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=stop - start)
                values = np.frombuffer(b"".join(encoded), dtype=np.uint8)
                ends = np.cumsum(lengths) + elements[name]
            else:
                col = column[start:stop].numpy()
                self._write(f"{name}.col", col, rows * col.itemsize)
                continue
            self._write(f"{name}.values", values, elements[name] * values.itemsize)
            self._write(f"{name}.ends", ends.astype(ENDS_DTYPE, copy=False), rows * ENDS_DTYPE.itemsize)
            elements[name] += len(values)
        return SegmentState(state.id, rows + stop - start, elements)

    def _write(self, name: str, array: np.ndarray, offset: int) -> None:
        array = np.ascontiguousarray(array)
        view = memoryview(array).cast("B")
        end = offset + len(view)
        fd = self._fds[name]
        if end > self._allocated[name]:
            # grow ahead (sparse) so readers map once per growth step, not per append
            grown = max(end, min(2 * self._allocated[name], end + _GROW_MAX_STEP), _GROW_MIN)
            os.ftruncate(fd, grown)
            self._allocated[name] = grown
        covered = self._written_crc.get(name)
        self._written_crc[name] = ((end, google_crc32c.extend(covered[1], array))  # the array as is: cheaper
                                     if covered is not None and covered[0] == offset else None)
        while len(view):
            written = os.pwrite(fd, view, offset)
            view, offset = view[written:], offset + written

    def written_sums(self) -> dict[str, tuple[int, int]]:
        """File -> (bytes, CRC32C) written so far (what the next publish records for the open segment)."""
        return {name: sums for name, sums in self._written_crc.items() if sums is not None}

    def written_checksums(self) -> list:
        """``[name, size, crc, name, size, ...]``: the CRC32C of the bytes written to each file so far
        (the published ones once the append that wrote them is published). Flat, as it is published
        with every append: a dict of lists costs several microseconds more to serialize."""
        return [x for name, sums in self._written_crc.items() if sums is not None for x in (name, *sums)]

    def sync(self, *extra: int) -> None:
        # One fdatasync per file, issued together: the disk merges them (measured 5-6 ms
        # for 18 files in parallel against 38-62 ms one after the other on this machine).
        list(_sync_pool().map(os.fdatasync, [*self._fds.values(), *extra]))

    def trim(self, state: SegmentState) -> None:
        """Cuts every file back to the size ``state`` publishes (drops the grown-ahead space)."""
        for name, (dtype, count) in segment_files(self.schema, state).items():
            os.ftruncate(self._fds[name], count * dtype.itemsize)
            self._allocated[name] = count * dtype.itemsize

    def seal(self, state: SegmentState) -> None:
        """Trims every file to its exact size, records the files' checksums and closes them:
        the segment is now immutable. The checksums file is synced with the data, then renamed
        into place, so a sealed segment either has checksums that match or none."""
        self.trim(state)
        sums = {}
        for name, fd in self._fds.items():
            size, written = self._allocated[name], self._written_crc.get(name)
            # the CRC of the bytes written, not of a re-read: a byte damaged on disk while the
            # segment was open then fails every reader's check instead of being sealed as right
            sums[name] = (size, written[1] if written is not None and written[0] == size else _fd_crc32c(fd, size))
        partial = checksums.write_checksums(self.directory, sums)
        if self._durable:
            fd = os.open(partial, os.O_RDONLY)
            try:
                self.sync(fd)
            finally:
                os.close(fd)
        checksums.publish_checksums(self.directory, durable=self._durable)
        self.close()

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)


# ============================================================================ copying
_MADV_POPULATE_READ = MADV_POPULATE_READ


def _prefault(mapping: mmap.mmap, published_bytes: int) -> None:
    """Maps the published pages of a new mapping in one call instead of one fault at a time.

    Sampling touches random rows, so without this nearly every sampled row's slices take
    page faults the first time a process reads them (measured ~0.6-0.9 ms per batch of 64
    GRPO rows on a shared VM, as much as the copy itself). One bulk prefault costs ~9 ms for
    a 77 MB store already in the page cache, and reads from disk what is not (bounded by the
    segment: ~20 MB at 4096 GRPO rows). The resident set then counts the mapped segments
    (file-backed pages the kernel can reclaim). Only the published bytes are prefaulted,
    never a tail's grown-ahead sparse space. Where the kernel lacks it, nothing happens.
    """
    if _MADV_POPULATE_READ is None or published_bytes <= 0:
        return
    try:
        mapping.madvise(_MADV_POPULATE_READ, 0, min(published_bytes, len(mapping)))
    except OSError:  # EINVAL on kernels before 5.14
        pass


def copy_segment(view: SegmentView, schema: StoreSchema, state: SegmentState, target: Path, *,
                 sealed: bool) -> None:
    """Writes the published part of a segment into a new directory, fsynced (for snapshots);
    a sealed segment gets its checksums, computed from the bytes copied."""
    target.mkdir()
    sums = {}
    for name, (dtype, count) in segment_files(schema, state).items():
        data = np.ascontiguousarray(view.array(name, dtype, count)[:count])
        fd = os.open(target / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            buffer = memoryview(data).cast("B")
            while len(buffer):
                buffer = buffer[os.write(fd, buffer):]
            os.fsync(fd)
        finally:
            os.close(fd)
        sums[name] = (data.nbytes, checksums.crc32c(data))
    if sealed:
        partial = checksums.write_checksums(target, sums)
        fd = os.open(partial, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        checksums.publish_checksums(target, durable=True)


def _fd_crc32c(fd: int, size: int) -> int:
    """CRC32C of the first ``size`` bytes of an open file, through a mapping (no copy)."""
    if size == 0:
        return checksums.crc32c(b"")
    mapping = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    try:
        _prefault(mapping, size)
        return checksums.crc32c(np.frombuffer(mapping, dtype=np.uint8))
    finally:
        try:
            mapping.close()
        except BufferError:  # the array view is still referenced: closed when it is collected
            pass
