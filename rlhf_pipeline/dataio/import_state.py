"""Where an import writes (a shard of its own, from ``files.shard_names.IMPORT_SHARD_FIRST``), and the record that
lets a killed import resume without duplicates.

The record, ``<store>/imports/import-<key>.pt`` (``<run>/imports/`` for a run), holds the source's
fingerprint, the options, the first fresh ids, the source rows written and, around each append,
the store's ``next_row``; every write of it is atomic. Design: docs/architecture.md#rows-in-and-out.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf_pipeline.dataio.sources import Source, SourceError
from rlhf_pipeline.files.run_paths import RunLocationError, check_run_url, is_url
from rlhf_pipeline.files.run_store import RunStore
from rlhf_pipeline.files.shard_names import IMPORT_SHARD_FIRST, shard_index, shard_key_of
from rlhf_pipeline.pipeline import RunPaths
from rlhf_pipeline.storage.buffers import list_shards
from rlhf_pipeline.storage.manifest import is_selection, selection_source

RECORD_FORMAT = 1


# ====================================================================== where rows go
@dataclass
class Target:
    """The store an import writes, and the run it belongs to (if any)."""

    store_path: Path | str  # a local path, or a URL (a store at a URL, a shard of a run at a URL)
    run: RunPaths | None
    shard_index: int | None  # the shard's index when the store is a run's buffer shard
    new_shard: bool  # a shard this import creates in the run's buffer

    @property
    def records(self) -> RunStore:
        """Where the import records are kept (under ``imports/``): the run's store, or the store's own."""
        return self.run.store if self.run is not None else RunPaths.at(self.store_path).store


def resolve_target(buffer: str | Path, run: RunPaths | Path | None) -> Target:
    """What ``BUFFER`` names: a store (new or existing), or a run (a new shard of its buffer); a
    directory or a URL alike, through the run's store."""
    if is_url(str(buffer)):
        try:
            location = check_run_url(str(buffer).rstrip("/"), "BUFFER")  # the conditional writes an import needs
        except RunLocationError as exc:
            raise SourceError(f"{exc}. An import writes a buffer at an s3:// or az:// URL only; for another place, "
                              f"import into a local path and copy it with `rlhf-pipeline convert`") from None
    else:
        location = str(Path(buffer).resolve())
    if run is None and is_selection(location):
        raise SourceError(f"{buffer} is a saved selection, rows of other stores read in place, which takes no rows of "
                          f"its own: import into its source ({selection_source(location)}) or into a new store")
    if run is None:
        return Target(location if is_url(location) else Path(location), None, None, False)
    run = run if isinstance(run, RunPaths) else RunPaths(run)
    if location in (run.location, run.buffer_location):
        if not run.single_store_buffer:
            return Target(run.buffer_location, run, None, True)  # the shard index is chosen with the record
        location, index = run.buffer_location, 0
    else:
        parent, _, name = location.rpartition("/")
        index = shard_index(name)
        if parent != run.buffer_location or index is None:
            raise SourceError(f"{buffer} lies inside run {run.location} but is not its buffer or one of its shards")
    if run.store.list(run.key(run.collector_history(index))):
        raise SourceError(
            f"{location} is written by collector {index} of run {run.location}; imported rows there would share its "
            f"ids. Import into {run.buffer_location} instead: the rows get a shard of their own")
    return Target(location if is_url(location) else Path(location), run, index, False)


# ====================================================================== the import record
class ImportRecord:
    """Where an import stands: source rows written, id bases, and the append in flight."""

    def __init__(self, store: RunStore, key: str, data: dict[str, Any]) -> None:
        self.store, self.key, self.data = store, key, data

    @property
    def path(self) -> str:
        """Where the record is, for messages: a path or a URL."""
        return self.store.describe(self.key)

    @classmethod
    def find(cls, target: Target, source: Source) -> ImportRecord | None:
        store, key = target.records, f"imports/import-{_key(target, source)}.pt"
        raw = store.read(key)
        if raw is None:
            return None
        return cls(store, key, torch.load(io.BytesIO(raw), weights_only=True))

    @classmethod
    def start(cls, target: Target, source: Source, data: dict[str, Any]) -> ImportRecord:
        record = cls(target.records, f"imports/import-{_key(target, source)}.pt",
                     {"format": RECORD_FORMAT, "committed_rows": 0, "inflight": None, "done": False,
                      "rows_written": 0, **data})
        record.save()
        return record

    def save(self) -> None:
        self.store.write(self.key, lambda f: torch.save(self.data, f))

    def delete(self) -> None:
        self.store.delete(self.key)

    def resume_row(self, store) -> int:
        """Source rows already in the store: the committed count, or the append in flight if it landed."""
        inflight = self.data["inflight"]
        if inflight is not None and store.next_row > inflight["store_next_row"]:
            # appends are atomic and this import is the store's only writer: the rows landed
            self.data["committed_rows"] = inflight["rows"]
            self.data["rows_written"] = inflight["rows_written"] + store.next_row - inflight["store_next_row"]
        self.data["inflight"] = None
        return int(self.data["committed_rows"])

    def before_append(self, rows_after: int, store_next_row: int, rows_written_before: int) -> None:
        """Records the append about to happen: source rows covered after it, the store's next_row now."""
        self.data["inflight"] = {"rows": rows_after, "store_next_row": store_next_row,
                                 "rows_written": rows_written_before}
        self.save()

    def after_append(self, rows: int, rows_written: int) -> None:
        self.data.update(committed_rows=rows, rows_written=rows_written, inflight=None)
        self.save()


def _key(target: Target, source: Source) -> str:
    files = [str(p.resolve()) for p in source.files]
    text = json.dumps({"store": str(target.store_path), "source": files, "split": source.split})
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def new_shard_index(run: RunPaths) -> int:
    existing = [index for index, _ in list_shards(run.buffer_location)]
    return max([IMPORT_SHARD_FIRST - 1, *existing]) + 1


def shard_of(path: Path | str) -> int:
    index = shard_index(shard_key_of(path))
    return 0 if index is None else index
