"""Pass 1 of ``import``: every row read, tokenized and validated as it will be stored.

Nothing is written here. What the pass keeps is small (8 bytes of group key a completion, a
digest a chunk): enough for pass 2 to number groups and trajectories in source order, to resume
mid-file, and to notice a source that changed between the passes. See :mod:`importer`.
Design: docs/architecture.md#rows-in-and-out.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlhf_pipeline.dataio.columns import ImportRows, ResolvedColumns, normalize
from rlhf_pipeline.dataio.progress import Progress
from rlhf_pipeline.dataio.sources import Source, SourceError
from rlhf_pipeline.schema import StoreSchema, TrajectoryBatch, TrajectoryValidationError, validate_batch
from rlhf_pipeline.schema.ragged import RaggedTensor


@dataclass
class Scan:
    """What the check pass learned: group structure and chunk offsets (for ids and resume)."""

    source_rows: int
    completions: int
    keys: np.ndarray  # sorted unique group keys
    group_of_key: np.ndarray  # group number (order of first appearance) of each key
    rows_per_group: np.ndarray  # completions per group
    trajectories_per_group: np.ndarray
    first_completion_of_group: np.ndarray
    completions_before_chunk: list[int]
    chunk_digests: list[bytes]  # what each chunk held, so the write pass notices a source that changed
    trajectory_ids: np.ndarray | None  # sorted unique given trajectory ids (None: the import assigns them)
    first_completion_of_trajectory: np.ndarray | None

    @property
    def groups(self) -> int:
        return len(self.rows_per_group)

    @property
    def content(self) -> str:
        """Digest of every row as it will be stored: a rerun resumes on a file restored to these rows."""
        return hashlib.blake2b(b"".join(self.chunk_digests), digest_size=16).hexdigest()

    def group_numbers(self, keys: np.ndarray) -> np.ndarray:
        return self.group_of_key[np.searchsorted(self.keys, keys)]


def scan(source: Source, resolved: ResolvedColumns, tokenizer: Any, rows_per_chunk: int, show_progress: bool,
         stopped: Callable[[], bool] = lambda: False, *, positions: int | None = None) -> Scan | None:
    """Pass 1: reads and checks every row; raises SourceError at the first bad one.

    ``positions``: the model's context (``max_position_embeddings``); a row whose prompt and
    completion together are longer is refused (its log-probs would be computed, and it would be
    trained, past the positions the model has). None: no limit.

    Returns None as soon as ``stopped()`` is true: nothing is written in this pass, so there is
    nothing to record."""
    keys, dones, before, digests, trajectories, steps = [], [], [], [], [], []
    completions = source_rows = 0
    progress = Progress("import: check", source.count_rows(), enabled=show_progress)
    for chunk in source.chunks(rows_per_chunk):
        if stopped():
            return None
        rows = normalize(chunk, resolved, tokenizer)
        validate_rows(rows)
        if positions is not None:
            _check_context(rows, positions)
        before.append(completions)
        digests.append(chunk_digest(rows))
        keys.append(rows.group_key)
        dones.append(rows.columns["done"].numpy())
        if "trajectory_id" in resolved.passthrough:
            trajectories.append(rows.columns["trajectory_id"].numpy())
            steps.append(rows.columns["step"].numpy().astype(np.int32))
        elif not dones[-1].all():
            i = int(np.nonzero(~dones[-1])[0][0])
            raise SourceError(f"{rows.where(i)}, column {rows.resolved.column_of_field('done')!r}: a row that is not "
                              f"done is one step of a longer trajectory, which needs a trajectory_id column to "
                              f"join its steps; without one every row is a whole trajectory (done true)")
        completions += len(rows)
        source_rows += len(chunk)
        progress.update(len(chunk))
    progress.close()
    if not completions:
        raise SourceError(f"{source.path} holds no rows to import")
    key, done = np.concatenate(keys), np.concatenate(dones)
    uniq, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    number_of_uniq = np.empty(len(uniq), dtype=np.int64)
    order = np.argsort(first, kind="stable")
    number_of_uniq[order] = np.arange(len(uniq))
    group = number_of_uniq[inverse]
    checked = Scan(source_rows, completions, uniq, number_of_uniq, np.bincount(group),
                   np.bincount(group, weights=done).astype(np.int64), first[order], before, digests, None, None)
    if trajectories:
        trajectory = np.concatenate(trajectories)
        _check_trajectory_ids(trajectory, np.concatenate(steps), group, source, resolved, tokenizer, checked,
                              rows_per_chunk)
        checked.trajectory_ids, checked.first_completion_of_trajectory = np.unique(trajectory, return_index=True)
    return checked


def _check_trajectory_ids(trajectory: np.ndarray, step: np.ndarray, group: np.ndarray, source: Source,
                          resolved: ResolvedColumns, tokenizer: Any, checked: Scan, rows_per_chunk: int) -> None:
    """Given trajectory ids: each (trajectory_id, step) once, and each trajectory within one group.

    Rows sharing a trajectory_id are the steps of one multi-turn trajectory; two rows with the
    same id and step, or one id in two groups, are two trajectories under one id.
    """
    order = np.lexsort((np.arange(len(trajectory)), step, trajectory))
    same = trajectory[order][1:] == trajectory[order][:-1]
    twice = same & (step[order][1:] == step[order][:-1])
    split = same & (group[order][1:] != group[order][:-1])
    bad = np.nonzero(twice | split)[0]
    if not bad.size:
        return
    k = int(bad[0])
    first, second = sorted((int(order[k]), int(order[k + 1])))

    def where(index: int) -> str:
        return locate_completion(source, resolved, tokenizer, checked, index, rows_per_chunk)

    what = f"step {int(step[second])} of trajectory" if twice[k] else "trajectory"
    kind = "also at" if twice[k] else "also in another group, at"
    raise SourceError(f"{where(second)}, column {resolved.passthrough['trajectory_id']!r}: {what} "
                      f"{int(trajectory[second])} is {kind} {where(first)}; ids are unique in a buffer: give each "
                      f"trajectory its own id, or leave the column out (--ignore-column trajectory_id) for fresh ids")


def _check_context(rows: ImportRows, positions: int) -> None:
    prompt, response = rows.columns["prompt_tokens"].lengths(), rows.columns["response_tokens"].lengths()
    over = torch.nonzero(prompt + response > positions)
    if over.numel():
        i = int(over[0])
        p, r = int(prompt[i]), int(response[i])
        raise SourceError(f"{rows.where(i)}: its prompt ({p} tokens) and completion ({r} tokens) make {p + r} tokens, "
                          f"more than the {positions} positions of the pipeline's model (max_position_embeddings): "
                          f"it cannot be scored or trained past them; shorten the row or leave it out of the source")


def chunk_digest(rows: ImportRows) -> bytes:
    """16 bytes that change with any value of the chunk's rows as they will be stored."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(np.array([rows.chunk.ordinal, len(rows.chunk)], dtype=np.int64).tobytes())
    digest.update(rows.group_key.tobytes())
    digest.update(rows.source_row.tobytes())
    for name in sorted(rows.columns):
        column = rows.columns[name]
        digest.update(name.encode())
        if isinstance(column, RaggedTensor):
            digest.update(column.values.numpy().tobytes())
            digest.update(column.offsets.numpy().tobytes())
        elif isinstance(column, torch.Tensor):
            digest.update(column.numpy().tobytes())
        else:
            for text in column:
                digest.update(text.encode("utf-8", "surrogatepass") + b"\0")
    return digest.digest()


