"""Argument checks that commands make before their heavy imports, so a typo is answered at once.
Design: docs/architecture.md#the-command-line.
"""

from __future__ import annotations

from pathlib import Path

from rlhf_pipeline.storage import buffer_inside


def buffer_path_problem(location: str) -> str | None:
    """What is wrong with ``location`` as a buffer to read, when a look at the file system tells:
    a local path that does not exist, or a run directory given for its ``buffer/``; else None
    (URLs and everything else are checked when the buffer is opened)."""
    if "://" in location:
        return None
    path = Path(location)
    if not path.exists():
        return f"{location} does not exist"
    if (path / "settings.json").is_file() and (run_buffer := buffer_inside(location)) is not None:
        return f"{location} is a run directory, not a buffer: did you mean {run_buffer}?"
    return None
