"""``export``: every stored field of a buffer's rows to JSONL, Parquet, a Hugging Face dataset or
chat trajectories.

One chunk in memory at a time; the output appears at OUT only when complete; the format follows
OUT's suffix unless given (a contradiction is refused, :func:`export_format`). Imports torch only
when rows are read. Design: docs/architecture.md#rows-in-and-out.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from rlhf_pipeline.dataio.extras import require

if TYPE_CHECKING:
    from rlhf_pipeline.schema import StoreSchema, TrajectoryBatch

EXPORT_FORMATS = ("jsonl", "parquet", "hf", "chat")
SUFFIX_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
_NO_SPACE = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
DEFAULT_CHUNK_ROWS = 4096


class ExportSpaceError(OSError):
    """The output's file system ran out of space (or the file hit a size limit) mid-export."""


def export_format(out: str | Path, given: str | None = None) -> str:
    """The format to write ``out`` in: ``given``, else what its suffix names; ``ValueError`` for an
    unknown format, a suffix that names none with no format given, or a contradiction."""
    if given is not None and given not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {given!r}; choose from {list(EXPORT_FORMATS)}")
    suffix = Path(out).suffix.lower()
    named = SUFFIX_FORMATS.get(suffix)
    if given is None:
        if named is None:
            raise ValueError(f"cannot tell the format from the name {out}; pass --format jsonl, parquet or hf "
                             f"(hf writes a directory), or name the file *.jsonl or *.parquet")
        return named
    if named is not None and named != given and not (given == "chat" and named == "jsonl"):
        raise ValueError(f"--format {given} contradicts the name {out} (a {suffix} file is {named}); "
                         f"rename OUT or drop --format")
    return given


@dataclass
class ExportResult:
    out: str
    rows: int
    fields: tuple[str, ...]
    trajectories: int | None = None  # chat: lines written (whole trajectories)
    trajectories_skipped: int = 0  # chat: trajectories not held whole (first turns evicted)


