"""Retention in a run: after each round a collector drops the old whole segments its rules allow
(``storage/retention.py``), never at or past the *floor*, the oldest row of its shard that a kept
checkpoint, a branch beside the run, the learner or a running replay still needs.
``docs/retention.md#what-holds-rows``.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_pipeline.files.processes import pid_running
from rlhf_pipeline.files.run_lease import abandoned, holder_record
from rlhf_pipeline.files.settings_history import saved_settings
from rlhf_pipeline.runs.lineage import (
    PARENT_ROWS_MANIFEST,
    branch_records,
    branches_settled,
    home_of,
    read_each,
    resolved_location,
    run_store_at,
    runs_beside,
)
from rlhf_pipeline.runs.run_directory import HOLDER_FILE
from rlhf_pipeline.storage.retention import RetentionSettings, RowClock, wanted_cut, whole_cut

CLOCK_KEY = "retention_clock"  # where the row clock rides in the collector's saved loop state
RESCAN_S = 30.0  # at a URL: how long a look at the branches may keep rows before it is taken again
# a drop under way at a URL is marked in the run's store; `branch` waits for it, up to this age (a
# collector killed mid-drop leaves its mark behind)
DROP_MARK_STALE_S = 60.0


@dataclass
class RetentionReport:
    """One round's retention, for the collector's metrics line."""

    rows_dropped: int
    bytes_freed: int
    first_row: int
    floor: int
    held_by: str
    """What set the floor when it stopped a drop the rules asked for ('' when nothing did)."""

    def metrics(self) -> dict[str, float]:
        return {"retention/rows_dropped": float(self.rows_dropped), "retention/bytes_freed": float(self.bytes_freed),
                "retention/first_row": float(self.first_row)}


def sampler_window(learner: Any) -> int:
    """Rows behind a sampler's position that its next draws may still read."""
    return max(int(learner.sample_window), int(learner.batch_size) * int(getattr(learner, "uses_per_row", 1)))


class ShardRetention:
    """A collector's retention of its own shard: :meth:`after_round` marks the row clock, finds the
    floor and drops the whole segments the rules allow below it. Its row clock (when rows were
    written, for ``max_age_s``) goes on from the collector's published ``runner_state``."""

    def __init__(self, settings: RetentionSettings, paths: Any, key: str, store_path: str, learner: Any,
                 runner_state: dict[str, Any] | None = None, continues_from: int = 0) -> None:
        self.settings, self.paths, self.key, self.store_path = settings, paths, key, store_path
        # a branch continued online: its checkpoints and its learner count the shard's rows from the
        # parent's count, its own store from 0 (storage/continued.py); only its own rows ever go
        self.continues_from = int(continues_from)
        self.window = sampler_window(learner)
        self.clock = RowClock((runner_state or {}).get(CLOCK_KEY))
        # a directory is listed in microseconds, a URL prefix in round trips: only there is a look reused
        self.branches = BranchFloors(paths.location, store_path, paths.buffer_location,
                                     rescan_s=0.0 if paths.store.is_local else RESCAN_S)

    @property
    def runner_state(self) -> dict[str, Any]:
        """The collector's runner state to publish with its next rows: the row clock."""
        return {CLOCK_KEY: self.clock.to_json()}

    def after_round(self, store: Any, newest_version: int | None, now: float | None = None) -> RetentionReport:
        now = time.time() if now is None else now
        self.clock.mark(store.next_row, now)
        wanted = wanted_cut(store, self.settings, newest_version=newest_version, clock=self.clock, now=now)
        dropped, floor, held_by = [], store.next_row, ""
        if wanted - wanted % store.segment_rows > store.first_row:  # a whole segment may go: look at the floor
            floor, held_by = self.floor(store, fresh=False)  # at a URL a recent look may keep rows, never drop them
            cut = whole_cut(store, wanted, floor)
            if cut > store.first_row:  # a drop: decided on a fresh look, no branch appearing until it is made
                with self._branches_settled():
                    floor, held_by = self.floor(store)
                    cut = whole_cut(store, wanted, floor)
                    dropped = store.drop_rows_before(cut) if cut > store.first_row else []
            held_by = held_by if floor < wanted else ""
        self.clock.forget_before(store.first_row)
        return RetentionReport(sum(d.rows for d in dropped), sum(d.bytes for d in dropped), store.first_row, floor,
                               held_by)

    def _branches_settled(self) -> Any:
        """No branch appears between the look at the branches and the drop (docs/retention.md)."""
        if self.paths.store.is_local:  # a lock `branch` takes too; an object store has none
            return branches_settled(self.paths.store)
        return drop_under_way(self.paths.store, self.key)

    def floor(self, store: Any, fresh: bool = True) -> tuple[int, str]:
        """The oldest row of this shard something still needs (a row of ``store``), and what needs it;
        ``fresh=False`` may reuse a recent look at the branches (then see :meth:`after_round`)."""
        counted = [(self._learner_floor(store), "the learner's unread rows and sampling window")]
        counted += self._checkpoint_floors()
        # rows counted as the learner counts them, as rows of the store: a floor among the parent's
        # rows (below continues_from) holds every own row
        candidates = [(max(0, row - self.continues_from), why) for row, why in counted]
        candidates += self.branches.floors(fresh=fresh)
        return min(candidates, key=lambda c: c[0])

    def _learner_floor(self, store: Any) -> int:
        from rlhf_pipeline.coordination.pacing import read_intake

        where, run_store = self.paths.state_object(self.paths.pacing)
        intake = read_intake(where, store=run_store)
        if intake is None:
            return self.continues_from + store.first_row  # no learner intake yet: every row may still be read
        return max(0, intake.consumed.get(self.key, 0) - self.window)

    def _checkpoint_floors(self) -> list[tuple[int, str]]:
        from rlhf_pipeline.coordination.pacing import buffer_rows_key
        from rlhf_pipeline.learn.checkpoint import run_checkpoints
        from rlhf_pipeline.learn.keep_best import recorded_keep_best

        floors = []
        checkpoints = run_checkpoints(self.paths)
        points = checkpoints.rewind_points()
        if not self.settings.hold_rewind_points:
            # the newest (what a resume after a crash starts from), and what `branch --from-step best` may take
            checkpoints.keep_best = recorded_keep_best(self.paths.store)
            held = checkpoints.held_for_best()
            points = [point for point in points[:-1] if point["step"] in held] + points[-1:]
        for point in points:
            rows = point.get("buffer_rows")
            position = None if rows is None else rows.get(buffer_rows_key(self.key))
            needed = 0 if position is None else max(0, int(position) - self.window)
            floors.append((needed, f"the checkpoint of step {point['step']} (a rewind point)"))
        return floors


