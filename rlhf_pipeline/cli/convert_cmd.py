"""``rlhf-pipeline convert SRC DST --to zarr|memmap``: copy a buffer to the other backend.

Takes what ``inspect`` takes: a single store, a saved selection (its rows copied into a store of
their own), or a run's buffer of ``shard-NNNN`` stores,
which is converted shard by shard into ``DST/shard-NNNN`` (a sharded buffer again, which
a learner reads the same way); a shard still being made is left out, saying so. Streams one
segment at a time (memory stays at about one segment), shows progress, and with ``--verify``
re-reads both buffers and compares every row. The source is opened read-only, so converting
beside a running writer copies the rows published when the conversion started.
Design: docs/buffer-tools.md#convert.
"""

from __future__ import annotations

import argparse

from rlhf_pipeline.cli import CommandRefused
from rlhf_pipeline.cli.checks import add_run_argument, buffer_given, writable_output


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    add_run_argument(parser, "src",
                        help="existing buffer: memmap directory, Zarr store (.zip or URL), a directory of "
                             "shard-NNNN stores, or a run (its directory, URL or name): its buffer")
    parser.add_argument("dst", help="where to create the new buffer (must not exist)")
    parser.add_argument("--to", required=True, choices=("zarr", "memmap"), help="backend of the new buffer")
    parser.add_argument("--codec", default=None,
                        help="Zarr codec preset: blosc-zstd (default), blosc-lz4, zstd, none")
    parser.add_argument("--segment-rows", type=int, default=None,
                        help="rows per segment in the new buffer (default: the source's)")
    parser.add_argument("--verify", action="store_true", help="compare every row afterwards")
    parser.add_argument("--quiet", action="store_true", help="no progress")


def run(args: argparse.Namespace) -> int:
    import os
    from contextlib import nullcontext

    from rlhf_pipeline.dataio.progress import progress_reporter
    from rlhf_pipeline.storage.buffers import is_sharded_buffer, shard_index, shard_key_of, shard_location, stores_in
    from rlhf_pipeline.storage.errors import StoreError
    from rlhf_pipeline.storage.new_buffer import check_zip_destination

    options = {}
    if args.codec is not None:
        if args.to != "zarr":
            raise CommandRefused("--codec applies to --to zarr only")
        options["codec"] = args.codec
    if "://" not in args.src and not os.path.exists(args.src):
        raise CommandRefused(f"{args.src} does not exist")
    if "://" in args.dst and args.to == "memmap":
        raise CommandRefused(f"{args.dst} is a URL, where a buffer is a Zarr store: give --to zarr")
    args.src = buffer_given(args.src, "convert")
    problem = _destination_problem(args.src, args.dst)
    if problem is not None:
        raise CommandRefused(problem)
    writable_output(args.dst, "DST")
    skipped: dict[str, str] = {}
    sharded = is_sharded_buffer(args.src)
    try:
        check_zip_destination(args.dst, "sharded" if sharded else args.to)
    except ValueError as exc:
        raise CommandRefused(str(exc)) from None
    try:  # the shards a learner reads: one still being made is left out, as the learner does
        shards = [(shard_index(shard_key_of(path)), path) for _, path in stores_in(args.src, skipped)] \
            if sharded else []
    except StoreError as exc:
        raise CommandRefused(str(exc)) from None

    from rlhf_pipeline.storage.convert import convert, verify  # imports torch: after the arguments
    from rlhf_pipeline.storage.new_buffer import new_buffer_at

    lines = []
    try:
        # a buffer of shards appears whole or not at all, as each store does (convert())
        with new_buffer_at(args.dst, "convert") if sharded else nullcontext(args.dst) as root:
            pairs = [(path, shard_location(root, k), shard_location(args.dst, k)) for k, path in shards] if sharded \
                else [(args.src, args.dst, args.dst)]
            for src, dst, named in pairs:
                progress = progress_reporter(f"convert {os.path.basename(src.rstrip('/'))} -> {args.to}", "rows",
                                             quiet=args.quiet)
                stats = convert(src, dst, args.to, segment_rows=args.segment_rows, progress=progress, **options)
                if args.verify:
                    verify(src, dst)
                lines.append(_describe(named, stats, args.verify))
    except (FileExistsError, StoreError, ValueError) as exc:  # a DST made meanwhile by another process, too
        raise CommandRefused(str(exc)) from None
    lines += [f"{name}: not converted: {why}" for name, why in sorted(skipped.items())]
    print("\n".join(lines))
    return 0


def _destination_problem(src: str, dst: str) -> str | None:
    """Why ``dst`` cannot take the converted buffer, in words for the command line; else None."""
    import os

    from rlhf_pipeline.storage.buffers import buffer_holding, within

    if within(dst, src):
        if within(src, dst):
            return (f"{dst} is the source: convert writes a copy of it in the other backend to a new path; "
                    f"choose a DST that does not exist")
        return f"{dst} is inside the source {src}; choose a DST outside it"
    if "://" not in dst and os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
        return f"{dst} already holds files; convert writes a new buffer: choose a path that does not exist"
    holder = buffer_holding(dst)
    if holder is not None:
        return (f"{dst} is inside the buffer {holder}: a store written there becomes part of that buffer (a shard "
                f"of a run's buffer is read by its learner); choose a path outside it")
    return None


def _describe(dst: str, stats, verified: bool) -> str:
    checked = ", every row verified" if verified else ""
    counted = "the objects' sizes" if "://" in dst else "as du counts them"
    return (f"{dst}: {stats.rows} rows in {stats.segments} segments, {stats.bytes_on_disk} bytes on disk ({counted}), "
            f"disk/raw {stats.disk_bytes_per_raw_byte:.3f} (raw payload {stats.raw_bytes} bytes; "
            f"below 1: smaller than the raw payload){checked}")
