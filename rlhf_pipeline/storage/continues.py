"""Which parent rows a branch's buffer continues, read without torch: ``<run>/buffer.continues.json``.

The file is written once, by the branch's first online start (``runs/branch_online.py``); every later
start, and ``open_buffer``, read it. At a URL it is the object beside the buffer's prefix: one GET says
whether a buffer there continues another (none: a 404). The reader of such a buffer is :mod:`.continued`.

Design: docs/storage.md#a-buffer-that-continues-another.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlhf_pipeline.files.atomic import json_object
from rlhf_pipeline.files.run_store import LocalRunStore, RunStore
from rlhf_pipeline.storage.errors import StoreCorruptedError

CONTINUES_SUFFIX = ".continues.json"
CONTINUES_FORMAT = 1


def continues_file(buffer: str | Path) -> Path:
    """``<run>/buffer.continues.json`` for the buffer ``<run>/buffer``."""
    buffer = Path(str(buffer).rstrip("/"))
    return buffer.with_name(buffer.name + CONTINUES_SUFFIX)


def _store_and_key(buffer: str | Path, storage_options: dict[str, Any] | None = None) -> tuple[RunStore, str]:
    """The run store beside ``buffer`` (its directory's parent, or the URL prefix holding it) and the
    key of its continues object there."""
    if "://" in str(buffer):
        from rlhf_pipeline.files.object_run_store import ObjectRunStore

        home, _, name = str(buffer).rstrip("/").rpartition("/")
        return ObjectRunStore(home, storage_options=storage_options), name + CONTINUES_SUFFIX
    where = continues_file(buffer)
    return LocalRunStore(where.parent), where.name


def continued_rows(buffer: str | Path, storage_options: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """What a buffer (a directory or a URL prefix) continues, or None when it continues none
    (docs/storage.md#a-buffer-that-continues-another); ``storage_options``: the credentials for a URL,
    as the buffer's."""
    if "://" in str(buffer):
        from rlhf_pipeline.files.object_run_store import SCHEMES

        if not str(buffer).startswith(SCHEMES):
            return None  # file://, a zip...: runs (and so branches) live at s3:// and az:// URLs only
        if "/" not in str(buffer).split("://", 1)[1].strip("/"):
            return None  # a whole bucket: no run holds it, nothing beside it
    store, key = _store_and_key(buffer, storage_options)
    raw = store.read(key)
    if raw is None:
        return None
    data = json_object(raw)
    if data is None or "parent_buffer" not in data or not isinstance(data.get("rows"), dict):
        raise StoreCorruptedError(f"{store.describe(key)} is damaged (no 'parent_buffer' and 'rows'); "
                                  f"it was written when the branch first ran online: restore it")
    return data


def write_continued_rows(buffer: str | Path, parent_buffer: str, rows: dict[str, int]) -> None:
    store, key = _store_and_key(buffer)
    store.write(key, json.dumps({"format": CONTINUES_FORMAT, "parent_buffer": str(parent_buffer),
                                 "rows": {str(k): int(v) for k, v in rows.items()}}, indent=2, sort_keys=True).encode(),
                fence=False)  # at a URL one PUT: there or not
