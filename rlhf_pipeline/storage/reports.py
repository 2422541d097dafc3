"""What ``inspect --verify`` and ``repair`` report, the same shape for every backend; no torch.

A :class:`CheckReport` lists what was checked, the problems found (each names a file or a
chunk) and notes (facts that are not damage, such as segments written before checksums).
A :class:`RepairReport` adds what repair did or, in a dry run, would do, and what it could
not recover.

Design: docs/buffer-tools.md#inspect-verify.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: ``progress(done, total)``: parts (segments, units) checked so far; the CLI shows it
Progress = Callable[[int, int], None]


@dataclass
class CheckReport:
    """The outcome of checking one store (``inspect --verify``)."""

    location: str
    backend: str
    checked: dict[str, int] = field(default_factory=dict)  # what was checked -> how many
    problems: list[str] = field(default_factory=list)  # damage, each naming the file or chunk
    notes: list[str] = field(default_factory=list)
    # of the problems, those of the commit record alone that rewriting it fixes (the rows are intact)
    record_problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {"location": self.location, "backend": self.backend, "ok": self.ok, "checked": self.checked,
                "problems": self.problems, "notes": self.notes}

    def format(self) -> str:
        counts = ", ".join(f"{n} {what}" for what, n in self.checked.items()) or "nothing"
        lines = [f"{self.location} ({self.backend}): checked {counts}: "
                 + ("no damage found" if self.ok else f"{len(self.problems)} problem(s)")]
        lines += [f"  DAMAGED: {p}" for p in self.problems]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


@dataclass
class RepairReport:
    """The outcome of ``repair`` on one store: the rebuilt state and what could not be recovered."""

    location: str
    backend: str
    applied: bool  # False: a dry run, nothing was written
    rows_before: int | None  # rows the store published before (None: no readable state)
    rows_after: int | None  # rows the rebuilt state publishes (None: nothing could be rebuilt)
    actions: list[str] = field(default_factory=list)  # what was (or would be) written or moved
    unrecoverable: list[str] = field(default_factory=list)  # what is lost, naming files and rows
    notes: list[str] = field(default_factory=list)

    @property
    def needed(self) -> bool:
        return bool(self.actions)

    def to_json(self) -> dict[str, Any]:
        return {"location": self.location, "backend": self.backend, "applied": self.applied,
                "rows_before": self.rows_before, "rows_after": self.rows_after, "actions": self.actions,
                "unrecoverable": self.unrecoverable, "notes": self.notes}

    def format(self) -> str:
        verb = "repaired" if self.applied else "would repair (dry run; --apply writes)"
        if not self.actions:
            head = f"{self.location} ({self.backend}): nothing to repair"
        else:
            before = "no readable state" if self.rows_before is None else f"{self.rows_before} rows"
            after = "nothing" if self.rows_after is None else f"{self.rows_after} rows"
            head = f"{self.location} ({self.backend}): {verb}: {before} published before, {after} after"
        lines = [head]
        lines += [f"  {'did' if self.applied else 'would'}: {a}" for a in self.actions]
        lines += [f"  NOT RECOVERABLE: {u}" for u in self.unrecoverable]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)
