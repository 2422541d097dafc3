"""Reading import sources in bounded chunks: JSONL, Parquet, and Hugging Face datasets on disk.

:func:`open_source` finds the format (a ``chat`` JSONL line reads as its turns' rows; a dataset is a
``save_to_disk`` directory or a directory of data files, ``split`` picking one) and returns a
:class:`Source` whose :meth:`Source.chunks` yields :class:`SourceChunk` objects of at most ``rows``
rows; Arrow list columns come as flat values plus offsets. Columns may be dotted paths. Every
error is a :class:`SourceError` naming the file and the line or row. Design: docs/datasets.md#import.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rlhf_pipeline.dataio.extras import require

FORMATS = ("jsonl", "parquet", "hf")
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
MISSING = object()  # a column absent from a row (distinct from JSON null)
# A JSONL line becomes Python objects (~10x its size) and then tokens: one bound keeps an import's
# memory in proportion to its chunk. 16 MiB holds a 128k-token row with per-token log-prob objects.
MAX_JSONL_LINE_CHARS = 16 * 2**20


class SourceError(ValueError):
    """Bad import input; the message names the file, the row or line, the column and the fix."""


# ====================================================================== one chunk
@dataclass
class SourceChunk:
    """Up to ``rows`` consecutive rows of one file: Python dicts (JSONL) or an Arrow table."""

    file: Path
    records: list[dict] | None  # JSONL
    table: Any  # pyarrow.Table / RecordBatch (Parquet, hf)
    first_row: int  # index of the chunk's first row within its file (0-based)
    ordinal: int  # index of the chunk's first row within the whole source
    lines: list[int] | None = None  # JSONL: 1-based line number of each row

    def __len__(self) -> int:
        return len(self.records) if self.records is not None else self.table.num_rows

    def where(self, i: int) -> str:
        """``data.jsonl line 18`` / ``data.parquet row 17``: how an error names row ``i``."""
        if self.lines is not None:
            return f"{self.file} line {self.lines[i]}"
        return f"{self.file} row {self.first_row + i}"

    def values(self, column: str) -> list[Any]:
        """Column ``column`` (or a dotted path into nested values), one Python value per row."""
        if self.records is not None:
            return [lookup(r, column) for r in self.records]
        names = self.table.schema.names
        if column in names:
            return self.table.column(column).to_pylist()
        top, _, rest = column.partition(".")
        if rest and top in names:
            return [lookup(v, rest) if v is not None else MISSING for v in self.table.column(top).to_pylist()]
        return [MISSING] * len(self)

    def list_column(self, column: str) -> tuple[np.ndarray, np.ndarray] | None:
        """``(offsets (N+1,) int64, flat values)`` of an Arrow list-of-numbers column without nulls.

        None when the chunk is not Arrow-backed, the column is nested (a dotted path) or not a
        flat list of numbers, or holds nulls: callers then go through :meth:`values`.
        """
        if self.table is None or column not in self.table.schema.names:
            return None
        pa = require("pyarrow", "reading Arrow data")
        array = self.table.column(column)
        if isinstance(array, pa.ChunkedArray):
            array = array.combine_chunks()
        kind = array.type
        if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
            return None
        if not (pa.types.is_integer(kind.value_type) or pa.types.is_floating(kind.value_type)):
            return None
        if array.null_count or array.flatten().null_count:
            return None
        offsets = np.asarray(array.offsets, dtype=np.int64)
        values = array.flatten().to_numpy(zero_copy_only=False)
        return offsets - offsets[0], values


def lookup(record: Any, path: str) -> Any:
    """``record[path]``, or a walk down a dotted path (``a.0.b``) through dicts and lists."""
    if isinstance(record, dict) and path in record:
        return record[path]
    current = record
    for part in path.split("."):
        if isinstance(current, dict) and part in current:
            current = current[part]
        elif isinstance(current, list) and part.lstrip("-").isdigit() and -len(current) <= int(part) < len(current):
            current = current[int(part)]
        else:
            return MISSING
    return current


# ====================================================================== the source
@dataclass
class Source:
    """A located, typed import source; :meth:`chunks` streams it."""

    path: Path
    format: str  # jsonl | parquet | hf
    files: list[Path]  # data files in reading order (the save_to_disk directory itself for hf)
    split: str | None = None

    @property
    def is_saved_dataset(self) -> bool:
        return self.format == "hf" and len(self.files) == 1 and self.files[0].is_dir()

    # ------------------------------------------------------------------ what it holds
    def first_record(self) -> tuple[dict, str]:
        """The first row as a Python dict (for column detection) and where it is; SourceError when empty."""
        for chunk in self.chunks(1):
            if chunk.records is not None:
                return chunk.records[0], chunk.where(0)
            return chunk.table.slice(0, 1).to_pylist()[0], chunk.where(0)
        raise SourceError(f"{self.path} holds no rows")

    def holds_chat_trajectories(self) -> bool:
        """Whether the source is lines of ``export --format chat`` (its first JSON line is one)."""
        from rlhf_pipeline.dataio.chat_trajectories import is_chat_line

        if self.format != "jsonl":
            return False
        try:
            with open(self.files[0], encoding="utf-8") as f:
                first = next((line for line in f if line.strip()), "")
            record = json.loads(first)
            return isinstance(record, dict) and is_chat_line(record)
        except (OSError, UnicodeDecodeError, ValueError):  # chunks() says what is wrong with the file
            return False

    def count_rows(self) -> int | None:
        """Rows in the source when its metadata says so (Parquet, hf); None for JSONL."""
        if self.is_saved_dataset:
            return len(self._load_dataset())
        if all(f.suffix.lower() == ".parquet" for f in self.files):
            pq = require("pyarrow.parquet", "reading Parquet")
            return sum(self._parquet_file(f, pq).metadata.num_rows for f in self.files)
        return None

    def fingerprint(self) -> list[list]:
        """``[path, size, mtime_ns]`` of every file read: an interrupted import resumes only on the same data."""
        files = self.files
        if self.is_saved_dataset:
            files = sorted(p for p in self.files[0].rglob("*") if p.is_file())
        return [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]

    # ------------------------------------------------------------------ reading
    def chunks(self, rows: int) -> Iterator[SourceChunk]:
        """Consecutive chunks of at most ``rows`` rows over all files, in order."""
        ordinal = 0
        if self.is_saved_dataset:
            dataset = self._load_dataset()
            start = 0
            for table in dataset.with_format("arrow").iter(batch_size=rows):
                yield SourceChunk(self.files[0], None, table, start, ordinal)
                start += table.num_rows
                ordinal += table.num_rows
            return
        for file in self.files:
            suffix = file.suffix.lower()
            is_parquet = self.format == "parquet" or (self.format == "hf" and suffix == ".parquet")
            reader = self._parquet_chunks(file, rows) if is_parquet else self._jsonl_chunks(file, rows)
            for chunk in reader:
                chunk.ordinal = ordinal
                ordinal += len(chunk)
                yield chunk

    def _jsonl_chunks(self, file: Path, rows: int) -> Iterator[SourceChunk]:
        records: list[dict] = []
        lines: list[int] = []
        first = 0
        try:
            with open(file, encoding="utf-8") as f:
                for lineno, line in enumerate(iter(lambda: f.readline(MAX_JSONL_LINE_CHARS + 1), ""), start=1):
                    if len(line) > MAX_JSONL_LINE_CHARS:
                        raise SourceError(
                            f"{file} line {lineno}: longer than {MAX_JSONL_LINE_CHARS // 2**20} Mi characters, the "
                            f"limit of a JSONL row (its JSON objects take ~10x that in memory); split the row or drop it")
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise SourceError(
                            f"{file} line {lineno}: not valid JSON ({exc.msg} at column {exc.colno}); a JSONL "
                            f"source holds one JSON object per line (pass --format if it is another format)"
                        ) from None
                    if not isinstance(record, dict):
                        raise SourceError(f"{file} line {lineno}: expected a JSON object (one record per line), "
                                          f"got {type(record).__name__}")
                    expanded = _chat_trajectory_rows(record, file, lineno)
                    records += expanded
                    lines += [lineno] * len(expanded)
                    if len(records) >= rows:
                        yield SourceChunk(file, records, None, first, 0, lines)
                        first += len(records)
                        records, lines = [], []
        except UnicodeDecodeError as exc:
            raise SourceError(f"{file} is not UTF-8 text ({exc.reason} at byte {exc.start}), so not JSONL; "
                              f"pass --format parquet or hf if it is one of those") from None
        if records:
            yield SourceChunk(file, records, None, first, 0, lines)

    def _parquet_file(self, file: Path, pq):
        pa = require("pyarrow", "reading Parquet")
        try:
            return pq.ParquetFile(file)
        except (pa.ArrowInvalid, OSError) as exc:
            raise SourceError(f"{file} is not a Parquet file ({exc}); pass --format jsonl or hf if it is "
                              f"one of those") from None

    def _parquet_chunks(self, file: Path, rows: int) -> Iterator[SourceChunk]:
        pq = require("pyarrow.parquet", "reading Parquet")
        parquet = self._parquet_file(file, pq)
        first = 0
        for batch in parquet.iter_batches(batch_size=rows):
            yield SourceChunk(file, None, batch, first, 0)
            first += batch.num_rows

    def _load_dataset(self):
        datasets = require("datasets", "reading a Hugging Face dataset")
        try:
            loaded = datasets.load_from_disk(str(self.files[0]))
        except (FileNotFoundError, ValueError, OSError) as exc:
            raise SourceError(f"{self.files[0]} is not a dataset saved with save_to_disk ({exc})") from None
        if isinstance(loaded, datasets.DatasetDict):
            splits = sorted(loaded)
            split = self.split or ("train" if "train" in loaded else splits[0] if len(splits) == 1 else None)
            if split not in loaded:
                raise SourceError(f"{self.files[0]} holds the splits {splits}; choose one with --split NAME")
            return loaded[split]
        return loaded


def _chat_trajectory_rows(record: dict, file: Path, lineno: int) -> list[dict]:
    """A line of ``export --format chat`` (one whole trajectory) as the rows it came from, named as
    stored fields, so the rest of ``import`` reads it like exported rows; any other record as is."""
    from rlhf_pipeline.dataio.chat_trajectories import ChatFormatError, is_chat_line, trajectory_rows

    if not is_chat_line(record):
        return [record]
    try:
        return trajectory_rows(record)
    except ChatFormatError as exc:
        raise SourceError(f"{file} line {lineno}: a chat trajectory line: {exc}") from None


# ====================================================================== opening
def open_source(path: str | Path, format: str | None = None, split: str | None = None) -> Source:
    """Finds what ``path`` is (or checks it against ``format``) and returns the :class:`Source`."""
    path = Path(path)
    if format is not None and format not in FORMATS:
        raise SourceError(f"unknown format {format!r}; choose from {list(FORMATS)}")
    if not path.exists():
        raise SourceError(f"source {str(path)!r} does not exist")
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            if format not in (None, "hf"):
                raise SourceError(f"{path} is a Hugging Face dataset saved with save_to_disk, not {format}; "
                                  f"pass --format hf")
            return Source(path, "hf", [path], split)
        files = _data_files(path, split)
        kinds = {"parquet" if f.suffix.lower() == ".parquet" else "jsonl" for f in files}
        if format in ("jsonl", "parquet") and kinds != {format}:
            raise SourceError(f"{path} holds {sorted(kinds)} data files, not {format} only; pass --format hf "
                              f"to read them all")
        return Source(path, format or "hf", files, split)
    if split is not None:
        raise SourceError(f"--split picks a split of a directory (a dataset saved with save_to_disk, or data files "
                          f"named by split); {path} is one file: drop --split")
    if format is None:
        suffix = path.suffix.lower()
        if suffix == ".parquet":
            format = "parquet"
        elif suffix in JSONL_SUFFIXES:
            format = "jsonl"
        else:
            raise SourceError(f"cannot tell the format of {path} from its name; pass --format jsonl|parquet|hf")
    if format == "hf":
        raise SourceError(f"{path} is a file; --format hf reads a save_to_disk directory or a directory of "
                          f"data files (pass --format jsonl or parquet for one file)")
    return Source(path, format, [path], split)


def _data_files(directory: Path, split: str | None) -> list[Path]:
    files = sorted(p for p in directory.rglob("*") if p.is_file() and not _hidden(p, directory)
                   and p.suffix.lower() in (".parquet", *JSONL_SUFFIXES))
    if split is not None:
        files = [p for p in files if split in re.split(r"[/\\._-]", str(p.relative_to(directory)))]
    if not files:
        which = f" of split {split!r}" if split else ""
        raise SourceError(f"{directory} holds no data files{which} (*.parquet, *.jsonl) and is not a dataset "
                          f"saved with save_to_disk")
    return files


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)
