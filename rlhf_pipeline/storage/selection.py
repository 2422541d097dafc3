"""Saved selections: a filtered view of a buffer that is read in place, never copied.

Why one file: a selection's file format, its writer and the read-only store over it are one feature
whose parts check each other (the source's identity, the rows still present).

:func:`write_selection` (``filter ... --selection``) and :func:`write_range_selection` (a branch's
``parent-rows/``) save which rows of a source were kept, by row key; ``open_buffer`` opens one as a
read-only :class:`SelectionStore` whose positions ``[0, rows)`` are the kept rows in source order, read
through the source's own (fused) paths, failing with :class:`SelectionInvalidError` once the source no
longer holds exactly those rows. Design: docs/curation.md#a-selection-on-disk.
"""

from __future__ import annotations

import os
import shutil
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlhf_pipeline.files.atomic import PARTIAL_SUFFIX, fsync_dir, publish_json, write_atomic
from rlhf_pipeline.files.run_paths import resolved_location
from rlhf_pipeline.schema import StoreSchema, TrajectoryBatch
from rlhf_pipeline.storage.base import (
    NotAStoreError,
    ReadOnlyStoreError,
    StoreError,
    StoreStats,
    TrajectoryStore,
)
from rlhf_pipeline.storage.manifest import SELECTION_MANIFEST, is_selection, read_json  # noqa: F401 - is_selection re-exported
from rlhf_pipeline.storage.padded_rows import LocatedRows
from rlhf_pipeline.storage.row_keys import parts_of
from rlhf_pipeline.storage.row_ranges import (
    RANGES_KEY,
    ListedRows,
    RangeRows,
    probe_ids,
    probe_positions,
    ranges_crc32,
)
from rlhf_pipeline.storage.summary import summarize_trajectories

FORMAT = "rlhf_pipeline.selection"
FORMAT_VERSION = 1
MANIFEST_NAME = SELECTION_MANIFEST
ROWS_NAME = "rows.npy"
PARTS_NAME = "parts.npy"
PROBES_PER_PART = 4
_PROBE_FIELDS = ("trajectory_id", "reward", "response_tokens", "response_log_probs")


class SelectionInvalidError(StoreError):
    """A saved selection's source no longer holds the rows it names."""


# ====================================================================== writing
def write_selection(path: str | os.PathLike, source: TrajectoryStore, part_index: np.ndarray,
                    global_ids: np.ndarray, *, where: str = "", whole_groups: bool = False,
                    source_location: str | None = None) -> Path:
    """Saves the rows ``(part_index, global_ids)`` of ``source`` (row keys, see row_keys.py) as a
    selection at ``path``; the directory appears whole or not at all."""
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} exists; choose a new path for the selection")
    part_index = np.asarray(part_index, dtype=np.int64).reshape(-1)
    global_ids = np.asarray(global_ids, dtype=np.int64).reshape(-1)
    parts = parts_of(source)
    order = {p.index: i for i, p in enumerate(parts)}
    unknown = sorted(set(np.unique(part_index).tolist()) - set(order))
    if unknown:
        raise ValueError(f"part(s) {unknown} are not parts of {source.location}")
    # rows sorted by (part in position order, global id): each part's rows are one range
    rank = np.zeros(max(order) + 1, dtype=np.int64)
    for index, position in order.items():
        rank[index] = position
    sort = np.lexsort((global_ids, rank[part_index]))
    part_index, global_ids = part_index[sort], global_ids[sort]
    rows_bytes = _npy_bytes(global_ids)
    files = {ROWS_NAME: rows_bytes}
    if hasattr(source, "shard_ranges"):
        files[PARTS_NAME] = _npy_bytes(part_index)
    described = [(part, global_ids[part_index == part.index]) for part in parts]
    return _publish(path, source, [(part, int(mine.size), _probes(part.store, mine)) for part, mine in described],
                    files, {"rows": int(global_ids.size), "rows_crc32": zlib.crc32(rows_bytes)},
                    where=where, whole_groups=whole_groups, source_location=source_location)


