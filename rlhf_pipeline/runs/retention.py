"""Retention in a run: what a collector may drop from its shard after a round, and what it may not.

The rules (``storage/retention.py``) say which old rows may go; this module finds the *floor*, the
oldest row of the collector's shard that something of the run still needs, and drops nothing at or
after it. The floor is the lowest of:

* **the kept checkpoints** (rewind points; only the newest with ``hold_rewind_points=false``): a learner resumed or branched from step N draws its
  next batches from the rows its sampler could reach then, the newest ``window`` rows before the
  position the checkpoint recorded (``step_N.json``'s ``buffer_rows``); a checkpoint made before
  positions were recorded, or one that does not name this shard, holds every row;
* **the branches beside the run** (``runs/lineage.py`` finds them; at a URL ``runs/retention_url.py``):
  a branch's ``parent-rows/`` names the parent's rows by global id and checks at every opening that
  they are all still there (a detached branch continued online still reads them in place: all held);
* **the learner**: the rows it has not taken in yet (``pacing.json``'s ``consumed``) and the
  ``window`` before them that its sampler draws from; before the learner's first intake, every row.

``window`` is ``max(sample_window, batch_size * uses_per_row)``: what the window, groups and exact
samplers can reach behind a position. The prioritized sampler draws from every row held, so with
it retention bounds what it draws from (a rewind then draws from the rows still held, not exact).

In a branch continued online (``runs/branch_online.py``) the checkpoints and the learner count a
shard's rows on from the parent's count ``N`` at the branch step, its own store from 0: those
floors are translated (row ``N + r`` is own row ``r``), a floor among the parent's rows holds every
own row, and only the branch's own rows are ever dropped (the parent's are read in place, never
written; the parent's own retention holds them for the branch through its ``parent-rows/``).

* **a running replay of the buffer** beside the run (its ``settings.json`` names the source, its
  ``run.lock`` a live process on this machine; at a URL a live lease: ``runs/retention_url.py``):
  while it runs, nothing is dropped.

Not covered (``docs/retention.md``): a replay under another home (or, of a run directory, on another
machine), and branches made under another home (or URL prefix), are not found.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_pipeline.runs.branch_reads import continues_shard, first_row_read, resolved_location
from rlhf_pipeline.storage.retention import RetentionSettings, RowClock, wanted_cut, whole_cut

CLOCK_KEY = "retention_clock"  # where the row clock rides in the collector's saved loop state


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
    floor and drops the whole segments the rules allow below it."""

    def __init__(self, settings: RetentionSettings, paths: Any, key: str, store_path: str, learner: Any,
                 clock: list | None = None, continues_from: int = 0) -> None:
        self.settings, self.paths, self.key, self.store_path = settings, paths, key, store_path
        # a branch continued online: its checkpoints and its learner count the shard's rows from the
        # parent's count, its own store from 0 (storage/continued.py); only its own rows ever go
        self.continues_from = int(continues_from)
        self.window = sampler_window(learner)
        self.clock = RowClock(clock)
        self.totals = [0, 0]  # rows dropped, bytes freed by this process
        self.url_branches: Any = None  # at a URL: the branches beside the run, looked up when a drop nears

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
        rows, size = sum(d.rows for d in dropped), sum(d.bytes for d in dropped)
        self.totals[0] += rows
        self.totals[1] += size
        return RetentionReport(rows, size, store.first_row, floor, held_by)

    def _branches_settled(self) -> Any:
        """No branch appears between the look at the branches and the drop: in a run directory one lock
        with ``branch`` (``lineage.branches_settled``), at a URL a mark ``branch`` waits for
        (``retention_url.drop_under_way``)."""
        from rlhf_pipeline.runs.lineage import branches_settled
        from rlhf_pipeline.runs.retention_url import drop_under_way

        if self.paths.url is None:
            return branches_settled(self.paths.root)
        return drop_under_way(self.paths.store, self.key)

    def floor(self, store: Any, fresh: bool = True) -> tuple[int, str]:
        """The oldest row of this shard something still needs (a row of ``store``), and what needs it;
        ``fresh=False`` may reuse a recent look at the branches at a URL (then see :meth:`after_round`)."""
        counted = [(self._learner_floor(store), "the learner's unread rows and sampling window")]
        counted += self._checkpoint_floors()
        # rows counted as the learner counts them, as rows of the store: a floor among the parent's
        # rows (below continues_from) holds every own row
        candidates = [(max(0, row - self.continues_from), why) for row, why in counted]
        candidates += self._branch_floors(fresh)
        if self.paths.url is None:
            candidates += [(store.first_row, f"replay {run} (running)")
                           for run in running_replays_of(self.paths.root, self.store_path)]
        return min(candidates, key=lambda c: c[0])

    def _learner_floor(self, store: Any) -> int:
        from rlhf_pipeline.coordination.pacing import read_intake

        where, run_store = self.paths.state_object(self.paths.pacing)
        intake = read_intake(where, store=run_store)
        if intake is None:
            return self.continues_from + store.first_row  # no learner intake yet: every row may still be read
        return max(0, intake.consumed.get(self.key, 0) - self.window)

    def _checkpoint_floors(self) -> list[tuple[int, str]]:
        from rlhf_pipeline.learn.checkpoint import run_checkpoints

        floors = []
        points = run_checkpoints(self.paths).rewind_points()
        if not self.settings.hold_rewind_points:
            points = points[-1:]  # the newest only: what a resume after a crash starts from
        for point in points:
            rows = point.get("buffer_rows")
            position = None if rows is None else rows.get("" if self.key == "." else self.key)
            needed = 0 if position is None else max(0, int(position) - self.window)
            floors.append((needed, f"the checkpoint of step {point['step']} (a rewind point)"))
        return floors

    def _branch_floors(self, fresh: bool = True) -> list[tuple[int, str]]:
        """``(row, why)`` per branch reading this shard (at a URL, and per running replay there; a look
        lists the home: with ``fresh=False`` a recent one may be reused, which only keeps rows)."""
        if self.paths.url is not None:
            if self.url_branches is None:
                from rlhf_pipeline.runs.retention_url import UrlBranchFloors

                self.url_branches = UrlBranchFloors(self.paths.url, self.store_path,
                                                    buffer_location=self.paths.buffer_location)
            return self.url_branches.floors(fresh=fresh)[0]
        return [(row, f"branch {run}") for run, row in branch_rows_needed(self.paths.root, self.store_path)]


