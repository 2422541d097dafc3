"""Which S3 client for the buffer's object-store path: s3fs (what Zarr stores use today, through
fsspec) against obstore (Rust, ``object_store``; Zarr 3 can use it as ``zarr.storage.ObjectStore``).

Issue 22 asks whether the client itself is part of the fan-out cost at 100 machines. This times
the buffer's own access patterns on one moto S3 server on loopback, behind a WSGI layer that
counts requests on the server's side and can add a round-trip latency to each:

* ``refresh``: GET of N small objects at once (a sharded reader reading every shard's commit
  record, ~1 KB each);
* ``unit read``: GET of K objects of 4 MiB at once (sealed units a learner reads);
* ``create``: M conditional PUTs one after another (``If-None-Match: *``: the writer lock, a unit
  key written once, a commit record's first version);
* ``list``: one listing of a prefix of N objects (a buffer discovering its shards).

s3fs runs as the project configures it (``object_store_options``: no listing cache, no HEAD
before a GET); obstore twice, through its asyncio API (as Zarr's ``ObjectStore`` calls it) and
through its blocking calls from a thread pool. Rounds rotate the clients, so all see the same
neighbours; each figure is the median of the rounds with its range. The server runs in its own
process (see :func:`serve`).

    python benchmarks/bench_object_clients.py --latency-ms 0 20 --repeat 7

Needs the s3 and test-s3 extras and ``pip install obstore`` (the ``bench-obstore`` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

SMALL_BYTES, BIG_BYTES = 1024, 4 << 20


# ---------------------------------------------------------------------------- the server, in its own process
# In the clients' process, the server's Python threads would share the clients' GIL: obstore's
# concurrent async GETs measured 1.9-2.6 s for 8 x 4 MiB that way, 60 ms from threads, which says
# more about the benchmark than about the client. So the server runs apart, and is asked for its
# request counts over HTTP.
def serve(port_file: str, latency_s: float) -> None:
    import json
    import logging

    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    moto_app = DomainDispatcherApplication(create_backend_app)
    counts: collections.Counter[str] = collections.Counter()

    def app(environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path in ("/__counts", "/__reset"):
            body = json.dumps(counts).encode()
            if path == "/__reset":
                counts.clear()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        counts[environ["REQUEST_METHOD"]] += 1
        if latency_s:
            time.sleep(latency_s)
        return moto_app(environ, start_response)

    server = make_server("127.0.0.1", 0, app, threaded=True)
    Path(port_file).write_text(str(server.server_port))
    server.serve_forever()


class ServerProcess:
    def __init__(self, latency_s: float):
        import subprocess
        import tempfile

        self._port_file = Path(tempfile.mkdtemp()) / "port"
        self.process = subprocess.Popen([sys.executable, __file__, "--serve", str(self._port_file),
                                         "--latency-ms", str(latency_s * 1e3)])
        deadline = time.monotonic() + 60
        while not self._port_file.exists() or not self._port_file.read_text():
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError("the moto server did not start")
            time.sleep(0.05)
        self.endpoint = f"http://127.0.0.1:{int(self._port_file.read_text())}"

    def counts(self, reset: bool = False) -> collections.Counter:
        import json
        import urllib.request

        with urllib.request.urlopen(self.endpoint + ("/__reset" if reset else "/__counts")) as response:
            return collections.Counter(json.loads(response.read()))

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


class S3fsClient:
    name = "s3fs"

    def __init__(self, endpoint: str, bucket: str):
        import s3fs

        from rlhf_pipeline.storage.zarr.object_store import object_store_options

        options = object_store_options({"endpoint_url": endpoint, "key": "k", "secret": "s"}, location="s3://")
        self.fs = s3fs.S3FileSystem(**options)
        self.bucket = bucket

    def get_many(self, keys: list[str]) -> int:
        data = self.fs.cat([f"{self.bucket}/{k}" for k in keys])
        return sum(len(v) for v in data.values())

    def create(self, key: str, body: bytes) -> None:
        from fsspec.asyn import sync

        sync(self.fs.loop, self.fs._call_s3, "put_object", Bucket=self.bucket, Key=key, Body=body,
             IfNoneMatch="*")

    def list(self, prefix: str) -> int:
        return len(self.fs.ls(f"{self.bucket}/{prefix}", detail=False, refresh=True))


class ObstoreClient:
    """obstore's asyncio API, as ``zarr.storage.ObjectStore`` calls it."""

    name = "obstore"

    def __init__(self, endpoint: str, bucket: str):
        from obstore.store import S3Store

        self.store = S3Store(bucket, endpoint=endpoint, access_key_id="k", secret_access_key="s",
                             region="us-east-1", virtual_hosted_style_request=False,
                             client_options={"allow_http": True})

    def get_many(self, keys: list[str]) -> int:
        import obstore

        async def fetch_all():
            async def one(key):
                return await (await obstore.get_async(self.store, key)).bytes_async()

            return await asyncio.gather(*(one(k) for k in keys))

        return sum(len(v) for v in asyncio.run(fetch_all()))

    def create(self, key: str, body: bytes) -> None:
        import obstore

        obstore.put(self.store, key, body, mode="create")

    def list(self, prefix: str) -> int:
        import obstore

        return sum(len(chunk) for chunk in obstore.list(self.store, prefix + "/"))


