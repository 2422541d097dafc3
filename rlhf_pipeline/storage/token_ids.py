"""Stored token ids outside a model's vocabulary: what ``inspect --verify`` reports beside the damage
its checksums find.

Such a row is intact on disk, so no checksum sees it, yet the learner that samples it dies with an
``IndexError`` in its embedding, again on every resume. The check reads ``group_id`` and both token
fields of every published row, one storage unit at a time, and names each store, each group holding
such a row, its rows (global ids) and the first bad id found in it.

Design: docs/buffer-tools.md#inspect-verify.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf_pipeline.storage.reports import CheckReport, Progress

TOKEN_FIELDS = ("prompt_tokens", "response_tokens")


@dataclass(frozen=True)
class BadGroup:
    """A group of one store that holds at least one token id outside the vocabulary."""

    group_id: int
    rows: tuple[int, ...]
    """Global row ids of the group's rows that hold one."""
    row: int
    field: str
    token: int
    """The first bad id found: in ``field`` of global row ``row``."""

    def describe(self, vocab_size: int) -> str:
        rows = ", ".join(str(r) for r in self.rows[:8]) + (", ..." if len(self.rows) > 8 else "")
        held = f"rows {rows} hold" if len(self.rows) > 1 else f"row {rows} holds"
        return (f"group {self.group_id}: {held} token ids outside the model's vocabulary of {vocab_size} "
                f"(row {self.row} {self.field}: {self.token})")


def bad_groups(store, vocab_size: int, progress: Progress | None = None) -> list[BadGroup]:
    """The groups of ``store`` (an open :class:`~rlhf_pipeline.storage.base.TrajectoryStore`) whose
    rows hold a token id outside ``[0, vocab_size)``, in row order."""
    found: dict[int, list[tuple[int, str, int]]] = {}
    for start, batch, field, outside in _units_outside(store, vocab_size, progress):
        ragged = batch[field]
        row_of_value = torch.repeat_interleave(torch.arange(len(ragged)), ragged.lengths())
        for index in torch.nonzero(outside).flatten().tolist():
            k = int(row_of_value[index])
            found.setdefault(int(batch["group_id"][k]), []).append(
                (store.first_row + start + k, field, int(ragged.values[index])))
    groups = []
    for group_id, hits in found.items():
        rows = tuple(sorted({row for row, _, _ in hits}))
        row, field, token = min(hits)
        groups.append(BadGroup(group_id, rows, row, field, token))
    return sorted(groups, key=lambda group: group.rows[0])


def first_outside(store, vocab_size: int, progress: Progress | None = None) -> dict[str, int | str] | None:
    """A row of the first storage unit of ``store`` that holds a token id outside ``[0, vocab_size)``:
    its ``group_id``, ``trajectory_id``, the ``field`` and the ``token``; None when every id fits. Reads
    no further than that unit (a buffer of another tokenizer has one in its first)."""
    for _, batch, field, outside in _units_outside(store, vocab_size, progress, fields=("trajectory_id",)):
        ragged = batch[field]
        index = int(torch.nonzero(outside).flatten()[0])
        k = int(torch.searchsorted(ragged.offsets, index, right=True)) - 1
        return {"group_id": int(batch["group_id"][k]), "trajectory_id": int(batch["trajectory_id"][k]),
                "field": field, "token": int(ragged.values[index])}
    return None


def _units_outside(store, vocab_size: int, progress: Progress | None, fields: tuple[str, ...] = ()):
    """``(unit start, its rows, token field, mask of its ids outside the vocabulary)`` for each field of each
    storage unit holding such an id, read one unit at a time (``progress`` after each)."""
    units = store.unit_bounds()
    for done, (start, stop) in enumerate(units, 1):
        batch = store.read(torch.arange(start, stop, dtype=torch.int64), fields=("group_id", *fields, *TOKEN_FIELDS))
        for field in TOKEN_FIELDS:
            outside = (batch[field].values < 0) | (batch[field].values >= vocab_size)
            if bool(outside.any()):
                yield start, batch, field, outside
        if progress is not None:
            progress(done, len(units))


def find_bad_groups(location: str, vocab_size: int,
                    progress: Progress | None = None) -> list[tuple[str, str, int, list[BadGroup]]]:
    """``(backend, store location, rows checked, bad groups)`` of every store of the buffer at
    ``location`` (each shard of a run's buffer)."""
    from rlhf_pipeline.storage import open_store
    from rlhf_pipeline.storage.buffers import stores_in

    found = []
    for backend, path in stores_in(location):
        with open_store(path, mode="r") as store:
            found.append((backend, path, len(store), bad_groups(store, vocab_size, progress)))
    return found


def check_token_ids(location: str, vocab_size: int, progress: Progress | None = None) -> list[CheckReport]:
    """One report per store of the buffer at ``location``: a problem for each group holding an id
    outside ``[0, vocab_size)``."""
    reports = []
    for backend, path, rows, groups in find_bad_groups(location, vocab_size, progress):
        report = CheckReport(location=path, backend=backend)
        report.checked["rows' token ids"] = rows
        report.problems += [f"{group.describe(vocab_size)}: a learner cannot embed them" for group in groups]
        reports.append(report)
    return reports
