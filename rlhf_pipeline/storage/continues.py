"""Which parent rows a branch's buffer continues, read without torch: ``<run>/buffer.continues.json``.

The file (see ``storage/continued.py`` for the reader of such a buffer) is written once, by the
branch's first online start (``runs/branch_online.py``); every later start, and ``open_buffer``,
read it to know whether the buffer continues another.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlhf_pipeline.storage.errors import StoreCorruptedError

CONTINUES_SUFFIX = ".continues.json"
CONTINUES_FORMAT = 1


def continues_file(buffer: str | Path) -> Path:
    """``<run>/buffer.continues.json`` for the buffer ``<run>/buffer``."""
    buffer = Path(str(buffer).rstrip("/"))
    return buffer.with_name(buffer.name + CONTINUES_SUFFIX)


def continued_rows(buffer: str | Path) -> dict[str, Any] | None:
    """What a local buffer directory continues (module docstring), or None when it continues none."""
    if "://" in str(buffer):
        return None
    try:
        data = json.loads(continues_file(buffer).read_text())
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not isinstance(data, dict) or "parent_buffer" not in data or not isinstance(data.get("rows"), dict):
        raise StoreCorruptedError(f"{continues_file(buffer)} is damaged (no 'parent_buffer' and 'rows'); "
                                  f"it was written when the branch first ran online: restore it")
    return data


def write_continued_rows(buffer: Path, parent_buffer: str, rows: dict[str, int]) -> None:
    from rlhf_pipeline.files.atomic import write_atomic

    text = json.dumps({"format": CONTINUES_FORMAT, "parent_buffer": str(parent_buffer),
                       "rows": {str(k): int(v) for k, v in rows.items()}}, indent=2, sort_keys=True).encode()
    write_atomic(continues_file(buffer), lambda f: f.write(text))
