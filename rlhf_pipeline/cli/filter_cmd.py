"""``rlhf-pipeline filter SRC DST --where EXPR``: keep rows or whole groups of a buffer.

The result is a new buffer holding the kept rows (byte-identical, same backend or ``--to``),
or with ``--selection`` a saved selection that any command reading a buffer opens in place
(``inspect``, the learner, ``replay --buffer``). ``--dry-run`` only counts. The expression
language is described by ``--list-names`` and in ``rlhf_pipeline/storage/where.py``; the
source is opened read-only and never modified. Design: docs/curation.md#filter.
"""

from __future__ import annotations

import argparse

from rlhf_pipeline.cli import CommandRefused
from rlhf_pipeline.cli.checks import add_run_argument

EXAMPLES = """examples:
  rlhf-pipeline filter storage/run/buffer storage/informative --where 'group_reward_std > 0'
  rlhf-pipeline filter storage/run/buffer storage/late.sel --selection \\
      --where 'policy_version >= 10 and response_length < 512'
  rlhf-pipeline filter storage/run/buffer storage/short --groups --where 'response_length <= 256'
"""


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.epilog = EXAMPLES
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_run_argument(parser, "src", nargs="?",
                        help="the buffer to read: a store, a run's buffer/ of shards, a saved selection, or a "
                             "run (its directory, URL or name): its buffer")
    parser.add_argument("dst", nargs="?", help="where to write the result (must not exist)")
    parser.add_argument("--where", help="condition a row (or group, with --groups) must meet to be kept; "
                                        "see --list-names")
    parser.add_argument("--groups", action="store_true",
                        help="keep a group whole when every one of its rows meets the condition, "
                             "drop it whole otherwise")
    parser.add_argument("--selection", action="store_true",
                        help="save a selection of the source's rows instead of copying them")
    parser.add_argument("--to", choices=("zarr", "memmap"), help="backend of the new buffer (default: the source's)")
    parser.add_argument("--codec", help="Zarr codec preset of the new buffer: blosc-zstd, blosc-lz4, zstd, none")
    parser.add_argument("--segment-rows", type=int, help="rows per segment of the new buffer (default: the source's)")
    parser.add_argument("--dry-run", action="store_true", help="count what would be kept; write nothing")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.add_argument("--list-names", action="store_true", help="print the names --where can use, and exit")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    import json
    import sys
    import time

    if args.list_names:
        from rlhf_pipeline.storage.where import describe_names

        print(describe_names())
        return 0
    if args.src is None or args.where is None:
        raise CommandRefused("give SRC, DST (or --dry-run) and --where; --list-names shows the names a condition "
                             "can use")
    if args.dry_run == (args.dst is not None):
        raise CommandRefused("give DST, or --dry-run to only count" if args.dst is None
                             else "--dry-run writes nothing: drop DST")
    options = {}
    if args.codec is not None:
        if (args.to or "") != "zarr":
            raise CommandRefused("--codec applies to a Zarr result: give --to zarr with it")
        options["codec"] = args.codec
    if args.segment_rows is not None:
        options["segment_rows"] = args.segment_rows
    # before the heavy imports below: a typo in the path or the condition is answered at once
    from rlhf_pipeline.cli.checks import buffer_given, buffer_path_problem, writable_output
    from rlhf_pipeline.storage.where import WhereError, parse_where

    problem = buffer_path_problem(args.src)
    if problem is not None:
        raise CommandRefused(problem)
    if args.dst is not None:
        writable_output(args.dst, "DST")
    args.src = buffer_given(args.src, "filter")
    try:
        parse_where(args.where)
    except WhereError as exc:
        raise CommandRefused(str(exc)) from None

    from tqdm import tqdm

    from rlhf_pipeline.storage import StoreError
    from rlhf_pipeline.storage.errors import LocalOnlyStoreError
    from rlhf_pipeline.storage.filtering import filter_buffer

    bars: dict[str, tqdm] = {}
    interactive = sys.stderr.isatty()
    last_line = {"at": 0.0}

    def progress(stage: str, done: int, total: int) -> None:
        if args.quiet:
            return
        if not interactive:  # a log: a line every 10 s and at the end of each pass
            now = time.monotonic()
            if done == total or now - last_line["at"] >= 10.0:
                last_line["at"] = now
                print(f"[filter] {stage}: {done}/{total} rows", file=sys.stderr, flush=True)
            return
        bar = bars.get(stage)
        if bar is None:
            bar = bars[stage] = tqdm(total=total, unit="rows", desc=stage, file=sys.stderr)
        bar.update(done - bar.n)

    try:
        result = filter_buffer(args.src, args.dst, args.where, whole_groups=args.groups, selection=args.selection,
                               to=args.to, progress=progress, **options)
    except LocalOnlyStoreError:  # its own words are for Python callers
        given = "--to memmap was given" if args.to == "memmap" else "the source is a memmap store"
        raise CommandRefused(f"{args.dst} is a URL, where a buffer is a Zarr store, and {given}: give --to zarr") \
            from None
    except (WhereError, StoreError, FileExistsError, ValueError) as exc:
        raise CommandRefused(str(exc)) from None
    finally:
        for bar in bars.values():
            bar.close()
    if args.json:
        print(json.dumps(result.to_json(), sort_keys=True))
        return 0
    share = result.rows_kept / result.rows_in if result.rows_in else 0.0
    print(f"kept {result.rows_kept} of {result.rows_in} rows ({share:.1%}), {result.groups_kept} of "
          f"{result.groups_in} groups")
    if result.rows_dropped_with_trajectories:
        print(f"{result.rows_dropped_with_trajectories} more rows met the condition but were dropped with their "
              f"trajectories: a trajectory of several turns is kept whole, only when every turn meets it (a condition "
              f"on trajectory_return, trajectory_end or trajectory_turns takes or leaves whole trajectories)")
    if result.output == "selection":
        print(f"{result.destination}: a selection of {result.source} (no rows copied); open it like any buffer")
        if (dropping := _retention_of_its_run(str(result.source))) is not None:
            print(f"note: the run of {result.source} drops old rows ({dropping}): the selection reads its rows in "
                  f"place, so it can be read only while the run holds them; filter without --selection copies them")
    elif result.output == "buffer":
        stats = result.stats
        print(f"{result.destination}: {stats.backend} buffer, {stats.rows} rows in {stats.segments} segments, "
              f"{stats.bytes_on_disk} bytes on disk")
    return 0


def _retention_of_its_run(source: str) -> str | None:
    """The retention rules of the run whose buffer (or shard) ``source`` is, as its ``inspect`` words them;
    None when it is no run's buffer or its run keeps every row."""
    from rlhf_pipeline.files.settings_history import saved_settings
    from rlhf_pipeline.runs.lineage import run_recording, run_store_at
    from rlhf_pipeline.storage.retention import RetentionSettings

    run = run_recording(source)
    if run is None:
        return None
    retention = RetentionSettings.from_json((saved_settings(run_store_at(run)) or {}).get("retention"))
    return f"retention.{retention.describe()}" if retention.enabled else None