def write_range_selection(path: str | os.PathLike, source: TrajectoryStore, ranges: dict[int, tuple[int, int]], *,
                          where: str = "", source_location: str | None = None) -> Path:
    """Saves, per part index of ``source``, the rows ``[first, end)`` of ``ranges`` as a selection
    in the range form (row_ranges.py): O(parts) bytes, however many rows it names."""
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} exists; choose a new path for the selection")
    parts = [part for part in parts_of(source) if part.index in ranges]
    unknown = sorted(set(ranges) - {part.index for part in parts})
    if unknown:
        raise ValueError(f"part(s) {unknown} are not parts of {source.location}")
    named = [[part.index, int(ranges[part.index][0]), max(int(ranges[part.index][0]), int(ranges[part.index][1]))]
             for part in parts]
    described = [(part, end - first, _probe_rows(part.store, probe_ids(first, end, PROBES_PER_PART)))
                 for part, (_, first, end) in zip(parts, named)]
    return _publish(path, source, described, {},
                    {"rows": sum(rows for _, rows, _ in described), "rows_crc32": ranges_crc32(named),
                     RANGES_KEY: named, "rows_file": None, "parts_file": None},
                    where=where, whole_groups=False, source_location=source_location)


def _publish(path: Path, source: TrajectoryStore, described: list, files: dict[str, bytes], rows: dict[str, Any], *,
             where: str, whole_groups: bool, source_location: str | None) -> Path:
    """Writes ``files`` and then the manifest into ``path.partial``, renamed to ``path`` when whole."""
    partial = path.with_name(path.name + PARTIAL_SUFFIX)
    if partial.exists():
        shutil.rmtree(partial)  # left by an interrupted write of this same selection
    partial.mkdir(parents=True)
    try:
        for name, data in files.items():
            write_atomic(partial / name, lambda f, data=data: f.write(data))
        location = source_location or source.location
        publish_json(partial / MANIFEST_NAME, {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "source": {"location": resolved_location(location), "relative": _relative(location, path),
                       "layout": "sharded" if hasattr(source, "shard_ranges") else "store"},
            "parts": [{
                "index": part.index,
                "location": resolved_location(part.store.location),
                "relative": _relative(part.store.location, path),
                "backend": part.store.backend_name,
                "first_row": part.first_row,
                "next_row": part.next_row,
                "rows": count,
                "probes": probes,
            } for part, count, probes in described],
            "schema": source.schema.to_json(),
            **rows,
            "where": where,
            "whole_groups": bool(whole_groups),
            "created": round(time.time(), 3),
        })
        os.replace(partial, path)
        fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return path


def _npy_bytes(array: np.ndarray) -> bytes:
    import io

    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def _relative(location: str, selection: Path) -> str | None:
    if "://" in location:
        return None
    try:
        return os.path.relpath(Path(location).resolve(), selection.resolve())
    except ValueError:  # another drive (Windows)
        return None


def _probes(store: TrajectoryStore, global_ids: np.ndarray) -> list[list[int]]:
    """``[global id, fingerprint]`` of a few kept rows: first, last and between."""
    return _probe_rows(store, global_ids[probe_positions(global_ids.size, PROBES_PER_PART)])


def _probe_rows(store: TrajectoryStore, picks: np.ndarray) -> list[list[int]]:
    if picks.size == 0:
        return []
    return [[int(g), f] for g, f in zip(picks.tolist(), _fingerprints(store, picks))]


