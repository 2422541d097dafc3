"""What a learner waiting for rows says: one line once it has waited ``wait_report_s``.

A learner waits for its next batch while its sampler has too few new rows; it waits up to
``data_timeout_s`` and then stops. A wait that long with nothing said looks like a hang, so
past ``wait_report_s`` it says, in one line, what it waits for (the new rows its next draw
needs, the rows each shard holds past what it took in) and why it cannot have them yet (no row
written at all: the collectors are starting; none written since it began waiting; or they write
too slowly), then says it again each time the wait doubles.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from rlhf_pipeline.coordination.pacing import PacingPublisher


class WaitReport:
    """The learner's ``on_wait`` (called every 0.1 s while it waits for a batch): renews the wait
    in ``pacing.json`` (``PacingPublisher.waiting``) and says what it waits for once it is long.

    ``shard_rows()`` gives the rows each shard has published, as the learner's store last saw them;
    ``lacking()`` what the draw it waits for still lacks, from a sampler that says it
    (``LearnerIntake.lacking``; None: the collectors go by the stall rule)."""

    def __init__(self, pacing: PacingPublisher, shard_rows: Callable[[], dict[str, int]], after_s: float,
                 say: Callable[[str], None] | None = None,
                 lacking: Callable[[], tuple[int, int, dict[str, int]]] | None = None) -> None:
        self.pacing = pacing
        self.shard_rows = shard_rows
        self.lacking = lacking
        self.after_s = after_s
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self._wait: float | None = None  # waiting_since of the wait being reported
        self._next_at = 0.0
        self._rows_at_start: int | None = None

    def __call__(self) -> None:
        self.pacing.waiting(None if self.lacking is None else self.lacking())
        intake = self.pacing.intake
        since = intake.waiting_since
        if since is None:
            return
        if since != self._wait:  # a new wait
            self._wait, self._next_at = since, self.after_s
            self._rows_at_start = self._total_rows()
        waited = time.time() - since
        if waited >= self._next_at:
            self.say(self.line(waited))
            self._next_at = 2 * max(waited, self.after_s)

    def line(self, waited: float) -> str:
        intake = self.pacing.intake
        rows = self._rows() or {}
        held = {key: rows.get(key, 0) - intake.consumed.get(key, 0) for key in sorted(set(rows) | set(intake.consumed))}
        shards = ", ".join(f"{key}: {n}" for key, n in held.items()) or "no shard yet"
        total = sum(rows.values()) if rows else None
        if not total:  # nothing written at all: collectors still starting, not (yet) a collector that is gone
            why = ("no collector has written a row yet: they are starting (one with a generation engine of its own, "
                   "such as vLLM, writes its first round once the engine is up, tens of seconds; its log says when)")
        elif self._rows_at_start is None:
            why = "the collectors have not written them yet"
        elif total == self._rows_at_start:
            why = ("no collector has written a row since the wait began: is one running? its log says "
                   "what it waits for")
        else:
            why = f"collectors wrote {total - self._rows_at_start} rows since it began, too few so far"
        return (f"[learner] waiting {waited:.1f} s for the batch of step {intake.step + 1}: its next draw needs "
                f"{intake.next_draw_rows} new rows; the buffer holds {sum(held.values())} past the rows taken in "
                f"({shards}); {why} (it stops after learner.data_timeout_s)")

    def _rows(self) -> dict[str, int] | None:
        try:
            return self.shard_rows()
        except RuntimeError:  # the prefetch thread refreshed the shard list meanwhile: next call
            return None

    def _total_rows(self) -> int | None:
        rows = self._rows()
        return None if rows is None else sum(rows.values())
