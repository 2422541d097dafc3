"""The append path of a Zarr trajectory store: cutting batches into units, background work.

:func:`plan_pieces` cuts a batch at segment boundaries (a whole segment is written sealed, any other piece
is a fragment); :class:`Sealer` compacts a completed segment's fragments into one sealed segment on a
background thread, publishing under the store's publish lock from its latest record, so the append that
completes a segment costs what any other does; :class:`Collector` deletes replaced units on another. A
segment is written under a new name and named by a record before the fragments it replaces are deleted:
a writer killed mid-seal leaves them published, and the next writer deletes the orphan and seals them
again. Design: docs/zarr-layout.md#writing-units."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from rlhf_pipeline.storage.errors import StoreError
from rlhf_pipeline.storage.zarr.units import UnitRef

log = logging.getLogger(__name__)


def plan_pieces(next_row: int, n: int, segment_rows: int) -> list[tuple[int, int, bool, bool]]:
    """``(offset in batch, rows, whole segment, completes a segment)`` per piece of an append.

    Sealed segments start at multiples of ``segment_rows`` (eviction drops whole ones),
    so the open segment is ``[next_row - next_row % S, ...)``.
    """
    out, pos = [], 0
    while pos < n:
        row = next_row + pos
        start = row - row % segment_rows
        take = min(n - pos, start + segment_rows - row)
        whole = row == start and take == segment_rows
        out.append((pos, take, whole, not whole and row + take == start + segment_rows))
        pos += take
    return out


def complete_segments(units: list[UnitRef], segment_rows: int) -> list[int]:
    """First rows of segments whose rows are all held in published fragments (ready to seal)."""
    rows: dict[int, int] = {}
    for unit in units:
        if not unit.sealed:
            start = unit.first_row - unit.first_row % segment_rows
            rows[start] = rows.get(start, 0) + unit.rows
    return sorted(start for start, count in rows.items() if count == segment_rows)


class Sealer:
    """Runs ``seal(first_row)`` jobs on one background thread, in order.

    At most one job waits behind the running one (``submit`` blocks otherwise), so
    decoded fragments held for sealing stay bounded. A failed seal leaves its
    fragments published (no row is lost); the error is raised by the next
    ``check``/``wait`` (the next append or flush).
    """

    def __init__(self, seal: Callable[[int], None]):
        self._seal = seal
        self._pool: ThreadPoolExecutor | None = None
        self._futures: list[Future] = []
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def submit(self, first_row: int) -> None:
        with self._lock:
            self._futures = [f for f in self._futures if not f.done()]
            waiting = self._futures[:-1]
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zarr-store-seal")
            self._futures.append(self._pool.submit(self._run, first_row))
        for future in waiting:
            future.result()

    def _run(self, first_row: int) -> None:
        try:
            self._seal(first_row)
        except BaseException as exc:  # noqa: BLE001 - handed to the writer's thread
            log.warning("sealing the segment at row %d failed: %r (its fragments stay published)",
                        first_row, exc)
            self._error = exc

    def check(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise StoreError(
                f"sealing a segment in the background failed ({type(error).__name__}: {error}); "
                f"its rows stay readable as fragments and are sealed again when the store is reopened"
            ) from error

    def pending(self) -> bool:
        return any(not f.done() for f in self._futures)

    def wait(self) -> None:
        with self._lock:
            futures, self._futures = self._futures, []
        for future in futures:
            future.result()
        self.check()

    def shutdown(self) -> None:
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


class Collector:
    """Deletes replaced units on a background thread: unlinking ~40 files is off the append path.

    Safe to lose: units no commit record names are deleted again by the next writer.
    """

    def __init__(self, kv):
        self._kv = kv
        self._pool = None
        self._lock = threading.Lock()

    def delete(self, prefix: str, keys: list[str]) -> None:
        """Deletes the unit at ``prefix``, whose ``keys`` are those :func:`.units.unit_keys` names."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zarr-store-gc")
            self._pool.submit(self._kv.delete_unit, prefix, keys)

    def wait(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
