"""Progress of a long command on stderr: a tqdm bar on a terminal, a line every few seconds in a log.

``progress = progress_reporter("verify", "segments")`` returns a ``progress(done, total)``
callback (what :mod:`rlhf_pipeline.storage.reports` and ``convert`` call); ``quiet=True``
returns None. Nothing here imports torch.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

LOG_EVERY_S = 10.0


def progress_reporter(desc: str, unit: str, *, quiet: bool = False,
                      every_s: float = LOG_EVERY_S) -> Callable[[int, int], None] | None:
    if quiet:
        return None
    stream = sys.stderr
    if getattr(stream, "isatty", lambda: False)():
        from tqdm import tqdm

        bar = tqdm(desc=desc, unit=f" {unit}", file=stream, leave=False, mininterval=0.5)

        def on_tty(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)
            if done >= total:
                bar.close()

        return on_tty
    last = [time.monotonic()]  # the first line after every_s: a quick command prints only its last

    def in_log(done: int, total: int) -> None:
        now = time.monotonic()
        if done >= total or now - last[0] >= every_s:
            last[0] = now
            print(f"[{desc}] {done}/{total} {unit}", file=stream, flush=True)

    return in_log
