"""Argument checks that commands make before their heavy imports, so a typo is answered at once."""

from __future__ import annotations

from pathlib import Path


def buffer_path_problem(location: str) -> str | None:
    """What is wrong with ``location`` as a buffer to read, when a look at the file system tells:
    a local path that does not exist, or a run directory given for its ``buffer/``; else None
    (URLs and everything else are checked when the buffer is opened)."""
    if "://" in location:
        return None
    path = Path(location)
    if not path.exists():
        return f"{location} does not exist"
    if (path / "buffer").is_dir() and (path / "settings.json").is_file():
        return f"{location} is a run directory, not a buffer: did you mean {path / 'buffer'}?"
    return None
