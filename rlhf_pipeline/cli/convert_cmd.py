"""``rlhf-pipeline convert SRC DST --to zarr|memmap``: copy a buffer to the other backend.

Streams one segment at a time (memory stays at about one segment), shows progress,
and with ``--verify`` re-reads both buffers and compares every row. The source is
opened read-only, so converting beside a running writer copies the rows published
when the conversion started.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("src", help="existing buffer (memmap directory, Zarr store, .zip or URL)")
    parser.add_argument("dst", help="where to create the new buffer (must not exist)")
    parser.add_argument("--to", required=True, choices=("zarr", "memmap"), help="backend of the new buffer")
    parser.add_argument("--codec", default=None,
                        help="Zarr codec preset: blosc-zstd (default), blosc-lz4, zstd, none")
    parser.add_argument("--segment-rows", type=int, default=None,
                        help="rows per segment in the new buffer (default: the source's)")
    parser.add_argument("--verify", action="store_true", help="compare every row afterwards")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    import sys

    from tqdm import tqdm

    from rlhf_pipeline.storage import StoreError
    from rlhf_pipeline.storage.convert import convert, verify

    options = {}
    if args.codec is not None:
        if args.to != "zarr":
            print("rlhf-pipeline convert: --codec applies to --to zarr only", file=sys.stderr)
            return 2
        options["codec"] = args.codec
    bar = tqdm(unit="rows", desc=f"convert -> {args.to}", disable=args.quiet, file=sys.stderr)

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    try:
        stats = convert(args.src, args.dst, args.to, segment_rows=args.segment_rows, progress=progress,
                        **options)
        bar.close()
        if args.verify:
            verify(args.src, args.dst)
    except (StoreError, FileExistsError, ValueError) as exc:
        bar.close()
        print(f"rlhf-pipeline convert: {exc}", file=sys.stderr)
        return 2
    checked = ", every row verified" if args.verify else ""
    print(f"{args.dst}: {stats.rows} rows in {stats.segments} segments, {stats.bytes_on_disk} bytes on disk "
          f"({stats.compression_ratio:.2f}x of the raw payload){checked}")
    return 0