@contextmanager
def drop_under_way(run_store: Any, shard_key: str) -> Iterator[None]:
    """Held by a collector at a URL while it looks at its branches and drops rows: ``branch`` names the
    parent's rows only when no drop is under way (:func:`wait_for_drops`), so a branch is either seen by
    the look (its ``branch.making`` came first) or names the rows left after the drop: the URL's
    counterpart of ``lineage.branches_settled``. One PUT and one DELETE a round that drops."""
    key = drop_mark_key(shard_key)
    run_store.write(key, json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode(), fence=False)
    try:
        yield
    finally:
        run_store.delete(key)


def drop_mark_key(shard_key: str) -> str:
    """The object in a run's store that says a drop of shard ``shard_key``'s rows is under way."""
    return f"retention/dropping-{shard_key.strip('/').replace('/', '_') or 'buffer'}.json"


def wait_for_drops(run_store: Any, shard_keys: Any, poll_s: float = 0.05) -> None:
    """Returns once no drop of the shards' rows is under way in the run at ``run_store`` (a mark older
    than ``DROP_MARK_STALE_S`` on the server's clock is one a killed collector left: not waited for)."""
    for shard_key in shard_keys:
        while (seen := run_store.read_with_age(drop_mark_key(shard_key))) is not None:
            if seen[2] is not None and seen[2] > DROP_MARK_STALE_S:
                break
            time.sleep(poll_s)


def branch_rows_needed(run: str, store_path: str, home: Any, others: list[str]) -> list[tuple[str, int]]:
    """``(branch, first global row)`` of the rows of the shard at ``store_path`` that each branch
    beside ``run`` (a directory or a URL) reads (docs/retention.md); ``home``: the run store of the
    runs' home, ``others``: the runs beside it."""
    shard = resolved_location(store_path).rstrip("/")
    needed = []
    for branch in branch_records(run, half_made=True, home=home, others=others):
        name = branch["run"].rpartition("/")[2]
        raw = home.read(f"{name}/{PARENT_ROWS_MANIFEST}")
        if raw is None and branch["half_made"]:
            needed.append((f"{branch['run']} (half-made: run its `branch` again, or delete it)", 0))
            continue
        try:  # no parent-rows/: a branch of a replay reads the replay's source, or a detached one its copy
            first = None if raw is None else first_row_read(json.loads(raw).get("parts", []), shard)
        except (ValueError, AttributeError, TypeError, KeyError):
            needed.append((f"{branch['run']} (its parent-rows/ is unreadable)", 0))  # hold every row rather than guess
            continue
        if first is not None:
            needed.append((branch["run"], first))
        elif (branch["lineage"] or {}).get("detached") and _continues_in_place(home, name, branch["run"], shard):
            needed.append((f"{branch['run']} (detached, but continued online: it reads the parent in place)", 0))
    return needed


def first_row_read(parts: list[dict[str, Any]], shard: str) -> int | None:
    """The first row of the store at ``shard`` that a saved selection's ``parts`` name (None: none)."""
    shard = resolved_location(shard).rstrip("/")
    firsts = [int(part["first_row"]) for part in parts
              if part.get("rows") and resolved_location(str(part.get("location", ""))).rstrip("/") == shard]
    return min(firsts) if firsts else None


