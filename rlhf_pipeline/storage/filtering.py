"""Curation: keep the rows, or whole groups, of a buffer that satisfy a ``--where`` condition.

``rlhf-pipeline filter`` and :func:`filter_buffer` read ``SRC`` (anything ``open_buffer`` opens) read-only,
in bounded memory: a first pass for the group and trajectory statistics the expression uses, a row pass
evaluating it unit by unit (a multi-turn trajectory is kept or dropped whole), then either a copy of the
kept rows into a new buffer that appears whole or not at all (:mod:`.new_buffer`), or a saved
selection naming them (:mod:`.selection`). The expression language is :mod:`.where`.

Design: docs/curation.md#filter.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlhf_pipeline.storage.base import StoreStats, TrajectoryStore
from rlhf_pipeline.storage.errors import LocalOnlyStoreError
from rlhf_pipeline.storage.filter_tables import GroupTable, TrajectoryTable
from rlhf_pipeline.storage.new_buffer import check_zip_destination, new_store
from rlhf_pipeline.storage.row_keys import Part, keys_of, parts_of, read_by_position
from rlhf_pipeline.storage.where import (
    GROUP_NAMES,
    TRAJECTORY_FIELDS,
    WhereExpression,
    parse_where,
)

DEFAULT_CHUNK_ROWS = 4096
Progress = Callable[[str, int, int], None]  # (stage, rows done, rows total)


# ====================================================================== chunks
def chunk_bounds(store: TrajectoryStore, num_rows: int, chunk_rows: int = DEFAULT_CHUNK_ROWS) -> list[tuple[int, int]]:
    """Position ranges covering ``[0, num_rows)``, cut at the store's storage units (so a chunk
    decodes whole units once) and merged up to about ``chunk_rows`` rows."""
    unit_bounds = getattr(store, "unit_bounds", None)
    if unit_bounds is not None:
        cuts = sorted({end for _, end in unit_bounds() if 0 < end < num_rows})
    elif getattr(store, "segment_rows", None):
        segment = int(store.segment_rows)
        first = store.first_row
        cuts = list(range(segment - first % segment, num_rows, segment))
    else:
        cuts = list(range(chunk_rows, num_rows, chunk_rows))
    bounds, start = [], 0
    for cut in [*cuts, num_rows]:
        if cut - start >= chunk_rows or cut == num_rows:
            if cut > start:
                bounds.append((start, cut))
            start = cut
    return bounds


def _read_columns(parts: list[Part], start: int, stop: int, fields: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The named fields of rows ``[start, stop)`` as NumPy arrays (token fields as their offsets)."""
    columns: dict[str, np.ndarray] = {"position": np.arange(start, stop, dtype=np.int64)}
    if fields:
        batch = read_by_position(parts, columns["position"], fields)
        for name in fields:
            column = batch[name]
            columns[name] = column.numpy() if isinstance(column, torch.Tensor) else column.offsets.numpy()
    return columns


def _statistics_pass(parts: list[Part], bounds: list[tuple[int, int]], num_rows: int, fields: tuple[str, ...],
                     of_chunk: Callable[[dict[str, np.ndarray]], Any], stage: str, progress: Progress | None) -> list:
    """One pass over ``fields``, a unit at a time: each chunk's partial table (``of_chunk``)."""
    partials, done = [], 0
    for start, stop in bounds:
        partials.append(of_chunk(_read_columns(parts, start, stop, fields)))
        done += stop - start
        if progress is not None:
            progress(stage, done, num_rows)
    return partials


# ====================================================================== selecting
@dataclass
class Selected:
    """What a filter keeps: positions in the source (ascending) and the counts it reports."""

    positions: np.ndarray
    rows_in: int
    groups_in: int
    groups_kept: int
    # rows that met the condition but went with a turn of their trajectory that did not
    rows_dropped_with_trajectories: int = 0


