"""Progress of a long command on stderr: a tqdm bar on a terminal, a plain line now and then in logs.
Nothing here imports torch. Design: docs/datasets.md#export.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

RATE_AFTER_S = 1.0  # a line gives a rate only once the work has taken this long


class Progress:
    """``update(n)`` after each chunk; ``close()`` at the end (prints the final count in logs).

    On a terminal this is a tqdm bar; otherwise (CI, ``nohup``, a pipe) one line every
    ``every_s`` seconds, so logs stay readable and still show that work goes on.
    """

    def __init__(self, desc: str, total: int | None = None, unit: str = "rows", *, enabled: bool = True,
                 stream=None, every_s: float = 10.0) -> None:
        self.desc, self.total, self.unit = desc, total, unit
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.every_s = every_s
        self.done = 0
        self._bar = None
        self._started = self._last_line = time.monotonic()
        if enabled and getattr(self.stream, "isatty", lambda: False)():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, file=self.stream, dynamic_ncols=True)

    def set_total(self, total: int | None, *, starts_clock: bool = True) -> None:
        """The work's size, once known; said before any of it is done, the rate's clock starts here:
        opening a buffer and importing what reads it took 2.7 s, and an export of 3,008 rows in 0.04 s
        after it said 946 rows/s. ``starts_clock=False``: the size comes with the first piece done."""
        if self.done == 0 and starts_clock:
            self._started = time.monotonic()
        self.total = total
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()

    def update(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.enabled and time.monotonic() - self._last_line >= self.every_s:
            self._last_line = time.monotonic()
            self._line()

    def _line(self) -> None:
        of = f"/{self.total}" if self.total is not None else ""
        elapsed = time.monotonic() - self._started
        # a rate over a few milliseconds is noise ("512/512 rows (61222048 rows/s)" for a small convert)
        pace = f"{self.done / elapsed:.0f} {self.unit}/s" if elapsed >= RATE_AFTER_S else f"in {elapsed:.2f} s"
        print(f"[{self.desc}] {self.done}{of} {self.unit} ({pace})", file=self.stream, flush=True)

    def close(self, *, failed: bool = False) -> None:
        """Ends the progress; ``failed``: the work stopped on an error, so no final count is printed."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.enabled and not failed:
            self._line()
        self.enabled = False


def progress_reporter(desc: str, unit: str, *, quiet: bool = False) -> Callable[[int, int], None] | None:
    """A ``progress(done, total)`` callback (what ``storage.reports`` and ``convert`` call) over a
    :class:`Progress`; None when ``quiet``."""
    if quiet:
        return None
    progress = Progress(desc, unit=unit)

    def report(done: int, total: int) -> None:
        # the first report comes after its piece of work: the clock started with this reporter, just before
        # the work (a one-segment convert said it took "0.00 s")
        progress.set_total(total, starts_clock=False)
        progress.update(done - progress.done)
        if done >= total:
            progress.close()

    return report
