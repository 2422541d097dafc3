"""Where a Zarr reader on an object store spends a sampled batch: the refresh, or the read.

Writes 4,096 synthetic GRPO completions (the storage benchmark's shapes) to a new prefix at
LOCATION, opens a read-only store as a learner in another process would, and times, for each
of 60 batches of 64 random positions, ``len(reader)`` (which re-reads the commit record: one
GET) and ``PaddedCollator.read`` (from units already in the reader's cache) separately. The
prefix is deleted afterwards.

    AWS_ACCESS_KEY_ID=k AWS_SECRET_ACCESS_KEY=s python benchmarks/bench_object_store_refresh.py \\
        s3://bench-bucket/split --storage-option endpoint_url=http://127.0.0.1:5055
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
    parser.add_argument("--batches", type=int, default=60)
    args = parser.parse_args(argv)

    import fsspec
    import torch

    from rlhf_pipeline.bench.storage_bench import parse_storage_options
    from rlhf_pipeline.schema.padding import PaddedCollator
    from rlhf_pipeline.schema import StoreSchema
    from rlhf_pipeline.storage.zarr import ZarrTrajectoryStore
    from rlhf_pipeline.storage.zarr.object_store import object_store_options
    from rlhf_pipeline.schema.synthetic import synthetic_batches

    torch.set_num_threads(1)
    options = dict(parse_storage_options(args.storage_option))
    url = f"{args.location.rstrip('/')}/refresh-{uuid.uuid4().hex[:12]}"
    writer = ZarrTrajectoryStore.create(url, StoreSchema(("advantage",)), storage_options=options)
    try:
        for batch in synthetic_batches(4096, group_size=8, prompt_len=(32, 256), response_len=(16, 1024),
                                       batch_size=512, seed=0, optional_fields=("advantage",)):
            writer.append(batch)
        writer.flush()
        reader = ZarrTrajectoryStore.open(url, storage_options=options)
        collator = PaddedCollator(index_dtype=torch.int32)
        generator = torch.Generator().manual_seed(1)
        positions = [torch.randint(0, 4096, (64,), generator=generator) for _ in range(args.batches)]
        collator.read(reader, positions[0])  # decodes every unit into the cache
        refresh, read = [], []
        for index in positions:
            start = time.perf_counter()
            len(reader)
            refresh.append(time.perf_counter() - start)
            start = time.perf_counter()
            collator.read(reader, index)
            read.append(time.perf_counter() - start)
        reader.close()
        print(f"refresh (one GET) median {statistics.median(refresh) * 1e3:.1f} ms (range {min(refresh) * 1e3:.1f}-"
              f"{max(refresh) * 1e3:.1f}); cached padded read median {statistics.median(read) * 1e3:.2f} ms "
              f"(range {min(read) * 1e3:.2f}-{max(read) * 1e3:.2f}); {args.batches} batches of 64")
    finally:
        writer.close()
        fs, path = fsspec.core.url_to_fs(url, **object_store_options(options, location=url))
        fs.rm(path, recursive=True)
    return 0


if __name__ == "__main__":
    from rlhf_pipeline.bench.page import script_main

    sys.exit(script_main(__file__, main, sys.argv[1:]))