def select_positions(store: TrajectoryStore, where: str | WhereExpression, *, whole_groups: bool = False,
                     chunk_rows: int = DEFAULT_CHUNK_ROWS, progress: Progress | None = None,
                     parts: list[Part] | None = None) -> Selected:
    """Positions of ``store``'s rows that ``where`` keeps (the passes: docs/curation.md#filter).

    Reads the rows held at the store's last refresh, by global id (``parts``, a snapshot of
    :func:`~rlhf_pipeline.storage.row_keys.parts_of` taken before, names them), so a writer
    evicting or a shard growing meanwhile never changes which rows the positions mean.
    """
    expression = where if isinstance(where, WhereExpression) else \
        parse_where(where, stored_fields=store.schema.field_names)
    parts = parts_of(store) if parts is None else parts
    num_rows = sum(p.length for p in parts)
    bounds = chunk_bounds(store, num_rows, chunk_rows)
    table = None
    if expression.uses_groups:
        table = GroupTable.combine(_statistics_pass(
            parts, bounds, num_rows, ("group_id", "reward"),
            lambda c: GroupTable.of_chunk(c["group_id"], c["reward"]), "group statistics", progress))
    trajectories = None
    if expression.uses_trajectories:
        # the fields the statistics it names need (parse_where checked the store holds them)
        extra = tuple(sorted({TRAJECTORY_FIELDS[n] for n in expression.names if n in TRAJECTORY_FIELDS}))
        trajectories = TrajectoryTable.combine(_statistics_pass(
            parts, bounds, num_rows, ("trajectory_id", "reward", *extra),
            lambda c: TrajectoryTable.of_chunk(c["trajectory_id"], c["reward"], c.get("termination_reason"),
                                               c.get("tool_calls"), c.get("tool_errors")),
            "trajectory statistics", progress))

    # step and done (5 bytes a row) tell which rows belong to trajectories of several turns
    fields = tuple(sorted(set(expression.fields) | {"group_id", "step", "done"}))
    kept, kept_groups, kept_trajectories, failing, failing_trajectories, seen_groups, done = [], [], [], [], [], [], 0
    for start, stop in bounds:
        columns = _read_columns(parts, start, stop, fields)
        if table is not None:
            columns.update(table.columns_for(columns["group_id"]))
        if trajectories is not None:
            columns.update(trajectories.columns_for(columns["trajectory_id"]))
        mask = expression.evaluate(columns, stop - start)
        group_ids = columns["group_id"]
        seen_groups.append(np.unique(group_ids))
        kept.append(columns["position"][mask])
        kept_groups.append(group_ids[mask])
        if whole_groups:
            failing.append(np.unique(group_ids[~mask]))
        # a row at step 0 that is done is a whole trajectory; only longer ones can lose some rows
        in_longer = (columns["step"] > 0) | ~columns["done"].astype(bool)
        if in_longer.any():
            trajectory_ids = columns["trajectory_id"] if "trajectory_id" in columns else \
                _read_columns(parts, start, stop, ("trajectory_id",))["trajectory_id"]
            kept_trajectories.append(np.where(in_longer, trajectory_ids, -1)[mask])
            failing_trajectories.append(np.unique(trajectory_ids[~mask & in_longer]))
        else:
            kept_trajectories.append(np.full(int(mask.sum()), -1, dtype=np.int64))
        done += stop - start
        if progress is not None:
            progress("rows", done, num_rows)
    positions = np.concatenate(kept) if kept else np.zeros(0, dtype=np.int64)
    groups = np.concatenate(kept_groups) if kept_groups else np.zeros(0, dtype=np.int64)
    trajectory_of_kept = np.concatenate(kept_trajectories) if kept_trajectories else np.zeros(0, dtype=np.int64)
    drop = np.zeros(positions.size, dtype=bool)
    if whole_groups and failing:
        drop |= np.isin(groups, np.concatenate(failing))
    with_trajectories = 0
    if failing_trajectories and any(f.size for f in failing_trajectories):  # -1: a row that is a whole trajectory
        in_failing = np.isin(trajectory_of_kept, np.concatenate(failing_trajectories))
        with_trajectories = int((in_failing & ~drop).sum())
        drop |= in_failing
    positions, groups = positions[~drop], groups[~drop]
    groups_in = int(np.unique(np.concatenate(seen_groups)).size) if seen_groups else 0
    return Selected(positions.astype(np.int64), num_rows, groups_in, int(np.unique(groups).size), with_trajectories)


