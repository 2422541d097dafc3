"""Retention: which of a store's oldest rows a writer may drop, by rows, policy versions or age.

A run's policy (:class:`RetentionSettings`: ``max_rows``, ``max_versions_behind``, ``max_age_s``), applied
by the store's writer (a collector, after each round) through ``drop_rows_before``; a row goes when any
rule says so (for age, a :class:`RowClock` the writer keeps: rows carry no time). The cut is always a
sealed segment boundary no group or trajectory crosses, and never past the ``floor``, the oldest row
something still needs (``runs/retention.py``), so fewer rows than a rule asks may go, never more.

Design: docs/retention.md#what-goes-whole-segments-whole-groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from rlhf_pipeline.setting_checks import Bounds, check_fields

ROW_CLOCK_MARKS = 256  # marks kept; older ones are merged so a clock stays a few KB


@dataclass
class RetentionSettings:
    """How much of a long run's buffer is kept (every rule unset: all of it)."""

    max_rows: Annotated[int | None, Bounds(ge=1)] = None
    """Keep at most this many of each shard's newest rows (whole sealed segments go, so between
    max_rows - segment_rows and max_rows are held; >= segment_rows). None: no bound by rows."""
    max_versions_behind: Annotated[int | None, Bounds(ge=0)] = None
    """Drop rows sampled by a policy more than this many versions behind the one the collector samples
    with now (the newest it has loaded). None: no bound by version."""
    max_age_s: Annotated[float | None, Bounds(gt=0)] = None
    """Drop rows written more than this many seconds ago. None: no bound by age."""
    hold_rewind_points: bool = True
    """true: every kept checkpoint holds the rows a rewind to it draws from (with
    learner.checkpoint_keep_every, the oldest kept one then bounds what retention drops); false: only
    the newest checkpoint does (a resume needs it), and a branch from an older one reads only the rows
    still held."""

    @property
    def enabled(self) -> bool:
        return any(v is not None for v in (self.max_rows, self.max_versions_behind, self.max_age_s))

    def __post_init__(self) -> None:
        """ValueError in one line naming the setting and the fix (``max_rows`` against the buffer's
        segment_rows: the run's settings, which hold both)."""
        # from_json reads these back from a settings.json a user may have edited: a value of another type
        # is named here, before check_fields compares it with its bounds
        for name, kind, words in (("max_rows", int, "a whole number"), ("max_versions_behind", int, "a whole number"),
                                  ("max_age_s", (int, float), "a number of seconds")):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
                raise ValueError(f"setting 'retention.{name}' must be {words} or none (no bound), got {value!r}")
        if not isinstance(self.hold_rewind_points, bool):
            raise ValueError(f"setting 'retention.hold_rewind_points' must be true or false, got "
                             f"{self.hold_rewind_points!r}")
        check_fields(self, "retention.")

    def describe(self) -> str:
        """``max_rows=100000, max_age_s=86400`` (the rules set), or ``keep every row``."""
        rules = [f"{name}={value:g}" if isinstance(value, float) else f"{name}={value}"
                 for name, value in (("max_rows", self.max_rows), ("max_versions_behind", self.max_versions_behind),
                                     ("max_age_s", self.max_age_s)) if value is not None]
        return ", ".join(rules) or "keep every row"

    @classmethod
    def from_json(cls, data: Any) -> RetentionSettings:
        """From a run's ``settings.json`` entry (a dict, or None for a run made before retention)."""
        data = data if isinstance(data, dict) else {}
        return cls(**{k: data.get(k) for k in ("max_rows", "max_versions_behind", "max_age_s")},
                   hold_rewind_points=bool(data.get("hold_rewind_points", True)))


