"""Waiting on a file the other side rewrites: poll soon when the wait is hurried, else back off.

Design: docs/architecture.md#polling.
"""

from __future__ import annotations

import threading
import time

FIRST_POLL_S = 0.001
FAST_POLLING_S = 0.25  # longer than a learner step or a collection round of a small model


class PollBackoff:
    """Sleeps between the polls of one wait (docs/architecture.md#polling).

    The interval doubles from ``first_s`` up to ``max_s``. ``hurry``: a sleep ends as soon as the
    event is set, and the interval starts again from ``first_s`` then. Without it the first
    ``fast_s`` seconds poll every ``first_s``. One object per wait, or :meth:`reset` when the
    awaited thing came.
    """

    def __init__(self, max_s: float, *, first_s: float = FIRST_POLL_S, fast_s: float = FAST_POLLING_S,
                 hurry: threading.Event | None = None) -> None:
        if max_s <= 0:
            raise ValueError(f"the longest poll interval must be > 0 seconds, got {max_s}")
        self.max_s = max_s
        self.first_s = min(first_s, max_s)
        self.fast_s = fast_s
        self.hurry = hurry
        self.reset()

    def sleep(self) -> None:
        """Sleeps until the next poll."""
        if self.hurry is not None:
            self._sleep_hurried(self.hurry)
            return
        if self._fast_until is None:
            self._fast_until = time.monotonic() + self.fast_s
        interval = self.next_s
        if time.monotonic() >= self._fast_until:
            self.next_s = min(self.next_s * 2, self.max_s)
        time.sleep(interval)

    def _sleep_hurried(self, hurry: threading.Event) -> None:
        if hurry.is_set() and not self._hurried:
            self._hurried = True
            self.next_s = self.first_s
        interval, self.next_s = self.next_s, min(self.next_s * 2, self.max_s)
        if self._hurried:
            time.sleep(interval)
        else:
            self._hurried = hurry.wait(interval)
            if self._hurried:
                self.next_s = self.first_s  # polls now, then soon

    def reset(self) -> None:
        self.next_s = self.first_s
        self._fast_until: float | None = None  # set by the wait's first sleep
        self._hurried = False
