"""CRC32C checksums of a memmap store's segment files (``seg-NNNNNNNN/checksums.json``); no torch.

Sealing records each file's size and CRC32C (``google-crc32c``). The open segment's CRCs are extended by
each append and recorded by each publish, and become its ``checksums.json`` when it is sealed (CRCs of
the bytes written, not of a re-read). Readers check a sealed segment's file when they first map it and the
open segment's published bytes as they read them; ``inspect --verify`` and ``repair`` check every segment.
Design: docs/storage.md#checksums-and-checks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import google_crc32c
import numpy as np

from rlhf_pipeline.files.atomic import PARTIAL_SUFFIX, fsync_dir
from rlhf_pipeline.storage.errors import StoreCorruptedError
from rlhf_pipeline.storage.memmap.layout import CHECKSUMS_NAME, segment_dir_name

ALGORITHM = "crc32c"


def byte_view(data) -> np.ndarray:
    """``data`` (bytes-like or a numpy array) as a flat uint8 array, without a copy where possible.

    google-crc32c takes only objects whose buffer needs no release (bytes, numpy arrays),
    not memoryviews or mmaps, so everything goes through a numpy view.
    """
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


def crc32c(data) -> int:
    """CRC32C of a bytes-like object or numpy array."""
    return google_crc32c.value(byte_view(data))


def write_checksums(directory: Path, files: dict[str, tuple[int, int]]) -> Path:
    """Writes ``checksums.json`` (file -> (size, crc)) as a ``.partial`` file and returns its path:
    the caller syncs it with the segment's files, then calls :func:`publish_checksums`."""
    payload = json.dumps({"algorithm": ALGORITHM, "files": {k: list(v) for k, v in sorted(files.items())}},
                         separators=(",", ":")).encode()
    partial = directory / (CHECKSUMS_NAME + PARTIAL_SUFFIX)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    return partial


def publish_checksums(directory: Path, *, durable: bool) -> None:
    """Renames the synced ``checksums.json.partial`` into place (and makes the rename durable)."""
    os.replace(directory / (CHECKSUMS_NAME + PARTIAL_SUFFIX), directory / CHECKSUMS_NAME)
    if durable:
        fsync_dir(directory)


def read_checksums(directory: Path) -> dict[str, tuple[int, int]] | None:
    """file -> (size, crc) of a sealed segment; None when none was recorded."""
    path = directory / CHECKSUMS_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(raw)
        if data.get("algorithm") != ALGORITHM:
            raise ValueError(f"algorithm {data.get('algorithm')!r}, expected {ALGORITHM!r}")
        return {name: (int(size), int(crc)) for name, (size, crc) in data["files"].items()}
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise StoreCorruptedError(f"{path} is damaged ({exc}); `rlhf-pipeline repair` records it again") from None


def first_of_unbroken_checksums(path: Path, held: dict, segment_rows: int) -> int:
    """The first segment id from which every held sealed segment (``held``: id -> ``SegmentState``)
    of the store at ``path`` has checksums; earlier ones may have been sealed before checksums existed."""
    for seg_id in sorted((i for i, s in held.items() if s.rows == segment_rows), reverse=True):
        if not (path / segment_dir_name(seg_id) / CHECKSUMS_NAME).exists():
            return seg_id + 1
    return min(held, default=0)


def missing_message(directory: Path) -> str:
    """What a sealed segment that was sealed with checksums and lost them is told with."""
    return (f"{directory / CHECKSUMS_NAME} is missing: segment {directory.name} was sealed with checksums "
            f"and was damaged outside this library; its files are read unchecked until `rlhf-pipeline repair "
            f"{directory.parent} --apply` records them again")


def check_bytes(path: Path, data, expected: tuple[int, int]) -> None:
    """Raises :class:`StoreCorruptedError` naming ``path`` unless ``data`` has the recorded size and CRC."""
    size, crc = expected
    data = byte_view(data)
    length = data.size
    if length != size:
        raise StoreCorruptedError(
            f"{path} holds {length} bytes but its segment was sealed with {size}: the file was truncated or "
            f"extended outside this library. Restore it from a snapshot, or see `rlhf-pipeline repair`."
        )
    if crc32c(data) != crc:
        raise StoreCorruptedError(
            f"{path} fails its crc32c checksum (recorded when its segment was sealed): its bytes were damaged "
            f"on disk. Restore it from a snapshot; the store's other segments still read."
        )
