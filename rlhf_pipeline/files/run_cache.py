"""A run at a URL copied down into this machine's cache, for ``plot``, which reads a finished or
running run's settings and metrics as files: local disk only a cache of the URL.

A metrics log kept as part objects (``learn/metrics.py``) is joined back into its ``.jsonl`` file.
Every copy is written atomically, so a command killed midway leaves a cache the next one refreshes.
Design: docs/object-storage.md#a-whole-run-at-a-url.
"""

from __future__ import annotations

from pathlib import Path

from rlhf_pipeline.files.log_parts import read_log_lines
from rlhf_pipeline.files.run_paths import RunLocationError, RunPaths, is_url
from rlhf_pipeline.files.run_store import LocalRunStore

PARTS = ".parts"


def local_copy(location: str | Path) -> Path:
    """``location`` itself when it is a directory (or a file); for a run at a URL, its cache
    directory holding ``settings.json``, ``pipeline.py``, ``metrics.jsonl`` and the collectors'
    metrics as they are now."""
    if not is_url(str(location)):
        return Path(location)
    paths = RunPaths.at_url(str(location))
    store, cache = paths.store, LocalRunStore(paths.root)
    if store.read("settings.json") is None and not store.list("metrics.jsonl" + PARTS):
        raise RunLocationError(f"{paths.url} holds no run (no settings.json, no metrics): give the URL a run "
                                f"was started at, --home URL plus its --run-name")
    # branch.json and settings_history.json: plot marks a branch's step and a resume's
    for key in ("settings.json", "pipeline.py", "branch.json", "settings_history.json"):
        _copy(store, cache, key)
    _join_log(store, cache, "metrics.jsonl")
    for name in store.list("collector"):
        if name.endswith(".jsonl" + PARTS):
            _join_log(store, cache, f"collector/{name.removesuffix(PARTS)}")
    return paths.root


def _copy(store, cache: LocalRunStore, key: str) -> None:
    data = store.read(key)
    if data is None:
        cache.delete(key)
    else:
        cache.write(key, data, durable=False)


def _join_log(store, cache: LocalRunStore, key: str) -> None:
    lines = read_log_lines(store, key)
    cache.write(key, "".join(line + "\n" for line in lines).encode("utf-8"), durable=False)