def _continues_in_place(home: Any, name: str, branch: str, shard: str) -> bool:
    """Whether the branch's buffer continues online from rows of the parent's shard at ``shard``
    (its ``buffer.continues.json`` names that shard's buffer and rows of it): it reads them in place."""
    from rlhf_pipeline.storage.continues import continued_rows

    try:
        settings = json.loads(home.read(f"{name}/settings.json") or b"{}")
        continues = continued_rows(str(settings.get("buffer_url") or f"{branch}/buffer"))
    except (ValueError, OSError):
        return True  # unreadable: hold rather than guess
    if continues is None:
        return False
    buffer, _, name = resolved_location(shard).rstrip("/").rpartition("/")
    same = resolved_location(str(continues["parent_buffer"])).rstrip("/") == buffer
    return same and int(continues["rows"].get(name, 0)) > 0


def running_replays(sources: set[str], home: Any, others: list[str]) -> list[str]:
    """The runs ``others`` (in the home ``home``) whose ``replay`` reads one of ``sources`` (the parent's
    buffer or this shard: their ``settings.json`` names the source) and runs now: their ``run.lock``
    names a live process on this machine (a directory, ``runs/run_directory.py``) or is a lease not
    abandoned (a URL, ``files/run_lease.py``). Such a replay counted the rows it walks when it
    started, so while it runs nothing of the store is dropped. A read or two per run, a few at a time."""
    where = home.location.rstrip("/")
    wanted = {resolved_location(source).rstrip("/") for source in sources}

    def running(other: str) -> str | None:
        try:
            replay = json.loads(home.read(f"{other}/settings.json") or b"{}").get("replay") or {}
            source = replay.get("buffer") if isinstance(replay, dict) else None
        except (ValueError, AttributeError, OSError):
            return None  # no settings yet, or not a replay
        if not isinstance(source, str) or resolved_location(source).rstrip("/") not in wanted:
            return None
        if home.is_local:  # a lock held by a process, which only this machine can see running
            holder = holder_record(home.read(f"{other}/{HOLDER_FILE}") or b"")
            alive = holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int) \
                and pid_running(holder["pid"])
            return f"{where}/{other}" if alive else None
        seen = home.read_with_age(f"{other}/{HOLDER_FILE}")
        if seen is None:
            return None  # not running
        holder = holder_record(seen[0])
        if not holder:
            return f"{where}/{other}"  # unreadable: hold rather than guess
        # the lease's own rule; a record naming no lease_s never runs out by age
        return None if abandoned(holder, seen[2], default_lease_s=math.inf) else f"{where}/{other}"

    return read_each(running, others)


class BranchFloors:
    """The branch floors of one shard of a run, and the running replays of its buffer beside it (they
    hold every row), looked up at most once per ``rescan_s`` unless a drop is about to happen."""

    def __init__(self, run: str, store_path: str, buffer_location: str, rescan_s: float) -> None:
        self.run, self.store_path, self.rescan_s = str(run).rstrip("/"), store_path, rescan_s
        self.sources = {store_path, buffer_location}
        self._floors: list[tuple[int, str]] = []
        self._taken: float | None = None
        self._home: Any = None
        self.looks = 0  # how many times the home was listed (tests)

    def floors(self, *, fresh: bool) -> list[tuple[int, str]]:
        """``(row, why)`` per branch and running replay."""
        recent = self._taken is not None and time.monotonic() - self._taken < self.rescan_s
        if recent and not fresh:
            return self._floors
        if self._home is None:  # one client for every look
            self._home, self._name = home_of(self.run)
        self._floors = []
        if self._home is not None:  # at a bucket's top there are no runs beside
            others = runs_beside(self._home, self._name)  # one listing
            self._floors = [(row, f"branch {run}") for run, row in branch_rows_needed(
                self.run, self.store_path, self._home, others)]
            # a running replay counted the rows it walks when it started
            self._floors += [(0, f"replay {run} (running)") for run in running_replays(
                self.sources, self._home, others)]
        self._taken = time.monotonic()
        self.looks += 1
        return self._floors


def run_retention(run: str | Path) -> dict[str, Any] | None:
    """What ``inspect RUN`` says of a run's retention: the rules from its ``settings.json`` (None
    for a run with no ``retention`` settings, made before them or by a pipeline without them)."""
    try:
        settings = saved_settings(run_store_at(run))
    except (OSError, ValueError):  # damaged: a StateFileError
        return None
    data = settings.get("retention") if isinstance(settings, dict) else None
    if not isinstance(data, dict):
        return None
    rules = RetentionSettings.from_json(data)
    return {"policy": rules.describe(), "settings": {k: data.get(k) for k in sorted(data)}}


def format_retention(retention: dict[str, Any] | None, stats: Any) -> str:
    """The lines ``inspect`` prints between a run's lineage and its buffer."""
    if retention is None:
        return ""
    first = stats.extra.get("shard_first_rows") or f"{stats.first_row}"
    return (f"retention  {retention['policy']} (each collector, on its own shard)\n"
            f"  first row held  {first} (rows before it were dropped; global ids)")
