"""A JSON-lines log at a URL, where nothing can be appended: numbered part objects
``<key>.parts/00000000.jsonl``, ``00000001.jsonl``, ... read in order as one log (in a run
directory, the one file the writer appends to).

Torch-free, so the launcher can summarise a finished run's metrics without importing torch; the
writer is ``learn/metrics.py``'s :class:`~rlhf_pipeline.learn.metrics.MetricsWriter`.
Design: docs/object-storage.md#a-whole-run-at-a-url.
"""

from __future__ import annotations

import json

from rlhf_pipeline.files.run_store import RunStore


def part_key(key: str, number: int) -> str:
    return f"{key}.parts/{number:08d}.jsonl"


def part_numbers(store: RunStore, key: str) -> list[int]:
    """The numbers of ``key``'s parts, oldest first."""
    names = store.list(f"{key}.parts")
    return sorted(int(name.split(".")[0]) for name in names if name.endswith(".jsonl") and name.split(".")[0].isdigit())


def read_log_lines(store: RunStore, key: str) -> list[str]:
    """Every line of the log ``key``: the file a run directory appends to, or at a URL its parts in
    order (a line a kill cut short may end in a replaced character)."""
    whole = [store.read(key), *(store.read(part_key(key, n)) for n in part_numbers(store, key))]
    return b"".join(data or b"" for data in whole).decode("utf-8", errors="replace").splitlines()


def read_log_records(store: RunStore, key: str) -> list[dict]:
    """The JSON objects of the log ``key``, in order (:func:`json_records`)."""
    return json_records(read_log_lines(store, key))


def json_records(lines: list[str]) -> list[dict]:
    """The lines that are JSON objects. Another line is skipped: the last line of a writer killed
    mid-write, which its resume drops too (``learn/metrics.py``)."""
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records