class RowClock:
    """When rows were written: marks ``(next_row, time)`` taken after each write, so every row
    before a mark's row is at least as old as the mark. Kept by the writer (and saved with its
    position, so a restart keeps the ages); a row written before the first mark counts as written
    at that mark, which only keeps it longer."""

    def __init__(self, marks: list[list[float]] | None = None) -> None:
        self.marks: list[tuple[int, float]] = [(int(r), float(t)) for r, t in (marks or [])]

    def mark(self, next_row: int, now: float) -> None:
        if self.marks and self.marks[-1][0] >= next_row:
            return  # no new row since the last mark: that mark's time is the truer (older) one
        self.marks.append((int(next_row), float(now)))
        if len(self.marks) > ROW_CLOCK_MARKS:  # merge the older half pairwise: coarser, still never too old
            old, new = self.marks[:ROW_CLOCK_MARKS // 2], self.marks[ROW_CLOCK_MARKS // 2:]
            self.marks = [(old[i + 1][0], old[i + 1][1]) if i + 1 < len(old) else old[i]
                          for i in range(0, len(old), 2)] + new

    def rows_older_than(self, age_s: float, now: float) -> int:
        """Every row before the returned global id was written at least ``age_s`` seconds ago."""
        older = [row for row, at in self.marks if now - at >= age_s]
        return max(older, default=0)

    def forget_before(self, first_row: int) -> None:
        """Drops marks of rows no longer held (all but the last such mark, which still bounds ages)."""
        gone = [i for i, (row, _) in enumerate(self.marks) if row <= first_row]
        if len(gone) > 1:
            self.marks = self.marks[gone[-1]:]

    def to_json(self) -> list[list[float]]:
        return [[row, at] for row, at in self.marks]


def wanted_cut(store: Any, settings: RetentionSettings, *, newest_version: int | None, clock: RowClock | None,
               now: float) -> int:
    """The first row the rules alone would keep (before segments, groups and floors are considered)."""
    cut = store.first_row
    if settings.max_rows is not None and store.next_row > settings.max_rows:
        # up to the next segment boundary: at most max_rows held, as a store's capacity_rows bounds it
        size = store.segment_rows
        cut = max(cut, -(-(store.next_row - settings.max_rows) // size) * size)
    if settings.max_age_s is not None and clock is not None:
        cut = max(cut, clock.rows_older_than(settings.max_age_s, now))
    if settings.max_versions_behind is not None and newest_version is not None:
        cut = max(cut, _rows_of_versions_below(store, newest_version - settings.max_versions_behind))
    return min(cut, store.next_row)


def _rows_of_versions_below(store: Any, version: int) -> int:
    """The end of the longest run of whole sealed segments, from the oldest, whose every row has a
    policy version below ``version`` (read one segment at a time, a column only)."""
    cut = store.first_row
    for start, stop in _sealed_segments(store):
        versions = store.read_global(list(range(start, stop)), fields=["policy_version"]).policy_version
        if int(versions.max()) >= version:
            break
        cut = stop
    return cut


def _sealed_segments(store: Any):
    """``(first, end)`` global rows of each whole segment held, oldest first (the open one left out)."""
    size, start = store.segment_rows, store.first_row
    while (stop := (start // size + 1) * size) <= store.next_row:
        yield start, stop
        start = stop


def whole_cut(store: Any, wanted: int, floor: int) -> int:
    """The first row to keep: the last segment boundary at or before ``min(wanted, floor)`` at which
    no group and no trajectory continues across (rows ``b - 1`` and ``b`` share neither id);
    ``store.first_row`` when there is none (nothing is dropped)."""
    limit = min(wanted, floor, store.next_row)
    size = store.segment_rows
    boundary = limit - limit % size
    while boundary > store.first_row:
        if boundary < store.next_row and _continues_across(store, boundary):
            boundary -= size  # hold the segment the group (or trajectory) starts in too
            continue
        return boundary
    return store.first_row


def _continues_across(store: Any, boundary: int) -> bool:
    rows = store.read_global([boundary - 1, boundary], fields=["group_id", "trajectory_id"])
    return bool(rows.group_id[0] == rows.group_id[1] or rows.trajectory_id[0] == rows.trajectory_id[1])
