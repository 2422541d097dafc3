"""Checked reads of a store's small JSON metadata files, and a watcher for new publishes.

:func:`read_json` (``NotAStoreError`` when the file is missing, ``StoreCorruptedError`` when damaged),
:func:`check_header` (backend and format version), :func:`schema_from_manifest`, and
:class:`ManifestWatcher`, which tells with one ``fstat`` whether a file replaced atomically (a local Zarr
store's root ``zarr.json``) was published anew. :func:`is_selection` lives here, with no torch behind it,
so that ``inspect`` of a directory that is no buffer answers at once.

Design: docs/storage.md#the-contract.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhf_pipeline.storage.errors import (  # noqa: F401 - IncompatibleStoreError re-exported
    IncompatibleStoreError,
    NotAStoreError,
    StoreCorruptedError,
)

if TYPE_CHECKING:
    from rlhf_pipeline.schema import StoreSchema

SELECTION_MANIFEST = "selection.json"
"""The file that makes a directory a saved selection (``storage/selection.py``); here, with no
torch behind it, so that ``inspect`` of a directory that is no buffer answers at once."""


def is_selection(location: str | os.PathLike) -> bool:
    """True when ``location`` holds a saved selection: a directory, or an ``s3://`` or ``az://`` URL
    (one HEAD; ``filter --selection`` keeps one there as a branch keeps its ``parent-rows/``); never raises."""
    if "://" in str(location):
        from rlhf_pipeline.files.object_run_store import ObjectRunStore
        from rlhf_pipeline.files.run_store import RunStoreError

        try:
            return ObjectRunStore(str(location).rstrip("/")).exists(SELECTION_MANIFEST)
        except (ValueError, RunStoreError, OSError):  # another scheme, no client, no answer: no selection
            return False
    try:
        return (Path(location) / SELECTION_MANIFEST).is_file()
    except (OSError, ValueError):
        return False


def selection_source(location: str | os.PathLike) -> str:
    """Where the saved selection at ``location`` reads its rows (its manifest's source), for messages:
    what a command that writes or repairs takes instead; never raises."""
    from rlhf_pipeline.files.run_store import RunStoreError

    try:
        if "://" in str(location):
            from rlhf_pipeline.files.object_run_store import ObjectRunStore

            raw = ObjectRunStore(str(location).rstrip("/")).read(SELECTION_MANIFEST)
        else:
            raw = (Path(location) / SELECTION_MANIFEST).read_bytes()
        return str(json.loads(raw)["source"]["location"])
    except (OSError, ValueError, KeyError, TypeError, RunStoreError):  # damaged or gone: said in general
        return "the store it names"


def _parse(raw: bytes, path: Path) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StoreCorruptedError(
            f"{path} is not valid JSON ({exc}); the file was damaged outside this library. "
            f"Restore it from a snapshot, or delete the store."
        ) from None
    if not isinstance(data, dict):
        raise StoreCorruptedError(f"{path} holds a JSON {type(data).__name__}, expected an object")
    return data


def read_json(path: str | os.PathLike, *, what: str = "store") -> dict[str, Any]:
    """Reads a metadata file; ``NotAStoreError`` when it is missing, ``StoreCorruptedError`` when damaged."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise NotAStoreError(
            f"{path.parent} is not a {what}: {path.name} is missing. Create one first, or check the path."
        ) from None
    return _parse(raw, path)


def check_header(data: dict[str, Any], path: str | os.PathLike, *, backend: str, format_version: int) -> None:
    """Checks the ``backend`` and ``format_version`` keys every manifest carries."""
    found_backend = data.get("backend")
    if found_backend != backend:
        raise IncompatibleStoreError(
            f"{path} belongs to a {found_backend!r} store, not {backend!r}; open it with "
            f"rlhf_pipeline.storage.open_store(), which picks the backend itself"
        )
    found_version = data.get("format_version")
    if found_version != format_version:
        raise IncompatibleStoreError(
            f"{path} has {backend} format version {found_version}; this rlhf_pipeline reads version "
            f"{format_version}. Use a matching release, or convert the store with `rlhf-pipeline convert`."
        )


def schema_from_manifest(data: dict[str, Any], path: str | os.PathLike) -> StoreSchema:
    """The ``StoreSchema`` recorded under ``data["schema"]``, with errors naming ``path``."""
    from rlhf_pipeline.schema import StoreSchema  # imports torch: the stores need it, inspect does not

    try:
        return StoreSchema.from_json(data["schema"])
    except KeyError:
        raise StoreCorruptedError(f"{path} has no 'schema' entry") from None
    except ValueError as exc:
        raise IncompatibleStoreError(f"{path}: {exc}") from None


class ManifestWatcher:
    """Reads a manifest and tells, with one ``fstat``, whether a newer one was published.

    A manifest is replaced atomically (``os.replace``), which leaves the inode read last with no links
    (``st_nlink == 0``); the watcher keeps that file open, so its inode number cannot be reused
    either, and the check has no false negatives, unlike comparing mtimes.
    """

    def __init__(self, path: str | os.PathLike, *, what: str = "store"):
        self.path = Path(path)
        self._what = what
        self._fd: int | None = None

    def changed(self) -> bool:
        """True when nothing was read yet or the file read last was replaced since."""
        if self._fd is None:
            return True
        return os.fstat(self._fd).st_nlink == 0

    def read(self) -> dict[str, Any]:
        """Reads the current manifest and remembers it for :meth:`changed`."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise NotAStoreError(
                f"{self.path.parent} is not a {self._what}: {self.path.name} is missing. "
                f"Create one first, or check the path."
            ) from None
        try:
            size = os.fstat(fd).st_size
            chunks, got = [], 0
            while got < size:  # a published manifest never changes, so its size is final
                chunk = os.read(fd, size - got)
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
            data = _parse(b"".join(chunks), self.path)
        except BaseException:
            os.close(fd)
            raise
        self.close()
        self._fd = fd
        return data

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