# ====================================================================== writing
@dataclass
class FilterResult:
    """What ``filter`` did: counts, and the new buffer's stats (None for a selection or a count)."""

    source: str
    destination: str | None
    output: str  # "buffer", "selection" or "count"
    where: str
    whole_groups: bool
    rows_in: int
    rows_kept: int
    groups_in: int
    groups_kept: int
    rows_dropped_with_trajectories: int = 0  # met the condition; a turn of their trajectory did not
    stats: StoreStats | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "stats"}
        out["stats"] = self.stats.to_json() if self.stats is not None else None
        return out


def filter_buffer(src: str | os.PathLike, dst: str | os.PathLike | None, where: str, *,
                  whole_groups: bool = False, selection: bool = False, to: str | None = None,
                  chunk_rows: int = DEFAULT_CHUNK_ROWS, progress: Progress | None = None,
                  **dst_options: Any) -> FilterResult:
    """Keeps the rows of the buffer at ``src`` that ``where`` selects.

    ``dst=None`` only counts. Otherwise ``selection=True`` saves a selection at ``dst`` (no
    rows copied); else a new store is written at ``dst``: the source's backend, or ``to``
    (``"memmap"``/``"zarr"``), with the source's segment size unless ``dst_options`` say
    otherwise (e.g. ``segment_rows=``, Zarr ``codec=``). The source is never modified.
    """
    from rlhf_pipeline.storage import open_buffer

    if dst is not None and _exists(str(dst)):
        raise FileExistsError(f"{dst} exists; choose a new path for the filtered buffer")
    if selection and (to is not None or dst_options):
        raise ValueError("a selection copies no rows: --to and store options apply to a new buffer only")
    with open_buffer(str(src), mode="r") as source:
        if dst is not None:
            _check_destination(str(dst), str(src), source)
            if selection:
                _check_selection_at_url(str(dst), source)
            else:  # a selection is a directory whatever its name
                backend = to or _backend_and_segment(source)[0]
                check_zip_destination(str(dst), backend)
                if "://" in str(dst) and backend == "memmap":  # before the rows are read, not when writing
                    raise LocalOnlyStoreError(f"{dst} is a URL, where a buffer is a Zarr store, not a memmap one")
        expression = parse_where(where, stored_fields=source.schema.field_names)
        parts = parts_of(source)  # every read below names rows by global id within these parts
        chosen = select_positions(source, expression, whole_groups=whole_groups, chunk_rows=chunk_rows,
                                  progress=progress, parts=parts)
        result = FilterResult(str(src), None if dst is None else str(dst),
                              "count" if dst is None else ("selection" if selection else "buffer"),
                              where, whole_groups, chosen.rows_in, int(chosen.positions.size),
                              chosen.groups_in, chosen.groups_kept, chosen.rows_dropped_with_trajectories)
        if dst is None:
            return result
        if selection:
            _save_selection(source, parts, chosen.positions, str(dst), where, whole_groups)
        else:
            result.stats = _copy_rows(source, parts, chosen.positions, str(dst), to, chunk_rows, progress,
                                      dst_options)
    return result


def _exists(location: str) -> bool:
    return "://" not in location and Path(location).exists()