def _fingerprints(store: TrajectoryStore, global_ids: np.ndarray) -> list[int]:
    """CRC32 of each row's ids, reward, response tokens and sampling log-probs: a different store
    (another run at the same path) differs in them even where row counts match."""
    rows = store.read_global(torch.from_numpy(np.asarray(global_ids, dtype=np.int64)), fields=_PROBE_FIELDS)
    out = []
    for i in range(len(rows)):
        crc = zlib.crc32(rows["trajectory_id"][i].numpy().tobytes())
        crc = zlib.crc32(rows["reward"][i].numpy().tobytes(), crc)
        crc = zlib.crc32(rows["response_tokens"].row(i).numpy().tobytes(), crc)
        out.append(zlib.crc32(rows["response_log_probs"].row(i).numpy().tobytes(), crc))
    return out


# ====================================================================== the view
class SelectionStore(TrajectoryStore):
    """A read-only view of the kept rows of a buffer (docs/curation.md#a-selection-on-disk)."""

    backend_name = "selection"
    supports_field_subset = True

    @classmethod
    def open(cls, location: str | os.PathLike, mode: str = "r", **open_options: Any) -> SelectionStore:
        """Opens the selection at ``location``; ``open_options`` go to the source stores' ``open``."""
        if mode != "r":
            raise ReadOnlyStoreError(f"{location} is a saved selection, which is read-only; filter again "
                                     f"to change it, or open its source to append")
        if "://" in str(location):  # kept at a URL: opened from this machine's copy (fetch_selection)
            local = fetch_selection(str(location), open_options.get("storage_options"))
            if local is None:
                raise NotAStoreError(f"{location} holds no saved selection ({MANIFEST_NAME} is missing)")
            opened = cls(local, open_options)
            opened._url = str(location).rstrip("/")
            return opened
        return cls(Path(location), open_options)

    def __init__(self, path: Path, open_options: dict[str, Any]) -> None:
        super().__init__()
        self._path = path
        self._url: str | None = None  # where it is kept, when at a URL (open)
        self._closed = False
        self._sources: dict[int, TrajectoryStore] = {}
        manifest = read_json(path / MANIFEST_NAME, what="saved selection")
        self._manifest = manifest
        try:
            self._load(manifest, open_options)
        except BaseException:
            self.close()
            raise

    def _load(self, manifest: dict[str, Any], open_options: dict[str, Any]) -> None:
        from rlhf_pipeline.storage.backends import open_store

        where = self._path / MANIFEST_NAME
        if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
            raise NotAStoreError(f"{where} is not a saved selection of format {FORMAT} v{FORMAT_VERSION}")
        try:
            self._schema = StoreSchema.from_json(manifest["schema"])
            # a detached branch's selection names its own copy (runs/detach.py): switched by the manifest alone
            # positions -> (part, global id): through the ranges themselves, or the rows files loaded whole
            self._rows: RangeRows | ListedRows = RangeRows.from_manifest(manifest, str(where)) \
                if RANGES_KEY in manifest else self._load_row_files(manifest, where)
            described = manifest["parts"]
        except (KeyError, TypeError, ValueError, OSError) as exc:
            if isinstance(exc, StoreError):
                raise
            raise SelectionInvalidError(f"{self._path} is a damaged selection ({exc!r}); filter again") from None
        named = sum(int(part["rows"]) for part in described)
        if named != self._rows.size:
            raise SelectionInvalidError(f"{self._path}: the parts name {named} rows, rows.npy holds {self._rows.size}")
        self._ranges: list[tuple[int, int, int]] = []  # (part index, first position, end position)
        start = 0
        for part in described:
            location = self._find(part)
            store = open_store(location, mode="r", **open_options)
            self._sources[int(part["index"])] = store
            self._check_part(store, part, start)
            self._ranges.append((int(part["index"]), start, start + int(part["rows"])))
            start += int(part["rows"])

    def _load_row_files(self, manifest: dict[str, Any], where: Path) -> ListedRows:
        rows_path = self._path / manifest.get("rows_file", ROWS_NAME)
        raw = rows_path.read_bytes()
        if zlib.crc32(raw) != int(manifest["rows_crc32"]):
            raise SelectionInvalidError(f"{rows_path} does not match its CRC in {where}: the file was "
                                        f"damaged; filter again to rebuild the selection")
        parts_path = self._path / (manifest.get("parts_file", PARTS_NAME) or "-")
        rows = np.load(rows_path, allow_pickle=False)
        if rows.shape != (int(manifest["rows"]),):
            raise SelectionInvalidError(f"{self._path}: rows.npy holds {rows.shape} ids, the manifest "
                                        f"says {manifest['rows']}")
        return ListedRows(rows, np.load(parts_path, allow_pickle=False) if parts_path.is_file() else None)

    def _find(self, part: dict[str, Any]) -> str:
        location = part["location"]
        if "://" in location or Path(location).exists() or part.get("relative") is None:
            return location
        moved = (self._path / part["relative"]).resolve()  # the selection moved along with its source
        return str(moved) if moved.exists() else location

    def _check_part(self, store: TrajectoryStore, part: dict[str, Any], start: int) -> None:
        """``part`` of the manifest, whose rows are the positions from ``start``, against ``store``."""
        name = f"selection {self._path}: source {store.location}"
        if store.backend_name != part["backend"]:
            raise SelectionInvalidError(f"{name} is a {store.backend_name} store, it was a {part['backend']} "
                                        f"store when the selection was made: a different buffer is at that path")
        if store.schema != self._schema:
            raise SelectionInvalidError(f"{name} stores fields {store.schema.field_names}, the selection was "
                                        f"made from one storing {self._schema.field_names}")
        if store.next_row < int(part["next_row"]):
            raise SelectionInvalidError(f"{name} has published {store.next_row} rows, it had {part['next_row']} "
                                        f"when the selection was made: it was truncated or replaced")
        oldest = int(self._rows.ids(np.array([start]))[0]) if int(part["rows"]) else None  # ids ascend in a part
        if oldest is not None and oldest < store.first_row:
            raise SelectionInvalidError(
                f"{name} now starts at global row {store.first_row}: kept rows from {oldest} were "
                f"evicted since the selection was made, so it can no longer be read. Filter again from a "
                f"buffer that holds them; a selection keeps none of its rows, so a source that drops old rows (its "
                f"capacity_rows, or its run's retention.*) drops them from it: copy the rows instead (`filter` without "
                f"--selection) to keep them")
        probes = part.get("probes") or []
        if probes:
            ids = np.array([p[0] for p in probes], dtype=np.int64)
            if _fingerprints(store, ids) != [int(p[1]) for p in probes]:
                raise SelectionInvalidError(f"{name} holds other rows than when the selection was made (row "
                                            f"fingerprints differ): a different buffer is at that path")

    # ================================================================ contract
    @property
    def schema(self) -> StoreSchema:
        return self._schema

    @property
    def sources(self) -> list[TrajectoryStore]:
        """The stores it reads its rows from, in part order (``inspect --verify`` checks them)."""
        return list(self._sources.values())

    @property
    def location(self) -> str:
        return self._url or str(self._path)

    @property
    def writable(self) -> bool:
        return False

    @property
    def first_row(self) -> int:
        return 0

    @property
    def next_row(self) -> int:
        return self._rows.size

    @property
    def source_location(self) -> str:
        """Where the selected rows live (the buffer the selection was made from)."""
        return self._manifest["source"]["location"]

    @property
    def where(self) -> str:
        return self._manifest.get("where", "")

    def refresh(self) -> int:
        if self._closed:
            raise StoreError(f"{self._path} was closed; open it again")
        return self._rows.size

    def append(self, batch: TrajectoryBatch) -> torch.Tensor:
        raise ReadOnlyStoreError(f"{self._path} is a saved selection, which is read-only; append to its "
                                 f"source {self.source_location}")

    def _append_validated(self, batch: TrajectoryBatch) -> None:  # pragma: no cover - append raises first
        raise ReadOnlyStoreError(f"{self._path} is a saved selection, which is read-only")

    def keys(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(part index, global row id in that part)`` of selection positions: the source's row keys."""
        positions = np.asarray(positions, dtype=np.int64)
        return self._rows.parts(positions), self._rows.ids(positions)

    def _split(self, positions: np.ndarray) -> list[tuple[TrajectoryStore, torch.Tensor, np.ndarray]]:
        """Per part holding some of ``positions``: (source store, global ids, where they were)."""
        ends = np.array([end for _, _, end in self._ranges], dtype=np.int64)
        slot = np.searchsorted(ends, positions, side="right")
        out = []
        for k in np.unique(slot).tolist():
            where = np.flatnonzero(slot == k)
            index = self._ranges[k][0]
            store = self._sources[index]
            ids = self._rows.ids(positions[where])
            if ids.size and int(ids.min()) < store.first_row:
                raise SelectionInvalidError(
                    f"selection {self._path}: rows from global row {int(ids.min())} of {store.location} were "
                    f"evicted (it now starts at {store.first_row}); the selection can no longer be read")
            out.append((store, torch.from_numpy(np.ascontiguousarray(ids)), where))
        return out

    def _read_global(self, global_ids: torch.Tensor, fields: Sequence[str] | None = None) -> TrajectoryBatch:
        positions = global_ids.numpy().astype(np.int64, copy=False)
        if positions.size == 0:
            return next(iter(self._sources.values())).read([], fields=fields)
        parts = [(self._read_part(store, ids, fields), where) for store, ids, where in self._split(positions)]
        if len(parts) == 1:
            return parts[0][0]
        inverse = np.empty(positions.size, dtype=np.int64)
        inverse[np.concatenate([where for _, where in parts])] = np.arange(positions.size)
        return TrajectoryBatch.cat([rows for rows, _ in parts]).select(torch.from_numpy(inverse))

    def _read_part(self, store: TrajectoryStore, ids: torch.Tensor, fields) -> TrajectoryBatch:
        try:
            return store.read_global(ids, fields=fields)
        except IndexError as exc:  # evicted under this reader
            raise SelectionInvalidError(f"selection {self._path}: {exc}; the selection can no longer be read") from None

    @property
    def supports_fused_padding(self) -> bool:
        return all(s.supports_fused_padding for s in self._sources.values())

    def _locate_rows(self, global_ids: torch.Tensor) -> LocatedRows:
        positions = global_ids.numpy().astype(np.int64, copy=False)
        parts = []
        for store, ids, where in self._split(positions):
            try:
                parts.append((where, store._locate_rows(ids)))
            except IndexError as exc:
                raise SelectionInvalidError(f"selection {self._path}: {exc}") from None
        if len(parts) == 1:
            return parts[0][1]
        return LocatedRows.merge(parts, positions.size, self._schema)

    def unit_bounds(self) -> list[tuple[int, int]]:
        """Position ranges of the selection whose rows lie in one storage unit of the source
        (a memmap segment, a Zarr unit): reading one range decodes one source unit."""
        bounds: list[tuple[int, int]] = []
        for index, start, end in self._ranges:
            if start == end:
                continue
            edges = [start, *self._rows.unit_cuts(start, end, _unit_starts(self._sources[index])), end]
            bounds += list(zip(edges[:-1], edges[1:]))
        return bounds

    def close(self) -> None:
        for store in self._sources.values():
            store.close()
        self._sources = {}
        self._closed = True

    # ================================================================ summary and copies
    def stats(self) -> StoreStats:
        """Rows, groups, tokens, rewards and versions of the kept rows (one pass over them)."""
        n = self._rows.size
        groups, versions = [], {}
        prompt_tokens = response_tokens = raw = 0
        rewards, trajectories = [], []
        per_row = {name: [] for name in ("termination_reason", "tool_calls", "tool_errors",
                                         "tool_error_kinds")}  # those the store holds
        for start in range(0, n, 4096):
            batch = self.read(torch.arange(start, min(n, start + 4096)))
            groups.append(np.unique(batch["group_id"].numpy()))
            trajectories.append(batch["trajectory_id"].numpy())
            for name, columns in per_row.items():
                if name in batch:
                    columns.append(batch[name].numpy())
            rewards.append(batch["reward"].numpy().astype(np.float64))
            prompt_tokens += int(batch["prompt_tokens"].values.numel())
            response_tokens += int(batch["response_tokens"].values.numel())
            raw += _payload_bytes(batch)
            for v, c in zip(*np.unique(batch["policy_version"].numpy(), return_counts=True)):
                versions[int(v)] = versions.get(int(v), 0) + int(c)
        files = [self._path / name for name in (MANIFEST_NAME, *_row_files(self._manifest))]
        out = StoreStats(
            backend=self.backend_name, location=self.location, rows=n, first_row=0, next_row=n,
            groups=int(np.unique(np.concatenate(groups)).size) if groups else 0,
            prompt_tokens=prompt_tokens, response_tokens=response_tokens,
            bytes_on_disk=sum(f.stat().st_size for f in files if f.exists()), raw_bytes=raw,
            segments=len(self.unit_bounds()), policy_versions=dict(sorted(versions.items())),
            optional_fields=list(self._schema.optional),
            trajectories=summarize_trajectories(
                np.concatenate(trajectories) if trajectories else np.zeros(0, dtype=np.int64),
                *(np.concatenate(columns) if columns else None for columns in per_row.values())),
            extra={"source": self.source_location, "where": self.where,
                   "whole_groups": bool(self._manifest.get("whole_groups")),
                   "source_rows_when_selected": sum(int(p["next_row"]) - int(p["first_row"])
                                                    for p in self._manifest["parts"]),
                   "bytes_on_disk_is": "the selection's own files; the rows stay in the source"},
        )
        if rewards:
            values = np.concatenate(rewards)
            if values.size:
                out.reward_mean, out.reward_std = float(values.mean()), float(values.std())
                out.reward_min, out.reward_max = float(values.min()), float(values.max())
        return out

    def snapshot_to(self, path: str) -> None:
        """Copies the selection (its files, not the rows it names) to ``path``."""
        target = Path(path)
        if target.exists() and (not target.is_dir() or any(target.iterdir())):
            raise FileExistsError(f"snapshot target {target} exists and is not an empty directory")
        target.mkdir(parents=True, exist_ok=True)
        for name in _row_files(self._manifest):
            if (self._path / name).exists():
                data = (self._path / name).read_bytes()
                write_atomic(target / name, lambda f, data=data: f.write(data))
        manifest = dict(self._manifest)
        manifest["source"] = dict(manifest["source"], relative=_relative(manifest["source"]["location"], target))
        manifest["parts"] = [dict(p, relative=_relative(p["location"], target)) for p in manifest["parts"]]
        publish_json(target / MANIFEST_NAME, manifest)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "rows_crc32": _identity(self._manifest)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Checks that this is the selection a saved state read (same rows, same order)."""
        if int(state_dict.get("next_row", -1)) != self.next_row or \
                int(state_dict.get("rows_crc32", -1)) != _identity(self._manifest):
            raise SelectionInvalidError(
                f"{self._path} holds {self.next_row} rows, not the {state_dict.get('next_row')} rows of the "
                f"selection the saved state read: the selection was replaced since that checkpoint")

    def __repr__(self) -> str:
        return f"SelectionStore({self.location!r}, rows={self.next_row}, source={self.source_location!r})"


# ====================================================================== kept in a run store
# A branch keeps its parent-rows/ selection in its run store: a directory, or an s3:// or az:// URL,
# where it is the same three small objects (publish_selection, the manifest last, so a selection is
# there whole or not at all). One at a URL opens from this machine's copy (fetch_selection), fetched
# again at each opening: a few bytes per row; the rows it names are read in place from their stores.
def publish_selection(directory: Path, store: Any, key: str) -> None:
    """Puts the selection written at ``directory`` into the run store ``store`` (a
    :class:`~rlhf_pipeline.files.run_store.RunStore`) under ``key`` (empty: at its root): its ids files,
    then its manifest."""
    for name in (ROWS_NAME, PARTS_NAME, MANIFEST_NAME):
        if (directory / name).is_file():
            store.write(f"{key}/{name}" if key else name, (directory / name).read_bytes(), fence=False)


def save_selection_at_url(url: str, write: Callable[[Path], Any]) -> None:
    """Keeps at ``url`` the selection that ``write(directory)`` saves in a scratch directory on this
    machine (:func:`publish_selection`: whole or not at all); FileExistsError where ``url`` holds one."""
    import tempfile

    from rlhf_pipeline.files.object_run_store import ObjectRunStore

    store = ObjectRunStore(url.rstrip("/"))
    if store.read(MANIFEST_NAME) is not None:
        raise FileExistsError(f"{url} holds a saved selection; choose a new URL for the selection")
    with tempfile.TemporaryDirectory(prefix="rlhf-selection-") as scratch:
        local = Path(scratch) / "selection"
        write(local)
        publish_selection(local, store, "")


def fetch_selection(url: str, storage_options: dict[str, Any] | None = None) -> Path | None:
    """This machine's copy of the selection kept at ``url``; None when ``url`` holds no selection."""
    from rlhf_pipeline.files.object_run_store import ObjectRunStore
    from rlhf_pipeline.files.run_paths import cache_dir

    store = ObjectRunStore(url.rstrip("/"), storage_options=storage_options)
    manifest = store.read(MANIFEST_NAME)
    if manifest is None:
        return None
    local = cache_dir(url.rstrip("/"))
    local.mkdir(parents=True, exist_ok=True)
    write_atomic(local / MANIFEST_NAME, lambda f: f.write(manifest), durable=False)
    named = read_json(local / MANIFEST_NAME, what="saved selection")
    for name in {named.get("rows_file", ROWS_NAME), named.get("parts_file", PARTS_NAME)} - {None}:
        data = store.read(name)
        if data is None:  # a selection of one store has no parts.npy
            (local / name).unlink(missing_ok=True)
        else:
            write_atomic(local / name, lambda f, data=data: f.write(data), durable=False)
    return local


def _row_files(manifest: dict[str, Any]) -> list[str]:
    """The selection's own rows files: ``rows.npy`` and ``parts.npy``, or those its manifest names."""
    return [name for name in (manifest.get("rows_file", ROWS_NAME), manifest.get("parts_file", PARTS_NAME)) if name]


def _identity(manifest: dict[str, Any]) -> int:
    """What a saved state checks (the same rows, in the same order): the CRC of the rows first
    selected, kept when a detached branch's selection names the same rows in its own copy."""
    return int(manifest.get("rows_identity_crc32", manifest["rows_crc32"]))


def _unit_starts(store: TrajectoryStore) -> np.ndarray:
    """Global ids where the storage units of ``store`` start (ascending)."""
    unit_bounds = getattr(store, "unit_bounds", None)
    if unit_bounds is not None:
        return np.array([start for start, _ in unit_bounds()], dtype=np.int64) + store.first_row
    segment_rows = getattr(store, "segment_rows", None)
    if segment_rows:
        first = store.first_row - store.first_row % segment_rows
        return np.arange(first, max(store.next_row, first + 1), segment_rows, dtype=np.int64)
    return np.array([store.first_row], dtype=np.int64)


def _payload_bytes(batch: TrajectoryBatch) -> int:
    total = 0
    for name in batch.field_names:
        column = batch[name]
        if isinstance(column, list):
            total += sum(len(text.encode("utf-8")) for text in column)
        elif isinstance(column, torch.Tensor):
            total += column.numel() * column.element_size()
        else:
            total += column.values.numel() * column.values.element_size()
    return total
