"""The rows a retaining parent at a URL (``s3://``, ``az://``) holds for its branches beside it.

A branch at a URL (``runs/branch_url.py``) of a run with collectors names the parent's rows it
reads in ``parent-rows/selection.json`` at its own URL: per parent shard, the rows from the first
one the parent held when the branch was made up to its count at the branch step. A replay of it
reads them by global id and checks they are all there; a branch continued online
(``runs/branch_online_url.py``) reads the same rows in place below that count, through its
``buffer.continues.json``. Either way the parent keeps every row from the selection's first row
of its shard on (as ``runs/retention.py``'s ``branch_rows_needed`` does for a local parent), and:

* a branch being made (``branch.making``, no ``branch.json`` yet) holds from its selection's first
  row once that is uploaded, and every row before (it is about to name the rows held then); one
  left half-made by a killed ``branch`` holds them until ``branch`` is run again or it is deleted;
* an unreadable selection holds every row rather than guess;
* a detached branch (``runs/detach.py``) reads its own copy, so it holds nothing, unless it was
  continued online: its buffer still reads the parent's shard in place, so it holds every row;
* a branch of a replay reads the replay's source, not this buffer: nothing.

Finding them costs one listing of the home and one or two reads per run beside it, plus one read
per branch (:func:`~rlhf_pipeline.runs.lineage_url.branch_records_at_url`): :class:`UrlBranchFloors`
does it only when a drop is about to happen, and reuses a look younger than ``rescan_s`` only to
*keep* rows (a stale look may miss a branch made since, never a row it needs).
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

RESCAN_S = 30.0  # how long a look at the branches may keep rows before it is taken again
# a drop under way is marked in the run's store; `branch` waits for it, up to this age (a collector
# killed mid-drop leaves its mark behind)
DROP_MARK_STALE_S = 60.0


def drop_mark_key(shard_key: str) -> str:
    """The object in a run's store that says a drop of shard ``shard_key``'s rows is under way."""
    return f"retention/dropping-{shard_key.strip('/').replace('/', '_') or 'buffer'}.json"


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


def wait_for_drops(run_store: Any, shard_keys: Any, poll_s: float = 0.05) -> None:
    """Returns once no drop of the shards' rows is under way in the run at ``run_store`` (a mark older
    than ``DROP_MARK_STALE_S`` on the server's clock is one a killed collector left: not waited for)."""
    for shard_key in shard_keys:
        while (seen := run_store.read_with_age(drop_mark_key(shard_key))) is not None:
            if seen[2] is not None and seen[2] > DROP_MARK_STALE_S:
                break
            time.sleep(poll_s)


def url_branch_rows_needed(run_url: str, store_path: str, home_store: Any = None,
                           others: list[str] | None = None) -> list[tuple[str, int]]:
    """``(branch, first global row)`` of the rows of the shard at ``store_path`` that each branch
    beside the run at ``run_url`` reads (module docstring); ``home_store``: the ``ObjectRunStore``
    of the runs' home to read with (one is made when None); ``others``: the runs beside, if listed."""
    from rlhf_pipeline.runs.branch_reads import PARENT_ROWS_MANIFEST, first_row_read
    from rlhf_pipeline.runs.lineage_url import branch_records_at_url

    shard = store_path.rstrip("/")
    home_store = home_store if home_store is not None else _home_store(run_url)
    needed = []
    for branch in branch_records_at_url(run_url, half_made=True, home_store=home_store, others=others):
        name = branch["run"].rpartition("/")[2]
        raw = home_store.read(f"{name}/{PARENT_ROWS_MANIFEST}")
        lineage = branch["lineage"] or {}
        in_place = f"{branch['run']} (detached, but continued online: it reads the parent in place)"
        if raw is None:
            if branch["half_made"]:
                needed.append((f"{branch['run']} (half-made: run its `branch` again, or delete it)", 0))
            elif lineage.get("detached") and _continues_in_place(home_store, name, branch["run"], shard):
                needed.append((in_place, 0))
            continue  # a branch of a replay reads the replay's source, not this buffer
        try:
            first = first_row_read(json.loads(raw).get("parts", []), shard)
        except (ValueError, AttributeError, TypeError, KeyError):
            needed.append((f"{branch['run']} (its parent-rows/ is unreadable)", 0))  # hold every row rather than guess
            continue
        if first is not None:
            needed.append((branch["run"], first))
        elif lineage.get("detached") and _continues_in_place(home_store, name, branch["run"], shard):
            needed.append((in_place, 0))
    return needed


