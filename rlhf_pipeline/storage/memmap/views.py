"""Reading a memmap segment: read-only mappings of its files (:class:`SegmentView`), checked against the
CRCs recorded for them (:class:`RecordedChecksums`).

A reader is handed only what the published state covers, after it was checked: a sealed segment's files
against its ``checksums.json``, the open segment's against the CRC32C of their published bytes that each
publish records (:mod:`.checksums`). File formats are in :mod:`.segments`; the store builds one
:class:`SegmentView` per segment it reads. Design: docs/storage.md#checksums-and-checks."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import google_crc32c
import numpy as np

from rlhf_pipeline.storage.errors import StoreCorruptedError, StoreDamageWarning
from rlhf_pipeline.storage.memmap import checksums
from rlhf_pipeline.storage.memmap.layout import SegmentState
from rlhf_pipeline.storage.memmap.mapping import map_readonly


@dataclass(frozen=True)
class RecordedChecksums:
    """What a segment's files are checked against when read, as the published state says.

    A sealed segment: its ``checksums.json`` (``sealed_file_required``: the state says it was
    sealed with one, so a missing one is damage). The open segment: ``open_prefixes``, file ->
    (size, CRC32C) of the published bytes, recorded by the publish the reader sees (None when that
    publish recorded none: a version before them, or repair).
    """

    sealed: bool
    sealed_file_required: bool = False
    open_prefixes: dict[str, tuple[int, int]] | None = None

    @classmethod
    def of(cls, state: SegmentState | None, segment_rows: int, checksums_from: int | None,
           open_checksums: tuple[int, dict[str, tuple[int, int]]] | None) -> RecordedChecksums:
        """For a segment's published ``state`` (None: evicted meanwhile, nothing to check against)."""
        if state is None:
            return cls(sealed=False)
        if state.rows == segment_rows:
            return cls(sealed=True, sealed_file_required=checksums_from is not None and state.id >= checksums_from)
        return cls(sealed=False, open_prefixes=open_checksums[1] if open_checksums and open_checksums[0] == state.id
                   else None)


class SegmentView:
    """Read-only mappings of one segment's files, remapped when the published data outgrows them.

    A mapping outlives the deletion of its file (Linux keeps unlinked pages alive while
    mapped), so a reader keeps serving rows of a segment evicted after it was mapped.

    No byte is handed out before it was checked against the CRC32C the published state records,
    so bit rot shows up as a :class:`StoreCorruptedError` naming the file instead of wrong rows.
    A sealed segment's file is checked whole against its ``checksums.json`` the first time a
    store object maps it (~1 ms per 12 MB; the mapping is prefaulted anyway), and again when a
    segment it read while open gets sealed. The open segment's file is checked against the CRC
    of its published prefix when first mapped, then each publish that grows it is checked by
    extending the CRC over the bytes it added: a reader following a writer checks each byte once
    (at ~12 GB/s, what a learner's step pays is the bytes published since its last refresh).
    ``recorded()`` says what the current published state records (:class:`RecordedChecksums`).
    Segments sealed without checksums (by versions before them) and publishes without prefix
    CRCs are read unchecked.
    """

    def __init__(self, directory: Path, recorded: Callable[[], RecordedChecksums] | None = None, *,
                 verified: dict[tuple[str, str], tuple[int, int]] | None = None):
        self.directory = directory
        self._arrays: dict[str, np.ndarray] = {}
        self._recorded = recorded
        self._sums: dict[str, tuple[int, int]] | None = None  # checksums.json, once sealed
        self._checked: dict[str, int] = {}  # file -> published bytes checked (or without a record) so far
        self._mapped_sealed: set[str] = set()  # files mapped since the segment is sealed
        # (segment directory, file) -> (bytes, CRC32C) checked, shared by the store's views: a segment
        # unmapped by the store's cache of views and mapped again is not checked again
        self._verified = verified if verified is not None else {}
        self._directory_key = str(directory)

    def array(self, name: str, dtype: np.dtype, count: int) -> np.ndarray:
        """The file ``name`` as an array with at least ``count`` elements (only those are published)."""
        array = self._arrays.get(name)
        if array is not None and len(array) >= count and count * dtype.itemsize <= self._checked.get(name, -1):
            return array
        recorded = self._recorded() if self._recorded is not None else RecordedChecksums(sealed=False)
        if array is None or len(array) < count or (recorded.sealed and name not in self._mapped_sealed):
            # (re)mapped; a mapping made while the segment was open reaches past the end its sealing trimmed
            path = self.directory / name
            fd = os.open(path, os.O_RDONLY)  # FileNotFoundError: evicted or deleted; the store tells which
            try:
                array = self._arrays[name] = self._map(fd, path, dtype, count)
            finally:
                os.close(fd)
            if recorded.sealed:
                self._mapped_sealed.add(name)
        self._check(name, array, count * dtype.itemsize, recorded)
        return array

    def _check(self, name: str, array: np.ndarray, published: int, recorded: RecordedChecksums) -> None:
        """Checks file ``name``'s bytes in ``array`` against what the published state records."""
        key = (self._directory_key, name)
        done = self._verified.get(key)
        path = self.directory / name
        if recorded.sealed:
            if self._sums is None:
                self._sums = checksums.read_checksums(self.directory)
                if self._sums is None and recorded.sealed_file_required:
                    warnings.warn(checksums.missing_message(self.directory), StoreDamageWarning, stacklevel=4)
                self._sums = self._sums or {}
            expected = self._sums.get(name)
            if expected is not None and done != expected:
                checksums.check_bytes(path, array, expected)  # the whole file: its size is checked too
                self._verified[key] = expected
        else:
            record = (recorded.open_prefixes or {}).get(name)
            # only a record of exactly the published bytes: a writer's own reads between its write and
            # its publish see counts the last publish did not record (checked once published)
            if record is not None and record[0] == published and (done is None or done[0] != published):
                checked, crc = done if done is not None and done[0] < published else (0, 0)
                crc = google_crc32c.extend(crc, array.view(np.uint8)[checked:published])  # a 1-D mapping: no copy
                if crc != record[1]:
                    raise StoreCorruptedError(
                        f"{path} fails its crc32c checksum (recorded by the last publish of the open segment "
                        f"{self.directory.name}): bytes of its published rows were damaged on disk. Restore it "
                        f"from a snapshot; the store's other segments still read (`rlhf-pipeline inspect "
                        f"--verify` checks them all)")
                self._verified[key] = (published, crc)
        self._checked[name] = published

    @staticmethod
    def _map(fd: int, path: Path, dtype: np.dtype, count: int) -> np.ndarray:
        published = count * dtype.itemsize
        for _ in range(_MAP_ATTEMPTS):
            size = os.fstat(fd).st_size
            if size < published:
                raise StoreCorruptedError(
                    f"{path} holds {size} bytes but the manifest publishes {published}; "
                    f"the file was truncated outside this library"
                )
            usable = size - size % dtype.itemsize
            if usable == 0:
                return np.empty(0, dtype=dtype)
            try:
                # no descriptor is kept: the caller closes fd, the mapping lives on (see .mapping)
                return map_readonly(fd, usable, dtype, published)
            except ValueError:
                # the writer sealed the segment between fstat and mmap: it trimmed the
                # grown-ahead space (never below the published size); map the new size
                continue
        # a file that keeps shrinking under us is not one this library writes
        raise StoreCorruptedError(f"{path} changed size {_MAP_ATTEMPTS} times while being mapped")

    def close(self) -> None:
        # the mappings close when the last array viewing them is garbage-collected
        self._arrays.clear()


_MAP_ATTEMPTS = 8
