"""When a server the collector started and that died (``kill -9``, the OOM killer, a hang past
``generation.timeout_s``) is started again: :class:`Restarts`, a bounded exponential backoff. Its work
is not lost (every request is whole and seeded, the weights it held are a file); what is bounded is how
often that is tried, so an engine that cannot live stops the collector with one line naming the setting.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from rlhf_pipeline.generation.engine import EngineDied, EngineFailed

MAX_DELAY_S = 60.0
"""The longest wait before one restart, whatever the backoff has doubled to."""
HUNG_AFTER_S = 300.0
"""A server that answers no request (a round's completions, a weight load) within this long hangs:
the default; a first round's warm-up (~9 s on these CPUs) is far below."""


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass
class Restarts:
    """How often, and after how long, an engine's dead process is started again; see the module docstring."""

    max_restarts: int = 3
    """Restarts in a row (without an answered call between them) before giving up; 0: never restart."""
    backoff_s: float = 1.0
    """Seconds before the first restart in a row; each further one waits twice as long (at most 60 s)."""
    hung_after_s: float | None = HUNG_AFTER_S
    """No reply to a request this long: the server hangs, and is killed and restarted as one that
    died; None: wait for ever."""
    announce: Callable[[str], None] = field(default=_to_stderr, repr=False)
    """Where the line said before each restart goes (the collector sets its console's)."""
    in_a_row: int = 0
    """Restarts since the engine last answered a call."""

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"setting 'generation.retries' must be >= 0 (0: never restart the engine), "
                             f"got {self.max_restarts}")
        if not self.backoff_s >= 0:
            raise ValueError(f"setting 'generation.backoff_s' must be >= 0 (seconds), got {self.backoff_s}")
        if self.hung_after_s is not None and not self.hung_after_s > 0:
            raise ValueError(f"setting 'generation.timeout_s' must be > 0 (seconds) or none (wait for ever), "
                             f"got {self.hung_after_s}")

    def next_delay_s(self, died: EngineDied, engine: str = "generation") -> float:
        """Counts one more restart and returns how long to wait before it; EngineFailed, naming the
        setting and keeping ``died``'s message (the engine's log), when none is left."""
        if self.in_a_row >= self.max_restarts:
            tried = (f"after {self.in_a_row} restarts in a row" if self.in_a_row else "and is not restarted")
            raise EngineFailed(f"the {engine} engine died {tried} (generation.retries={self.max_restarts}; "
                               f"raise it to try more, then rerun to resume): {died}") from None
        self.in_a_row += 1
        return min(self.backoff_s * 2 ** (self.in_a_row - 1), MAX_DELAY_S)

    def answered(self) -> None:
        """The engine answered a call: the next death starts a new run of restarts."""
        self.in_a_row = 0
