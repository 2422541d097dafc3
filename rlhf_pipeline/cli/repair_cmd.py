"""``rlhf-pipeline repair PATH [--apply] [--json]``: rebuild a damaged buffer's published state.

A dry run by default: it says what it found and what it would write. ``--apply`` writes
it, under the store's writer lock (stop the writer first). A memmap store's manifest and
state slots are rebuilt from its segment files; a Zarr store's commit record from its
units. Nothing is deleted: the files it replaces are copied to ``repair-<time>/`` inside
the store. It reports what it could not recover (missing segments, chunks that fail their
checksum), naming files and rows. Works on a single store or every shard of a run's buffer.

Only what a publish record covered is published. With an intact record (a memmap state
slot, a Zarr commit record), rows past it were never acknowledged: a live writer's append in
flight (it holds the writer lock, and the note names its process), or what a killed writer left
(a collector writes that round again, and the next writer discards them). Repair leaves them,
and a note counts them; that alone is nothing to repair. Without a record, every
readable row is kept at its row id, and rows between readable ones that no file holds stay
published as lost (reads of them raise), so no append reuses a row id a readable row holds.

Exit code: 0 when nothing needs repair (or ``--apply`` repaired everything), 1 when
something needs repair (dry run) or cannot be recovered, 2 on errors.

A Zarr store (or a buffer of shards) at an ``s3://`` or ``az://`` URL is repaired the same way,
under the store's leased writer lock: a live writer keeps ``--apply`` out, and the record is
written only over the version repair read (``storage/zarr/repair.py``). Other URL schemes have no
writer lock across machines: repair reports what it found there but writes nothing.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("path", help="the buffer: a memmap directory, a Zarr store, or a directory of shard-NNNN "
                                     "stores; a Zarr store or a prefix of shards may be an s3:// or az:// URL")
    parser.add_argument("--apply", action="store_true", help="write the repair (default: a dry run)")
    parser.add_argument("--json", action="store_true", help="print a JSON list, one object per store")
    parser.add_argument("--quiet", action="store_true", help="no progress")


def run(args: argparse.Namespace) -> int:
    import json
    import sys
    import warnings

    from rlhf_pipeline.cli.progress import progress_reporter
    from rlhf_pipeline.storage.buffers import repair_buffer
    from rlhf_pipeline.storage.errors import StoreError, StoreLockedError

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # repair reports the damage itself
        try:
            reports = repair_buffer(args.path, apply=args.apply,
                                    progress=progress_reporter("repair", "parts", quiet=args.quiet))
        except StoreLockedError as exc:
            held = f"{args.path} is being written by {exc.holder}" if exc.holder else str(exc).split(";")[0]
            print(f"rlhf-pipeline repair: {held}; repair --apply needs the store's writer lock: stop that writer (or "
                  f"wait until its lease runs out), then run repair again; nothing was written", file=sys.stderr)
            return 2
        except StoreError as exc:
            print(f"rlhf-pipeline repair: {exc}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps([r.to_json() for r in reports]))
    else:
        print("\n".join(r.format() for r in reports))
    if any(r.unrecoverable for r in reports):
        return 1
    return 1 if (not args.apply and any(r.needed for r in reports)) else 0