def branch_rows_needed(run: str | Path, store_path: str) -> list[tuple[str, int]]:
    """``(branch, first global row)`` of the rows of the store at ``store_path`` that each branch
    beside ``run`` reads through its ``parent-rows/`` selection (one entry per branch that reads it),
    or in place through its continued buffer (a detached branch continued online: every row)."""
    from rlhf_pipeline.runs.lineage import find_branches, is_detached
    from rlhf_pipeline.storage.continues import continued_rows

    shard = resolved_location(store_path)
    needed = []
    for branch in find_branches(run):
        manifest = Path(branch["run"]) / "parent-rows" / "selection.json"
        try:
            first = first_row_read(json.loads(manifest.read_text()).get("parts", []), shard)
        except FileNotFoundError:
            first = None  # a branch of a replay reads the replay's source, not this buffer
        except (OSError, ValueError, AttributeError, TypeError, KeyError):
            needed.append((branch["run"], 0))  # unreadable: hold every row rather than guess
            continue
        if first is not None:
            needed.append((branch["run"], first))
        elif is_detached(branch["run"]):  # its own copy of the rows, but a continued buffer reads them in place
            try:
                in_place = continues_shard(continued_rows(Path(branch["run"]) / "buffer"), shard)
            except ValueError:
                in_place = True  # unreadable: hold rather than guess
            if in_place:
                needed.append((branch["run"], 0))
    return needed


def running_replays_of(run: str | Path, store_path: str) -> list[str]:
    """The runs beside ``run`` whose ``replay`` is running now over ``run``'s buffer (or over the
    store at ``store_path``): a replay's ``settings.json`` names its source, and its ``run.lock``
    names the process that holds it (``runs/run_directory.py``). Such a replay counted the rows it
    walks when it started, so while it runs nothing of the store is dropped."""
    from rlhf_pipeline.files.processes import pid_running
    from rlhf_pipeline.runs.run_directory import HOLDER_FILE

    run = Path(run).resolve()
    sources = {resolved_location(str(run / "buffer")), resolved_location(store_path)}
    found = []
    for candidate in sorted(run.parent.iterdir()) if run.parent.is_dir() else []:
        if candidate == run or not (candidate / HOLDER_FILE).is_file():
            continue
        try:
            replay = json.loads((candidate / "settings.json").read_text()).get("replay") or {}
            holder = json.loads((candidate / HOLDER_FILE).read_text() or "{}")
        except (OSError, ValueError, AttributeError):
            continue  # not a replay, or one that has not written its record yet
        source = replay.get("buffer") if isinstance(replay, dict) else None
        if (isinstance(source, str) and resolved_location(source) in sources
                and holder.get("host") == socket.gethostname()
                and isinstance(holder.get("pid"), int) and pid_running(holder["pid"])):
            found.append(str(candidate))
    return found


def run_retention(run: str | Path) -> dict[str, Any] | None:
    """What ``inspect RUN`` says of a run's retention: the rules from its ``settings.json`` (None
    for a run with no ``retention`` settings, made before them or by a pipeline without them)."""
    try:
        settings = json.loads((Path(run) / "settings.json").read_text())
    except (OSError, ValueError):
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
