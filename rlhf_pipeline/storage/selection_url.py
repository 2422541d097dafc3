"""A saved selection (``storage/selection.py``) kept at an ``s3://`` or ``az://`` URL: the branch of
a run at a URL names the parent rows it reads this way (``runs/branch_url.py``).

Its files are the same three small objects under the URL (``selection.json``, ``rows.npy``,
``parts.npy``; the manifest uploaded last, so a selection is there whole or not at all). Opening
one fetches them into this machine's cache of the URL (``files/run_paths.cache_dir``) and opens
that copy; the rows it names are read in place from their stores, wherever those are (the parent's
Zarr shards at their URLs), and checked as for any selection. Nothing of the selection is cached
across openings: the files are a few bytes per row, fetched again each time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhf_pipeline.files.atomic import write_atomic
from rlhf_pipeline.storage.manifest import SELECTION_MANIFEST, read_json

_ROW_FILES = ("rows.npy", "parts.npy")


def _fs(url: str, storage_options: dict[str, Any] | None):
    import fsspec

    return fsspec.core.url_to_fs(url.rstrip("/"), **(storage_options or {}))


def fetch_selection(url: str, storage_options: dict[str, Any] | None = None) -> Path | None:
    """This machine's copy of the selection at ``url``; None when ``url`` holds no selection."""
    from rlhf_pipeline.files.run_paths import cache_dir

    fs, root = _fs(url, storage_options)
    try:
        manifest = fs.cat_file(f"{root}/{SELECTION_MANIFEST}")
    except FileNotFoundError:
        return None
    local = cache_dir(url.rstrip("/"))
    local.mkdir(parents=True, exist_ok=True)
    write_atomic(local / SELECTION_MANIFEST, lambda f: f.write(manifest), durable=False)
    named = read_json(local / SELECTION_MANIFEST, what="saved selection")
    for name in {named.get("rows_file", _ROW_FILES[0]), named.get("parts_file", _ROW_FILES[1])} - {None}:
        try:
            data = fs.cat_file(f"{root}/{name}")
        except FileNotFoundError:  # a selection of one store has no parts.npy
            (local / name).unlink(missing_ok=True)
            continue
        write_atomic(local / name, lambda f, data=data: f.write(data), durable=False)
    return local


def upload_selection(directory: Path, url: str, storage_options: dict[str, Any] | None = None) -> None:
    """Puts the selection written at ``directory`` under ``url``: its ids files, then its manifest."""
    fs, root = _fs(url, storage_options)
    for name in _ROW_FILES:
        if (directory / name).is_file():
            fs.pipe_file(f"{root}/{name}", (directory / name).read_bytes())
    fs.pipe_file(f"{root}/{SELECTION_MANIFEST}", (directory / SELECTION_MANIFEST).read_bytes())
