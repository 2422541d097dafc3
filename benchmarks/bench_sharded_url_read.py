"""One learner rank reading a buffer of S shards at a URL prefix: padded batches/s as S grows,
with the reader re-reading every shard's commit record (and listing the prefix) before every
batch (``refresh_interval_s=0``) against at most once a second (the object-store default).

Writes S shards of ``--rows`` synthetic GRPO completions each (the storage benchmark's shapes)
under a fresh prefix at LOCATION (``LOCATION/sharded-<id>/shard-NNNN``), opens their union
read-only with ``open_buffer`` as the learner does, warms its cache with one pass, then times
``--batches`` rounds of ``len(reader)`` (the refresh a learner's sampler asks for) followed by
``read_padded`` of 64 random positions. The prefix is deleted afterwards.

    AWS_ACCESS_KEY_ID=k AWS_SECRET_ACCESS_KEY=s python benchmarks/bench_sharded_url_read.py \\
        s3://bench-bucket/sharded --storage-option endpoint_url=http://127.0.0.1:5055 --shards 1 4 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("location", help="s3://BUCKET/prefix to write under")
    parser.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rows", type=int, default=256, help="completions per shard")
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--intervals", type=float, nargs="+", default=[0.0, 1.0],
                        help="refresh_interval_s values to compare")
    args = parser.parse_args(argv)

    import fsspec
    import torch

    from rlhf_pipeline.bench.storage_bench import parse_storage_options
    from rlhf_pipeline.schema import StoreSchema
    from rlhf_pipeline.storage import open_buffer
    from rlhf_pipeline.storage.zarr import ZarrTrajectoryStore
    from rlhf_pipeline.storage.zarr.object_store import object_store_options
    from rlhf_pipeline.schema.synthetic import synthetic_batches

    torch.set_num_threads(1)
    options = dict(parse_storage_options(args.storage_option))
    root = f"{args.location.rstrip('/')}/sharded-{uuid.uuid4().hex[:12]}"
    print("| shards | refresh_interval_s | batches/s | rows/s | ms per batch (median, range) |")
    print("|---|---|---|---|---|")
    try:
        written = 0
        for shards in args.shards:
            for index in range(written, shards):  # shards accumulate: 1, then 4, then 16 ...
                with ZarrTrajectoryStore.create(f"{root}/shard-{index:04d}", StoreSchema(("advantage",)),
                                                storage_options=options) as writer:
                    for batch in synthetic_batches(args.rows, group_size=8, prompt_len=(32, 256),
                                                   response_len=(16, 1024), batch_size=256, seed=index,
                                                   optional_fields=("advantage",)):
                        writer.append(batch)
            written = max(written, shards)
            for interval in args.intervals:
                reader = open_buffer(root, storage_options=options, refresh_interval_s=interval)
                total = len(reader)
                generator = torch.Generator().manual_seed(1)
                reader.read_padded(torch.arange(total))  # decodes every unit into the cache
                times = []
                for _ in range(args.batches):
                    positions = torch.randint(0, total, (64,), generator=generator)
                    start = time.perf_counter()
                    len(reader)
                    reader.read_padded(positions, index_dtype=torch.int32)
                    times.append(time.perf_counter() - start)
                reader.close()
                rate = len(times) / sum(times)
                print(f"| {shards} | {interval:g} | {rate:.0f} | {rate * 64:.0f} | "
                      f"{statistics.median(times) * 1e3:.1f} ({min(times) * 1e3:.1f}-{max(times) * 1e3:.1f}) |",
                      flush=True)
    finally:
        fs, path = fsspec.core.url_to_fs(root, **object_store_options(options, location=root))
        fs.rm(path, recursive=True)
    return 0


if __name__ == "__main__":
    from rlhf_pipeline.bench.page import script_main

    sys.exit(script_main(__file__, main, sys.argv[1:]))