class ObstoreThreadsClient(ObstoreClient):
    """obstore's blocking calls from a thread pool, instead of its asyncio API."""

    name = "obstore-threads"

    def get_many(self, keys: list[str]) -> int:
        from concurrent.futures import ThreadPoolExecutor

        import obstore

        with ThreadPoolExecutor(min(32, len(keys))) as pool:
            return sum(pool.map(lambda key: len(obstore.get(self.store, key).bytes()), keys))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 20.0],
                        help="round trip added to every request by the server (loopback answers in ~1 ms)")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--small", type=int, default=64, help="objects a refresh reads (N)")
    parser.add_argument("--big", type=int, default=8, help="4 MiB objects a unit read reads (K)")
    parser.add_argument("--creates", type=int, default=16, help="conditional PUTs, one after another (M)")
    parser.add_argument("--serve", metavar="PORT_FILE", help=argparse.SUPPRESS)  # the server process
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve, args.latency_ms[0] / 1e3)
        return 0

    import boto3

    for key, value in {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(key, value)
    print(f"# load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {args.repeat} rounds, "
          f"clients alternating", file=sys.stderr)
    print("| latency | workload | s3fs: ms (median, range) | obstore async: ms | obstore sync in threads: ms | "
          "async / s3fs | threads / s3fs | requests (s3fs; async; threads) |")
    print("|---|---|---|---|---|---|---|---|")
    for latency in args.latency_ms:
        server = ServerProcess(latency / 1e3)
        endpoint = server.endpoint
        bucket = "bench"
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        s3.create_bucket(Bucket=bucket)
        root = f"clients-{uuid.uuid4().hex[:8]}"
        small = [f"{root}/small/{i:04d}.json" for i in range(args.small)]
        big = [f"{root}/big/{i:04d}" for i in range(args.big)]
        for key in small:
            s3.put_object(Bucket=bucket, Key=key, Body=os.urandom(SMALL_BYTES))
        for key in big:
            s3.put_object(Bucket=bucket, Key=key, Body=os.urandom(BIG_BYTES))
        clients = [S3fsClient(endpoint, bucket), ObstoreClient(endpoint, bucket), ObstoreThreadsClient(endpoint, bucket)]
        created = collections.Counter()

        def create_batch(client) -> None:
            start = created[client.name]
            for i in range(start, start + args.creates):
                client.create(f"{root}/created/{client.name}/{i:05d}", b"x" * 256)
            created[client.name] += args.creates

        workloads = {
            f"refresh: GET {args.small} x 1 KiB at once": lambda c: c.get_many(small),
            f"unit read: GET {args.big} x 4 MiB at once": lambda c: c.get_many(big),
            f"create: {args.creates} conditional PUTs in turn": create_batch,
            f"list: {args.small} keys": lambda c: c.list(f"{root}/small"),
        }
        for workload, run in workloads.items():
            times = {c.name: [] for c in clients}
            requests: dict[str, collections.Counter] = {}
            for client in clients:  # warm: connections, credentials
                run(client)
            for number in range(args.repeat):
                for client in clients[number % len(clients):] + clients[:number % len(clients)]:
                    server.counts(reset=True)
                    start = time.perf_counter()
                    run(client)
                    times[client.name].append((time.perf_counter() - start) * 1e3)
                    requests[client.name] = server.counts()
            medians = {name: statistics.median(t) for name, t in times.items()}
            names = [c.name for c in clients]
            cells = [f"{medians[n]:.1f} ({min(times[n]):.1f}-{max(times[n]):.1f})" for n in names]
            counts = "; ".join(", ".join(f"{m} {k}" for m, k in sorted(requests[n].items())) for n in names)
            print(f"| {latency:g} ms | {workload} | {' | '.join(cells)} | "
                  f"{medians['obstore'] / medians['s3fs']:.2f}x | {medians['obstore-threads'] / medians['s3fs']:.2f}x | "
                  f"{counts} |", flush=True)
            print(f"[bench clients] {latency:g} ms: {workload} done", file=sys.stderr, flush=True)
        server.stop()
    return 0


if __name__ == "__main__":
    from rlhf_pipeline.bench.page import script_main

    sys.exit(script_main(__file__, main, sys.argv[1:]))
