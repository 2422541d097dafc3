"""What one refresh of a sharded buffer at a URL costs: wall time and requests, shards one after
another (``refresh_threads=1``, the code before) against together (the default).

Starts moto's S3 server on loopback behind a counting WSGI layer (requests are counted on the
server's side, by method), writes SHARDS small Zarr shards under a fresh prefix, opens the buffer
twice (one reader per mode) and times ``refresh(force=True)`` REPEAT times per mode, the modes in
alternation. Prints, per shard count: each mode's median and range in milliseconds, the ratio of
the medians, and the requests one refresh sends.

    python benchmarks/bench_sharded_refresh.py --shards 8 32 128 --repeat 7 --latency-ms 20

Needs the s3 and test-s3 extras (s3fs, moto[server]). A loopback server answers in about a
millisecond; a real object store's 10-50 ms round trips make the sequential refresh that many
times slower per shard, and the together mode about one round trip.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import threading
import time
import uuid


class CountingApp:
    """WSGI middleware: counts requests by method while ``counting`` is set."""

    def __init__(self, app, latency_s: float = 0.0):
        self.app = app
        self.latency_s = latency_s
        self.counts: collections.Counter[str] = collections.Counter()
        self.counting = False
        self._lock = threading.Lock()

    def __call__(self, environ, start_response):
        if self.counting:
            with self._lock:
                self.counts[environ["REQUEST_METHOD"]] += 1
        if self.latency_s:
            time.sleep(self.latency_s)  # a real store's round trip; the server thread waits, not computes
        return self.app(environ, start_response)


def start_server(latency_s: float) -> tuple[str, CountingApp]:
    import logging

    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    app = CountingApp(DomainDispatcherApplication(create_backend_app), latency_s)
    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_port}", app


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--latency-ms", type=float, default=0.0,
                        help="added to every request by the server, standing in for a real object store's round "
                             "trip (loopback answers in about a millisecond)")
    args = parser.parse_args(argv)

    import boto3
    import torch

    from rlhf_pipeline.schema import StoreSchema
    from rlhf_pipeline.schema.synthetic import synthetic_batch
    from rlhf_pipeline.storage import open_buffer
    from rlhf_pipeline.storage.zarr import ZarrTrajectoryStore

    torch.set_num_threads(1)
    endpoint, counter = start_server(args.latency_ms / 1e3)
    for key, value in {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(key, value)
    options = {"endpoint_url": endpoint, "key": "k", "secret": "s"}
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="bench")
    root = f"s3://bench/refresh-{uuid.uuid4().hex[:8]}"
    print(f"# load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
          f"{args.latency_ms:g} ms added per request", file=sys.stderr)
    print("| shards | one after another: ms (median, range) | together: ms (median, range) | ratio | "
          "requests per refresh (both) |")
    print("|---|---|---|---|---|")
    written = 0
    for shards in sorted(args.shards):
        for index in range(written, shards):
            with ZarrTrajectoryStore.create(f"{root}/shard-{index:04d}", StoreSchema(), segment_rows=16,
                                            storage_options=options) as store:
                store.append(synthetic_batch(4, seed=index))
        written = shards
        readers = {"one after another": open_buffer(root, storage_options=options, refresh_threads=1),
                   "together": open_buffer(root, storage_options=options)}
        times: dict[str, list[float]] = {name: [] for name in readers}
        requests: dict[str, collections.Counter] = {}
        for number in range(args.repeat):
            for name, reader in (readers.items() if number % 2 == 0 else reversed(readers.items())):
                counter.counts.clear()
                counter.counting = True
                start = time.perf_counter()
                reader.refresh(force=True)
                times[name].append((time.perf_counter() - start) * 1e3)
                counter.counting = False
                requests[name] = collections.Counter(counter.counts)
            print(f"[bench refresh] {shards} shards, round {number + 1}/{args.repeat}", file=sys.stderr, flush=True)
        for reader in readers.values():
            reader.close()
        cells = [f"{statistics.median(t):.1f} ({min(t):.1f}-{max(t):.1f})" for t in times.values()]
        ratio = statistics.median(times["one after another"]) / statistics.median(times["together"])
        sent = " / ".join(", ".join(f"{m} {c}" for m, c in sorted(r.items())) for r in requests.values())
        print(f"| {shards} | {cells[0]} | {cells[1]} | {ratio:.1f}x | {sent} |", flush=True)
    return 0


if __name__ == "__main__":
    from rlhf_pipeline.bench.page import script_main

    sys.exit(script_main(__file__, main, sys.argv[1:]))