def validate_rows(rows: ImportRows) -> None:
    """Stored-row checks on a chunk, with placeholders for what pass 2 fills (ids, log-probs)."""
    n = len(rows)
    columns = dict(rows.columns)
    columns.setdefault("group_id", torch.zeros(n, dtype=torch.int64))
    columns.setdefault("trajectory_id", torch.arange(n, dtype=torch.int64))
    columns.setdefault("policy_version", torch.zeros(n, dtype=torch.int64))
    response = columns["response_tokens"]
    columns.setdefault("response_log_probs", RaggedTensor(torch.zeros(response.values.numel()), response.offsets))
    batch = TrajectoryBatch(columns)
    try:
        validate_batch(batch, StoreSchema.for_batch(batch))
    except TrajectoryValidationError as exc:
        if exc.row is None:
            raise SourceError(f"{rows.chunk.file}: {exc}") from None
        column = rows.resolved.column_of_field(exc.field) if exc.field else "?"
        message = str(exc).split(": ", 1)[-1]
        raise SourceError(f"{rows.where(exc.row)}, column {column!r}: {message}") from None


def locate_completion(source: Source, resolved: ResolvedColumns, tokenizer: Any, scan_: Scan, index: int,
                      rows_per_chunk: int) -> str:
    """File and row of completion ``index`` (re-reads up to its chunk; used for error messages)."""
    chunk_index = int(np.searchsorted(scan_.completions_before_chunk, index, side="right")) - 1
    for i, chunk in enumerate(source.chunks(rows_per_chunk)):
        if i == chunk_index:
            rows = normalize(chunk, resolved, tokenizer)
            return rows.where(index - scan_.completions_before_chunk[i])
    return f"{source.path} completion {index}"