def _home_store(run_url: str) -> Any:
    """The ``ObjectRunStore`` of the runs beside the run at ``run_url`` (None at a bucket's top: none)."""
    from rlhf_pipeline.files.object_run_store import ObjectRunStore

    home = run_url.rstrip("/").rpartition("/")[0]
    return ObjectRunStore(home) if "://" in home and not home.endswith(":/") else None


def _continues_in_place(home_store: Any, name: str, branch_url: str, shard: str) -> bool:
    """Whether the branch's buffer continues online from rows of the parent's shard at ``shard``
    (its ``buffer.continues.json`` names that shard's buffer and rows of it): it reads them in place."""
    from rlhf_pipeline.runs.branch_reads import continues_shard
    from rlhf_pipeline.storage.continues import continued_rows

    try:
        settings = json.loads(home_store.read(f"{name}/settings.json") or b"{}")
        continues = continued_rows(str(settings.get("buffer_url") or f"{branch_url}/buffer"))
    except (ValueError, OSError):
        return True  # unreadable: hold rather than guess
    return continues_shard(continues, shard)


def running_replays_at_url(run_url: str, sources: set[str], home_store: Any, others: list[str]) -> list[str]:
    """The runs ``others`` beside the run at ``run_url`` whose ``replay`` reads one of ``sources`` (the
    parent's buffer or this shard: their ``settings.json`` names the source) and runs now: their
    ``run.lock`` lease (``files/run_lease.py``) not abandoned. One read or two per run, a few at a time."""
    from concurrent.futures import ThreadPoolExecutor

    from rlhf_pipeline.files.run_lease import abandoned, holder_record
    from rlhf_pipeline.runs.lineage_url import READS_AT_ONCE

    home = run_url.rstrip("/").rpartition("/")[0]
    wanted = {source.rstrip("/") for source in sources}

    def running(other: str) -> str | None:
        try:
            replay = json.loads(home_store.read(f"{other}/settings.json") or b"{}").get("replay") or {}
            source = replay.get("buffer") if isinstance(replay, dict) else None
        except (ValueError, AttributeError):
            return None  # no settings yet, or not a replay
        if not isinstance(source, str) or source.rstrip("/") not in wanted:
            return None
        seen = home_store.read_with_age(f"{other}/run.lock")
        if seen is None:
            return None  # not running
        holder = holder_record(seen[0])
        if not holder:
            return f"{home}/{other}"  # unreadable: hold rather than guess
        # the lease's own rule; a record naming no lease_s never runs out by age
        return None if abandoned(holder, seen[2], default_lease_s=math.inf) else f"{home}/{other}"

    with ThreadPoolExecutor(max_workers=max(1, min(READS_AT_ONCE, len(others)))) as pool:
        return [found for found in pool.map(running, others) if found is not None]


class UrlBranchFloors:
    """The branch floors of one shard of a parent at a URL, and the running replays of its buffer
    beside it (they hold every row), looked up at most once per ``rescan_s`` unless a drop is about
    to happen (module docstring)."""

    def __init__(self, run_url: str, store_path: str, rescan_s: float = RESCAN_S,
                 buffer_location: str | None = None) -> None:
        self.run_url, self.store_path, self.rescan_s = run_url, store_path, rescan_s
        self.sources = {store_path, buffer_location or f"{run_url.rstrip('/')}/buffer"}
        self._floors: list[tuple[int, str]] = []
        self._taken: float | None = None
        self._home_store: Any = None
        self.looks = 0  # how many times the home was listed (metrics and tests)

    def floors(self, *, fresh: bool) -> tuple[list[tuple[int, str]], bool]:
        """``(row, why)`` per branch, and whether they were looked up just now."""
        recent = self._taken is not None and time.monotonic() - self._taken < self.rescan_s
        if recent and not fresh:
            return self._floors, False
        if self._home_store is None:  # one client for every look
            self._home_store = _home_store(self.run_url)
        self._floors = []
        if self._home_store is not None:  # at a bucket's top there are no runs beside
            from rlhf_pipeline.runs.lineage_url import runs_beside

            others = runs_beside(self._home_store, self.run_url.rstrip("/").rpartition("/")[2])  # one listing
            self._floors = [(row, f"branch {run}") for run, row in url_branch_rows_needed(
                self.run_url, self.store_path, self._home_store, others)]
            # a running replay counted the rows it walks when it started
            self._floors += [(0, f"replay {run} (running)") for run in running_replays_at_url(
                self.run_url, self.sources, self._home_store, others)]
        self._taken = time.monotonic()
        self.looks += 1
        return self._floors, True
