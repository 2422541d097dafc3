"""``import``: rows from JSONL, Parquet or a Hugging Face dataset into a replay buffer.

Why one file: the checks that need the store and the write pass share the scan's group numbering,
the id bases and the resume record, and must stay in step row for row (the check pass itself,
which needs none of them, is :mod:`import_scan`).

Two streaming passes: check every row as it will be stored (nothing lands when one fails), then
write whole groups through the pipeline's write path into ``store.append``, computing the sampling
log-probs the source lacks with the run's newest policy (or ``make_policy()``, version 0) at the
pipeline's temperature. A killed import resumes exactly. Design: docs/architecture.md#rows-in-and-out.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlhf_pipeline.dataio.columns import (
    ColumnMap,
    ImportRows,
    ResolvedColumns,
    chat_template_warning,
    normalize,
    resolve_columns,
)
from rlhf_pipeline.dataio.import_state import (
    ImportRecord,
    Target,
    new_shard_index,
    resolve_target,
    shard_of,
)
from rlhf_pipeline.dataio.import_scan import Scan, chunk_digest, locate_completion, scan
from rlhf_pipeline.dataio.progress import Progress
from rlhf_pipeline.dataio.sources import Source, SourceError, open_source
from rlhf_pipeline.schema.ids import id_base
from rlhf_pipeline.pipeline import Pipeline, PipelineError, RunPaths
from rlhf_pipeline.storage.buffers import find_shard, is_url
from rlhf_pipeline.schema.ragged import RaggedTensor
from rlhf_pipeline.schema import FIELDS_BY_NAME, TrajectoryBatch, TrajectoryValidationError

# fields every import fills itself when the source does not carry them
_MADE_BY_IMPORT = ("prompt_tokens", "response_tokens", "response_log_probs", "group_id", "trajectory_id", "step",
                   "reward", "done", "terminated", "truncated", "policy_version", "prompt_text", "response_text")


@dataclass(frozen=True)
class ImportOptions:
    columns: ColumnMap = ColumnMap()
    format: str | None = None
    split: str | None = None
    policy_version: int | None = None
    """Version for rows without a version column (default: that of the weights scoring their
    log-probs; with log-probs given, the run's newest version, or 0 outside a run)."""
    rows_per_chunk: int = 512
    show_progress: bool = True
    stop: threading.Event | None = None
    """Set it (the CLI's first Ctrl-C does) to stop after the append in progress, which is recorded:
    :class:`ImportStopped` is raised and the same call resumes. Stopping between appends, not at
    an arbitrary bytecode, keeps an interrupt out of locks and thread pools half taken."""


class ImportStopped(Exception):
    """The import stopped on request (:attr:`ImportOptions.stop`) with ``rows_written`` rows stored and recorded."""

    def __init__(self, rows_written: int) -> None:
        super().__init__(f"import stopped on request after {rows_written} rows; the same call resumes it")
        self.rows_written = rows_written


@dataclass
class ImportResult:
    buffer: str
    source_rows: int
    completions: int
    groups: int
    rows_written: int  # rows this call appended (the write path may drop some, e.g. zero variance)
    resumed_from_row: int  # source rows already written by an earlier, interrupted call
    already_done: bool
    log_probs_from: str | None  # which weights scored missing sampling log-probs
    write_path: list[str]


# ====================================================================== the import
def import_source(source_path: str | Path, buffer: str | Path, pipeline: Pipeline, *,
                  options: ImportOptions = ImportOptions(), run_root: Path | RunPaths | None = None,
                  log=print) -> ImportResult:
    """Imports ``source_path`` into ``buffer`` with ``pipeline``'s tokenizer, model and write path.

    ``run_root``: the run ``buffer`` belongs to (:func:`~rlhf_pipeline.dataio.run_pipeline.find_run`:
    a directory, or a run at a URL); its newest weights score missing log-probs. Raises
    :class:`SourceError` for bad input and ``PipelineError`` when the pipeline cannot provide
    what the buffer needs; either way nothing is written.
    """
    source = open_source(source_path, options.format, options.split)
    target = resolve_target(buffer, run_root)
    first, where = source.first_record()
    resolved = resolve_columns(first, options.columns, f"{where} (the first record)")
    tokenizer = pipeline.tokenizer
    log(f"[import] {source.path} ({source.format}): {resolved.describe(source.holds_chat_trajectories())}")
    if (warning := chat_template_warning(resolved, tokenizer)) is not None:
        log(warning)
    record = ImportRecord.find(target, source)
    check_content = False
    if record is not None:
        check_content = _check_record(record, source, options)
        if record.data["done"]:
            log(f"[import] {source.path} was already imported into {target.store_path} "
                f"({record.data['rows_written']} rows); delete {record.path} to import it again")
            return ImportResult(str(target.store_path), 0, 0, 0, 0, int(record.data["committed_rows"]), True,
                                None, [])

    # ---------------------------------------------------------------- pass 1: nothing is touched
    fingerprint = source.fingerprint()
    checked = scan(source, resolved, tokenizer, options.rows_per_chunk, options.show_progress, _stopped(options),
                   positions=model_positions(pipeline))
    if checked is None:
        raise ImportStopped(0)
    if check_content:  # the file's size or time changed: resume only on the same rows
        if record.data["content"][1] != checked.content:
            _raise_changed_since(record, source)
        record.data["source"] = fingerprint
        record.save()

    # ---------------------------------------------------------------- the store and its write path
    store_path, started_record = target.store_path, False
    if target.new_shard:
        shard = record.data["shard"] if record is not None else new_shard_index(target.run)
        # a rerun after a crash finds the shard under the name it was made with
        store_path = find_shard(target.run.buffer_location, shard)
        if record is None:  # first, so a rerun after a crash reuses this shard (an empty one would stall learners)
            record = ImportRecord.start(target, source, {"shard": shard, **_record_basics(fingerprint, options, checked)})
            started_record = True
    store, created = _open_or_create(pipeline, store_path)
    try:
        plan = plan_write_path(pipeline, store, resolved)
        _check_groups(plan, checked, source, resolved, tokenizer, options, in_run=target.run is not None)
        if record is None or "group_base" not in record.data:
            bases = _id_bases(store, target, store_path, resolved, checked, source, tokenizer, options)
        if source.fingerprint() != fingerprint:
            raise SourceError(f"{source.path} changed while the import checked it; nothing was written. Import it "
                              f"once it is complete (a file still being written is read as it is at that moment)")
    except BaseException:
        store.close()
        if created:  # nothing of a failed import stays behind, not even an empty store
            _remove_store(store_path)
        if started_record:
            record.delete()
        raise
    try:
        if record is None:
            record = ImportRecord.start(target, source, {"shard": None, **_record_basics(fingerprint, options, checked), **bases})
        elif "group_base" not in record.data:
            record.data.update(bases)
            record.save()
        return _write(source, store, pipeline, resolved, checked, record, options, target, plan, log)
    finally:
        store.close()


def model_positions(pipeline: Pipeline) -> int | None:
    """The positions the pipeline's model has (``config.max_position_embeddings``; None: not said).

    Read from ``make_model()`` built on the meta device, which allocates nothing; a model that cannot
    be built there (``from_pretrained`` refuses it: it loads weights) is built as it is."""
    try:
        with torch.device("meta"):
            model = pipeline.make_model()
    except (RuntimeError, NotImplementedError):  # "You are using `from_pretrained` with a meta device context"
        model = pipeline.make_model()
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return int(positions) if isinstance(positions, int) else None


def _stopped(options: ImportOptions) -> Callable[[], bool]:
    return options.stop.is_set if options.stop is not None else lambda: False


def _record_basics(fingerprint: list[list], options: ImportOptions, checked: Scan) -> dict[str, Any]:
    return {"source": fingerprint, "options": _options_json(options),
            "content": [options.rows_per_chunk, checked.content]}


def _options_json(options: ImportOptions) -> dict[str, Any]:
    return {"columns": options.columns.to_json(), "format": options.format, "split": options.split,
            "policy_version": options.policy_version}


def _check_record(record: ImportRecord, source: Source, options: ImportOptions) -> bool:
    """Raises when the record's import cannot go on; True when the rows must be compared after the scan."""
    if not record.data["done"] and record.data["options"] != _options_json(options):
        raise SourceError(f"an interrupted import of {source.path} into this buffer used other options "
                          f"({record.data['options']}); rerun it with the same ones to finish it, or delete "
                          f"{record.path} (and the rows it wrote) to start over")
    if record.data["source"] == source.fingerprint():
        return False
    content = record.data.get("content")
    if record.data["done"] or content is None or content[0] != options.rows_per_chunk:
        _raise_changed_since(record, source)
    return True


def _raise_changed_since(record: ImportRecord, source: Source):
    state = "was imported" if record.data["done"] else "was being imported"
    raise SourceError(f"{source.path} changed since it {state} into this buffer ({record.data['rows_written']} "
                      f"rows written); restore it, or delete {record.path} to import it as new data")


def _open_or_create(pipeline: Pipeline, path: Path | str):
    """``(store opened for appending, created)``; a new store is the pipeline's ``create_buffer``."""
    from rlhf_pipeline.storage import open_store

    if is_url(str(path)):  # a store is there once its commit record is
        from rlhf_pipeline.storage import detect_backend
        from rlhf_pipeline.storage.errors import NotAStoreError

        try:
            detect_backend(path)
        except NotAStoreError:  # nothing there, or what a killed create left without its commit record
            backend = getattr(pipeline.settings, "buffer_backend", None)
            if isinstance(backend, str) and backend != "zarr":  # before a memmap store makes a local "s3:"
                raise PipelineError(f"{path} is a URL, where only a Zarr buffer can live, but setting "
                                    f"'buffer_backend' is {backend!r}: leave it unset (Zarr is the default at a "
                                    f"URL) or --set buffer_backend=zarr")
            return _created_at_url(pipeline.create_buffer(path), path), True
        return open_store(path, mode="a"), False
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        return open_store(str(path), mode="a"), False
    path.parent.mkdir(parents=True, exist_ok=True)
    return pipeline.create_buffer(path), True


def _created_at_url(store, url: str):
    if getattr(store, "backend_name", None) != "zarr":
        store.close()
        raise PipelineError(f"{url} is a URL, where only a Zarr buffer can live, but the pipeline's create_buffer "
                            f"made a {getattr(store, 'backend_name', type(store).__name__)!r} store; set "
                            f"buffer_backend=zarr (--set buffer_backend=zarr for a store outside a run)")
    return store


def _remove_store(location: Path | str) -> None:
    """Deletes a store this import created (every object under a URL prefix)."""
    if not is_url(str(location)):
        shutil.rmtree(location, ignore_errors=True)
        return
    import fsspec

    from rlhf_pipeline.storage.zarr.object_store import object_store_options

    fs, root = fsspec.core.url_to_fs(location, **object_store_options(None, location=location))
    try:
        fs.rm(root, recursive=True)
    except FileNotFoundError:
        pass


# ====================================================================== write path
@dataclass
class WritePathPlan:
    transforms: list[Any]  # the transforms that run, in write order
    names: list[str]
    skipped: list[str]  # transforms whose fields the source carries
    group_size: int | None  # the group advantage's G, when it runs


def plan_write_path(pipeline: Pipeline, store, resolved: ResolvedColumns) -> WritePathPlan:
    """The pipeline's write path for ``store`` minus the transforms whose fields are given; checks that
    every field the store holds comes from the source, the import or a transform."""
    from rlhf_pipeline.transforms import GroupAdvantage

    schema = store.schema
    given = set(resolved.given_fields)
    extra = [f for f in FIELDS_BY_NAME if f in given and f not in schema.field_names]
    if extra:
        raise SourceError(
            f"the source carries {extra} (columns {[resolved.column_of_field(f) for f in extra]}), which "
            f"{store.location} does not store (it stores {list(schema.field_names)}); import into a buffer "
            f"that stores them, or leave the columns out with --ignore-column")
    factory = pipeline.make_write_path
    plan = WritePathPlan([], [], [], None)
    filled = given | set(_MADE_BY_IMPORT)
    for transform in (list(factory(store)) if factory is not None else []):
        fills, name = tuple(getattr(transform, "fills_fields", ())), type(transform).__name__
        if fills and all(f in given for f in fills):
            plan.skipped.append(name)
            continue
        partly = [f for f in fills if f in given]
        if partly:
            raise SourceError(f"the source gives {partly} but not {[f for f in fills if f not in given]}, which "
                              f"{name} computes with them; give all of them or none")
        plan.transforms.append(transform)
        plan.names.append(name)
        filled |= set(fills)
        if isinstance(transform, GroupAdvantage):
            plan.group_size = transform.group_size
    missing = [f for f in schema.field_names if f not in filled]
    if missing:
        raise PipelineError(f"{store.location} stores {missing}, which neither the source nor the pipeline's write "
                            f"path ({', '.join(plan.names) or 'none'}) provides")
    return plan


def _check_groups(plan: WritePathPlan, checked: Scan, source: Source, resolved: ResolvedColumns, tokenizer: Any,
                  options: ImportOptions, *, in_run: bool) -> None:
    if plan.group_size is None:
        return
    bad = np.nonzero(checked.trajectories_per_group != plan.group_size)[0]
    if bad.size:
        g = int(bad[0])
        at = locate_completion(source, resolved, tokenizer, checked, int(checked.first_completion_of_group[g]),
                               options.rows_per_chunk)
        found = int(checked.trajectories_per_group[g])
        # a run's settings.json fixes its group size (import refuses --set there), a store's import may set it
        # to any size GRPO can compare within (2 or more)
        resize = ("the run's settings.json fixes it" if in_run else
                  f"or import into a store with --set group_size={found}" if found >= 2 else
                  "a group advantage compares 2 or more completions of a prompt")
        raise SourceError(
            f"{at}: the group of this row has {found} completion{'s' if found != 1 else ''}, but the "
            f"pipeline's group advantage takes groups of {plan.group_size}; import groups of that size ({resize}), "
            f"or give the rows' advantages in the source")


def _id_bases(store, target: Target, store_path: Path | str, resolved: ResolvedColumns, checked: Scan, source: Source,
              tokenizer: Any, options: ImportOptions) -> dict[str, Any]:
    """First fresh group / trajectory id: past every id the store holds, in the shard's id range; and
    whether given ids are renumbered from there (``renumber_ids``).

    A run's shard renumbers them, each group and trajectory kept whole: the other shards of its buffer
    hold ids of their own (another run's export, or this run's, counts from 0 as collector 0 does), and a
    shard's ids carry its index (``schema/ids.py``). A store keeps them, and given group ids already in it
    would merge imported rows into stored groups: an error.
    """
    space = target.shard_index if target.shard_index is not None else shard_of(store_path)
    renumber = target.run is not None
    group_max = traj_max = -1
    stored_groups = []
    n = len(store)
    for start in range(0, n, 65_536):
        ids = store.read(torch.arange(start, min(n, start + 65_536)), fields=("group_id", "trajectory_id"))
        group_max = max(group_max, int(ids["group_id"].max()))
        traj_max = max(traj_max, int(ids["trajectory_id"].max()))
        if resolved.group_ids_given and not renumber:
            stored_groups.append(np.unique(ids["group_id"].numpy()))
        if checked.trajectory_ids is not None and not renumber:
            _refuse_stored_trajectories(ids["trajectory_id"].numpy(), store, resolved, checked, source, tokenizer,
                                        options)
    if stored_groups:
        clash = np.isin(checked.keys.view(np.int64), np.unique(np.concatenate(stored_groups)))
        if clash.any():
            g = int(checked.group_of_key[int(np.nonzero(clash)[0][0])])
            at = locate_completion(source, resolved, tokenizer, checked, int(checked.first_completion_of_group[g]),
                                   options.rows_per_chunk)
            raise SourceError(
                f"{at}, column {resolved.slots['group']!r}: group id {int(checked.keys.view(np.int64)[clash][0])} is "
                f"already in {store.location}; importing would merge groups. Import into a new buffer, or leave the "
                f"column out (--ignore-column {resolved.slots['group']}) to group by prompt with fresh ids")
    base = id_base(space)
    return {"group_base": max(base, group_max + 1), "trajectory_base": max(base, traj_max + 1),
            "renumber_ids": renumber}


def _refuse_stored_trajectories(stored: np.ndarray, store, resolved: ResolvedColumns, checked: Scan, source: Source,
                                tokenizer: Any, options: ImportOptions) -> None:
    clash = np.isin(checked.trajectory_ids, stored)
    if clash.any():
        t = int(np.nonzero(clash)[0][0])
        at = locate_completion(source, resolved, tokenizer, checked, int(checked.first_completion_of_trajectory[t]),
                               options.rows_per_chunk)
        raise SourceError(
            f"{at}, column {resolved.passthrough['trajectory_id']!r}: trajectory {int(checked.trajectory_ids[t])} is "
            f"already in {store.location}; ids are unique in a buffer. Import into a new buffer, or leave the column "
            f"out (--ignore-column trajectory_id) for fresh ids")


# ====================================================================== pass 2: write
class _ClosedPrefixQueue:
    """Rows in source order; the longest prefix in which every group is complete can be written."""

    def __init__(self, rows_per_group: np.ndarray) -> None:
        self.rows_per_group = rows_per_group
        self.parts: list[TrajectoryBatch] = []
        self.open: dict[int, int] = {}  # group -> rows queued, for groups not complete yet
        self.queued = 0
        self.closed = 0  # rows of the closed prefix
        self.closed_source_end = 0  # source rows covered by the closed prefix

    def add(self, batch: TrajectoryBatch, groups: np.ndarray, source_rows: np.ndarray) -> None:
        for j, g in enumerate(groups.tolist()):
            seen = self.open.pop(g, 0) + 1
            if seen < self.rows_per_group[g]:
                self.open[g] = seen
            elif not self.open:
                self.closed, self.closed_source_end = self.queued + j + 1, int(source_rows[j]) + 1
        self.parts.append(batch)
        self.queued += len(batch)

    def take_closed(self) -> tuple[TrajectoryBatch, int]:
        rows = self.parts[0] if len(self.parts) == 1 else TrajectoryBatch.cat(self.parts)
        out = rows.select(slice(0, self.closed)) if self.closed < len(rows) else rows
        self.parts = [rows.select(slice(self.closed, len(rows)))] if self.closed < len(rows) else []
        self.queued -= self.closed
        self.closed = 0
        return out, self.closed_source_end


class _ScoringPolicy:
    """The model that scores missing sampling log-probs, built on first use."""

    def __init__(self, pipeline: Pipeline, run: RunPaths | None) -> None:
        self.pipeline, self.run = pipeline, run
        self.model = None
        self.version = 0
        self.description = ""

    def load(self, log) -> None:
        if self.model is not None:
            return
        from rlhf_pipeline.coordination.weights import latest_version, load_weights

        if self.run is not None and latest_version(self.run.store) is not None:
            state, self.version = load_weights(self.run.store)
            self.model = self.pipeline.make_model()
            self.model.load_state_dict(state)
            self.description = f"the run's newest policy, version {self.version} ({self.run.store.describe('weights')})"
        else:
            self.model = self.pipeline.initial_policy()
            self.description = "the pipeline's make_policy() (version 0)"
        self.model.to(getattr(self.pipeline.settings, "device", "cpu")).eval()
        log(f"[import] sampling log-probs from {self.description} at temperature "
            f"{self.pipeline.learner.temperature}")

    def log_probs(self, batch: TrajectoryBatch) -> RaggedTensor:
        from rlhf_pipeline.transforms.ref_logprobs import reference_log_probs

        return reference_log_probs(self.model, batch["prompt_tokens"], batch["response_tokens"],
                                   temperature=self.pipeline.learner.temperature,
                                   pad_token_id=self.pipeline.pad_token_id)


def _write(source: Source, store, pipeline: Pipeline, resolved: ResolvedColumns, checked: Scan,
           record: ImportRecord, options: ImportOptions, target: Target, plan: WritePathPlan, log) -> ImportResult:
    from rlhf_pipeline.storage import make_replay_buffer
    from rlhf_pipeline.coordination.weights import latest_version

    sink = make_replay_buffer(store, transforms=plan.transforms).extend
    start_row = record.resume_row(store)
    if start_row:
        log(f"[import] resuming after source row {start_row} (written by an earlier, interrupted import)")
    compute = "response_log_probs" not in resolved.given_fields
    policy = _ScoringPolicy(pipeline, target.run)
    if compute:
        policy.load(log)
    if options.policy_version is not None:
        version = options.policy_version
    elif compute:
        version = policy.version
    else:
        version = (latest_version(target.run.store) or 0) if target.run is not None else 0
    group_base, traj_base = int(record.data["group_base"]), int(record.data["trajectory_base"])
    renumber = bool(record.data.get("renumber_ids", False))  # an import begun before renumbering kept given ids
    if renumber and (resolved.group_ids_given or checked.trajectory_ids is not None):
        log("[import] the source's group and trajectory ids are numbered again in the shard's range, each group and "
            "trajectory kept whole: a run's ids are unique across its buffer's shards")
    queue = _ClosedPrefixQueue(checked.rows_per_group)
    written = int(record.data["rows_written"])
    progress = Progress("import: write", checked.source_rows, enabled=options.show_progress)
    progress.update(start_row)

    def append(batch: TrajectoryBatch, source_end: int) -> None:
        nonlocal written
        if compute:
            batch = batch.with_columns(response_log_probs=policy.log_probs(batch))
        before = store.next_row
        record.before_append(source_end, before, written)
        try:
            sink(batch)
        except TrajectoryValidationError as exc:  # the check pass validated these rows: a write-path rule it lacks
            raise SourceError(f"{source.path}: the pipeline's write path refused the rows before source row "
                              f"{source_end}: {exc}. {written} rows of this import are stored; fix the source and "
                              f"delete {record.path} with what the import wrote, or report the check it lacks") from None
        written += store.next_row - before
        record.after_append(source_end, written)

    chunks = 0
    for index, chunk in enumerate(source.chunks(options.rows_per_chunk)):
        if _stopped(options)():
            raise ImportStopped(written)
        chunks = index + 1
        if chunk.ordinal + len(chunk) <= start_row:
            continue
        try:
            rows = normalize(chunk, resolved, pipeline.tokenizer)
        except SourceError as exc:  # the check pass read these rows without fault
            _changed(source, record, written, str(exc))
        if index >= len(checked.chunk_digests) or chunk_digest(rows) != checked.chunk_digests[index]:
            _changed(source, record, written, f"{chunk.where(0)} onwards differs from what the check pass read")
        batch, groups = _with_ids(rows, checked, group_base, traj_base, checked.completions_before_chunk[index],
                                  version, renumber=renumber)
        source_rows = chunk.ordinal + rows.source_row
        if chunk.ordinal < start_row:  # the chunk the interrupted import stopped in
            keep = torch.from_numpy(np.nonzero(source_rows >= start_row)[0])
            batch, groups, source_rows = batch.select(keep), groups[keep.numpy()], source_rows[keep.numpy()]
        queue.add(batch, groups, source_rows)
        if queue.closed >= options.rows_per_chunk:
            append(*queue.take_closed())
        progress.update(chunk.ordinal + len(chunk) - max(chunk.ordinal, start_row))
    if chunks < len(checked.chunk_digests):
        _changed(source, record, written, f"it ends after {chunks} chunks of {options.rows_per_chunk} rows, not "
                                          f"{len(checked.chunk_digests)}")
    if queue.closed:
        append(*queue.take_closed())
    progress.close()
    if queue.queued:  # the check pass counted every group's rows, so this is a bug, not bad input
        raise RuntimeError(f"import: {queue.queued} rows of incomplete groups were left over")
    record.data["done"] = True
    record.save()
    log(f"[import] {checked.source_rows} source rows -> {checked.completions} completions in {checked.groups} "
        f"groups; {written} rows in {store.location}"
        + (f" (write path: {', '.join(plan.names)})" if plan.names else "")
        + (f"; given, not recomputed: {', '.join(plan.skipped)}" if plan.skipped else ""))
    return ImportResult(str(store.location), checked.source_rows, checked.completions, checked.groups, written,
                        start_row, False, policy.description or None, plan.names)


def _changed(source: Source, record: ImportRecord, written: int, how: str):
    """Stops the write pass: rows not read by the check pass are never written."""
    raise SourceError(
        f"{source.path} changed during the import ({how}); the import stopped before writing anything of the change. "
        f"{written} rows written before it are kept and recorded in {record.path}: restore the file as it was and "
        f"run the same command to finish the import, or remove what it wrote and the record to start over")


def _with_ids(rows: ImportRows, checked: Scan, group_base: int, traj_base: int, first_completion: int,
              version: int, *, renumber: bool) -> tuple[TrajectoryBatch, np.ndarray]:
    """The chunk's rows with group / trajectory ids and versions (given ones kept, ids unless ``renumber``)
    and their group numbers."""
    n = len(rows)
    columns = dict(rows.columns)
    groups = checked.group_numbers(rows.group_key)
    if renumber:  # a group's number is its key's order of first appearance; a trajectory's, its id's rank
        columns.pop("group_id", None)
        given = columns.pop("trajectory_id", None)
        if given is not None:
            columns["trajectory_id"] = traj_base + torch.from_numpy(
                np.searchsorted(checked.trajectory_ids, given.numpy()).astype(np.int64))
    columns.setdefault("group_id", torch.from_numpy(group_base + groups))
    columns.setdefault("trajectory_id", traj_base + first_completion + torch.arange(n, dtype=torch.int64))
    columns.setdefault("policy_version", torch.full((n,), version, dtype=torch.int64))
    return TrajectoryBatch(columns), groups