def iter_chunks(store, rows_per_chunk: int | None = None) -> Iterator[TrajectoryBatch]:
    """The rows held, in order, as batches of at most one segment (each shard's rows in turn)."""
    shards = getattr(store, "shards", None)
    if isinstance(shards, dict):  # a run's sharded buffer: each shard's segments in turn
        for index in sorted(shards):
            yield from iter_chunks(shards[index], rows_per_chunk)
        return
    import torch

    from rlhf_pipeline.storage.convert import segment_rows_of

    step = rows_per_chunk or segment_rows_of(store)
    start, stop = store.first_row, store.next_row
    while start < stop:
        end = min(stop, (start // step + 1) * step)  # aligned on segment boundaries
        yield store.read_global(torch.arange(start, end))
        start = end


def export_buffer(buffer: str | Path, out: str | Path, format: str | None = None, *,
                  progress: Callable[[int, int], None] | None = None,
                  rows_per_chunk: int | None = None) -> ExportResult:
    """Writes every held row of ``buffer`` (anything ``open_buffer`` opens) to ``out`` as ``format``
    (default: what ``out``'s suffix names, see :func:`export_format`).

    Opens the buffer read-only: exporting beside a running writer exports the rows published
    when the export started. ``progress(rows_done, rows_total)`` is called once the buffer is open
    (0 done) and after each chunk.
    """
    from rlhf_pipeline.storage import open_buffer

    format = export_format(out, format)
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} already exists; choose another path or remove it")
    partial = out.with_name(out.name + ".partial")
    _remove(partial)  # left by an interrupted export
    with open_buffer(str(buffer), mode="r") as store:
        schema = store.schema
        total = len(store)
        chunks = _counted(iter_chunks(store, rows_per_chunk), total, progress)
        writer = {"jsonl": _write_jsonl, "parquet": _write_parquet, "hf": _write_hf, "chat": _write_chat}[format]
        out.parent.mkdir(parents=True, exist_ok=True)  # as convert, filter and export-model make theirs
        try:
            rows = writer(chunks, schema, partial, meta={"buffer": str(buffer), "rows": total})
        except BaseException as exc:
            _remove(partial)
            if isinstance(exc, OSError) and exc.errno in _NO_SPACE:
                raise ExportSpaceError(exc.errno, f"cannot write {out}: {os.strerror(exc.errno)} (the partial "
                                                  f"output was removed); free space or export elsewhere") from None
            raise
    os.replace(partial, out)
    if format == "chat":
        rows, lines = rows
        return ExportResult(str(out), rows, schema.field_names, lines.written, lines.skipped)
    return ExportResult(str(out), rows, schema.field_names)


def _counted(chunks: Iterator[TrajectoryBatch], total: int,
             progress: Callable[[int, int], None] | None) -> Iterator[TrajectoryBatch]:
    done = 0
    if progress is not None:
        progress(done, total)  # the buffer is open: the count, and the clock of a rate, start here
    for chunk in chunks:
        yield chunk
        done += len(chunk)
        if progress is not None:
            progress(done, total)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


# ====================================================================== JSONL
def _write_jsonl(chunks, schema: StoreSchema, path: Path, meta: dict) -> int:
    rows = 0
    with open(path, "w", encoding="utf-8") as f:
        for batch in chunks:
            columns = {name: _python_column(batch[name]) for name in schema.field_names}
            for i in range(len(batch)):
                f.write(json.dumps({name: col[i] for name, col in columns.items()}, ensure_ascii=False))
                f.write("\n")
            rows += len(batch)
    return rows


def _write_chat(chunks, schema: StoreSchema, path: Path, meta: dict):
    """One line per whole trajectory (:mod:`.chat_trajectories`); returns (rows read, the line counts)."""
    from rlhf_pipeline.dataio.chat_trajectories import TrajectoryLines

    lines, rows = TrajectoryLines(), 0
    with open(path, "w", encoding="utf-8") as f:
        for batch in chunks:
            columns = {name: _python_column(batch[name]) for name in schema.field_names}
            records = ({name: col[i] for name, col in columns.items()} for i in range(len(batch)))
            for line in lines.add(records):
                f.write(json.dumps(line, ensure_ascii=False))
                f.write("\n")
            rows += len(batch)
        lines.finish()
    return rows, lines


def _python_column(column) -> list:
    """Plain Python values: lists per row for token fields, ints / floats / bools / strings."""
    import torch

    from rlhf_pipeline.schema.ragged import RaggedTensor

    if isinstance(column, RaggedTensor):
        values = column.values.tolist()
        offsets = column.offsets.tolist()
        return [values[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
    if isinstance(column, torch.Tensor):
        return column.tolist()
    return list(column)


# ====================================================================== Arrow (Parquet, hf)
def arrow_schema(schema: StoreSchema, meta: dict | None = None):
    """The Arrow schema of an export: one column per stored field, in the field table's order."""
    import torch

    pa = require("pyarrow", "exporting to Parquet or a Hugging Face dataset")
    types = {torch.int32: pa.int32(), torch.int64: pa.int64(), torch.float32: pa.float32(), torch.bool: pa.bool_()}
    fields = []
    for spec in schema.fields:
        if spec.kind == "token":
            kind = pa.list_(types[spec.dtype])
        elif spec.kind == "text":
            kind = pa.string()
        else:
            kind = types[spec.dtype]
        fields.append(pa.field(spec.name, kind, nullable=False))
    info = {"rlhf_pipeline": json.dumps({"schema": schema.to_json(), **(meta or {})})}
    return pa.schema(fields, metadata=info)


def to_arrow(batch: TrajectoryBatch, schema: StoreSchema, arrow_schema_):
    """A ``pyarrow.RecordBatch`` of ``batch``: token fields become list arrays over the flat values
    (no Python object per token), row fields numpy-backed arrays."""
    pa = require("pyarrow", "exporting to Parquet or a Hugging Face dataset")
    arrays = []
    for spec, field in zip(schema.fields, arrow_schema_):
        column = batch[spec.name]
        if spec.kind == "token":
            offsets = pa.array(column.offsets.numpy().astype(np.int32))
            arrays.append(pa.ListArray.from_arrays(offsets, pa.array(column.values.numpy(), type=field.type.value_type)))
        elif spec.kind == "text":
            arrays.append(pa.array(list(column), type=pa.string()))
        else:
            arrays.append(pa.array(column.numpy(), type=field.type))
    return pa.RecordBatch.from_arrays(arrays, schema=arrow_schema_)


def _write_parquet(chunks, schema: StoreSchema, path: Path, meta: dict) -> int:
    pq = require("pyarrow.parquet", "exporting to Parquet")
    target = arrow_schema(schema, meta)
    rows = 0
    with pq.ParquetWriter(path, target) as writer:
        for batch in chunks:
            writer.write_batch(to_arrow(batch, schema, target))
            rows += len(batch)
        if rows == 0:
            writer.write_table(target.empty_table())
    return rows


def _write_hf(chunks, schema: StoreSchema, path: Path, meta: dict) -> int:
    """Rows to an Arrow stream file, then ``datasets`` lays it out as a save_to_disk directory.

    ``Dataset.from_file`` memory-maps the stream and ``save_to_disk`` copies it in bounded
    batches, so no step holds the whole buffer; the intermediate file is deleted afterwards.
    """
    pa = require("pyarrow", "exporting to a Hugging Face dataset")
    datasets = require("datasets", "exporting to a Hugging Face dataset")
    target = arrow_schema(schema, meta)
    path.mkdir(parents=True)
    stream = path / "rows.arrow"
    rows = 0
    with pa.OSFile(str(stream), "wb") as sink, pa.ipc.new_stream(sink, target) as writer:
        for batch in chunks:
            writer.write_batch(to_arrow(batch, schema, target))
            rows += len(batch)
    dataset = datasets.Dataset.from_file(str(stream))
    enabled = datasets.utils.logging.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # the export shows its own progress
    try:
        dataset.save_to_disk(str(path / "dataset"))
    finally:
        if enabled:
            datasets.enable_progress_bars()
    del dataset
    stream.unlink()
    # the directory itself is the dataset: move its files up
    for child in (path / "dataset").iterdir():
        os.replace(child, path / child.name)
    (path / "dataset").rmdir()
    return rows