def _check_destination(dst: str, src: str, source: TrajectoryStore) -> None:
    """Refuses a ``dst`` inside the source or inside any buffer (docs/curation.md#filter)."""
    from rlhf_pipeline.storage.buffers import buffer_holding, within

    sources = [src, *([source.source_location] if hasattr(source, "source_location") else [])]
    inside = next((s for s in sources if within(dst, s)), None)
    if inside is not None:
        raise ValueError(f"{dst} is inside {inside}, the buffer being filtered: the kept rows would be written into "
                         f"their own buffer (a learner reading it would train them twice); choose a path outside it")
    holder = buffer_holding(dst)
    if holder is not None:
        raise ValueError(f"{dst} is inside the buffer {holder}: a store written there becomes part of that buffer "
                         f"(a shard of a run's buffer is read by its learner); choose a path outside it")


def _check_selection_at_url(dst: str, source: TrajectoryStore) -> None:
    """Refuses a selection kept at a URL of rows on this machine: it reads its rows in place, from any
    machine that opens it."""
    if "://" not in dst:
        return
    from rlhf_pipeline.storage.manifest import is_selection

    if is_selection(dst):
        raise FileExistsError(f"{dst} holds a saved selection; choose a new URL for the selection")
    local = next((p.store.location for p in parts_of(source) if "://" not in str(p.store.location)), None)
    if local is not None:
        raise ValueError(f"{dst}: a selection kept at a URL reads its rows in place from any machine, and {local} "
                         f"is on this one; save the selection in a directory, or filter without --selection to copy "
                         f"the rows to the URL")


def _save_selection(source: TrajectoryStore, parts: list[Part], positions: np.ndarray, dst: str, where: str,
                    whole_groups: bool) -> None:
    from rlhf_pipeline.storage import open_buffer
    from rlhf_pipeline.storage.selection import SelectionStore, save_selection_at_url, write_selection

    if "://" in dst:  # saved here, then kept there: the same files, the manifest last
        save_selection_at_url(dst, lambda local: _save_selection(source, parts, positions, str(local), where,
                                                                 whole_groups))
        return

    if isinstance(source, SelectionStore):
        # a selection of a selection names the rows of the original buffer: no chains of views
        parts, ids = source.keys(positions)
        with open_buffer(source.source_location, mode="r") as root:
            write_selection(dst, root, parts, ids, where=f"({source.where}) and ({where})" if source.where else where,
                            whole_groups=whole_groups)
        return
    part_index, ids = keys_of(source, positions, parts)
    write_selection(dst, source, part_index, ids, where=where, whole_groups=whole_groups)


def _backend_and_segment(source: TrajectoryStore) -> tuple[str, int]:
    from rlhf_pipeline.storage.convert import segment_rows_of

    stores = list(getattr(source, "_sources", {}).values()) or [p.store for p in parts_of(source)]
    return stores[0].backend_name, segment_rows_of(stores[0])


def _copy_rows(source: TrajectoryStore, parts: list[Part], positions: np.ndarray, dst: str, to: str | None,
               chunk_rows: int, progress: Progress | None, dst_options: dict[str, Any]) -> StoreStats:
    from rlhf_pipeline.storage.backends import backend_class

    backend, segment_rows = _backend_and_segment(source)
    target_cls = backend_class(to or backend)
    dst_options.setdefault("segment_rows", segment_rows)

    with new_store(target_cls, dst, "filter", source.schema, **dst_options) as target:
        step = max(chunk_rows, dst_options["segment_rows"])
        for start in range(0, positions.size, step):
            target.append(read_by_position(parts, positions[start: start + step]))
            if progress is not None:
                progress("copy", min(positions.size, start + step), int(positions.size))
        flush = getattr(target, "flush", None)
        if flush is not None:
            flush()
    from rlhf_pipeline.storage.backends import open_store

    with open_store(dst, mode="r") as written:
        return written.stats()


__all__ = ["GROUP_NAMES", "FilterResult", "GroupTable", "Selected", "chunk_bounds", "filter_buffer",
           "select_positions"]
