"""``rlhf-pipeline inspect PATH [--json]``: what a replay buffer holds, from its own metadata.

Opens the buffer read-only (no lock, so it is safe beside a running writer) with
whichever backend recognizes it (a run's buffer of ``shard-NNNN`` stores, one per
collector, is summed over its shards), and prints rows, groups, tokens, rewards, bytes
and policy versions: a table by default, one JSON object with ``--json``.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("path", help="the buffer: a memmap directory, a Zarr store, or a directory of shard-NNNN stores")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    import json
    import sys

    from rlhf_pipeline.storage import StoreError, open_buffer

    try:
        with open_buffer(args.path, mode="r") as store:
            stats = store.stats()
    except StoreError as exc:
        print(f"rlhf-pipeline inspect: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(stats.to_json(), sort_keys=True))
    else:
        print(format_stats(stats))
    return 0


def _number(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n:.1f} TiB"


def format_stats(stats) -> str:
    """A two-column table of a ``StoreStats`` (what ``inspect`` prints without ``--json``)."""
    versions = ", ".join(f"v{v}: {n}" for v, n in sorted(stats.policy_versions.items())) or "-"
    rows = [
        ("location", stats.location),
        ("backend", stats.backend),
        ("rows held", f"{stats.rows}  (global ids {stats.first_row}..{stats.next_row - 1})"
         if stats.rows else "0"),
        ("rows ever written", str(stats.next_row)),
        ("groups", str(stats.groups)),
        ("prompt tokens", str(stats.prompt_tokens)),
        ("response tokens", str(stats.response_tokens)),
        ("reward mean / std", f"{_number(stats.reward_mean)} / {_number(stats.reward_std)}"),
        ("reward min / max", f"{_number(stats.reward_min)} / {_number(stats.reward_max)}"),
        ("policy versions", versions),
        ("segments", str(stats.segments)),
        ("bytes on disk", _bytes(stats.bytes_on_disk)),
        ("raw payload", _bytes(stats.raw_bytes)),
        ("compression ratio", f"{stats.compression_ratio:.3f}"),
        ("optional fields", ", ".join(stats.optional_fields) or "-"),
    ]
    rows += [(key.replace("_", " "), str(value)) for key, value in sorted(stats.extra.items())]
    width = max(len(key) for key, _ in rows)
    return "\n".join(f"{key:<{width}}  {value}" for key, value in rows)
