"""Requests per learner step at scale: many shards, many data-parallel ranks, counted by the server.

docs/scaling.md models what a data-parallel learner asks of the object store at 100 machines. This
measures it: moto's S3 server (its own process, behind a WSGI layer that counts every request by
the access key id that signed it and by kind: LIST, a shard's commit-record GET, a unit GET, PUT)
holds SHARDS small Zarr shards, each with a collector stand-in appending ROWS rows a step; RANKS
learner ranks, each with its own reader of the buffer and its own key, do per step exactly what a
rank's data path does, through the real classes:

* rank 0 draws (the real sampler over its reader, ``refresh_interval_s=0``: one refresh a draw,
  reading the new rows' ``policy_version`` with ``--max-staleness``, the learner's default), orders
  the draw by owning rank when affinity is on (``DataParallel.order_by_rank``), reads the draw's
  ``done`` and ``step`` (the learner's multi-turn test of a draw, on rank 0 only), names the rows
  (``row_names``) and reads its own slice. Both whole-draw reads are answered from the shards'
  commit records where a fragment's values are constant (``storage/zarr/unit_constants.py``);
* every other rank takes its slice of the names (``local_names``), finds them in its own view
  (``positions_in_view``: adopting rank 0's records when they are shared, else refreshing until it
  holds them) and reads them.

Simulated ranks run in threads of this process (a real rank per process is too heavy for 2 cores at
dozens of ranks); the process group only carries the draw, so what reaches the server is the same.
Three modes: ``before`` (each rank refreshes itself, equal contiguous slices), ``shared refresh``
(rank 0's records sent with the draw) and ``shared + affinity`` (and each rank's slice from its own
shards). Two samplers: ``exact`` (an even share of every shard, drawn in shard order) and
``window`` (rows drawn at random from the newest). The readers are opened once (opening is not a
step's cost) and every step reads only the fragments appended just before it, so no unit is in a
rank's cache from an earlier mode.

Opening is measured first, twice: every rank opening the buffer itself (``open_buffer``: a LIST and
a GET of each shard's commit record), and rank 0 opening it and the other ranks opening their
readers from the records it read (what ``DataParallel.open_buffer`` does at a learner's setup:
``published_view`` sent on the draw channel, ``open_in_view`` on the other ranks).

    python benchmarks/bench_fanout.py --shards 256 --ranks 32 --steps 3
    python benchmarks/bench_fanout.py --shards 256 --ranks 32 --opening-only
    python benchmarks/bench_fanout.py --shards 256 --ranks 32 --shard-names plain   # as buffers were named before

Prints a table of the opening's requests by who sent them, then one table row per sampler and mode:
requests per step (median and range over the steps) by who sent them, how many ranks fetched
each unit read that step, and the share of the step's requests (the appends before it included) that
went to the busiest key prefix below the buffer, its shards' names' first character: the partition
S3 would split first (``files/shard_names.py``). Needs the s3 and test-s3 extras.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import pickle
import statistics
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

KINDS = ("LIST", "record GET", "unit GET", "weights GET", "PUT", "other")


# ---------------------------------------------------------------------------- the counting server
def _kind(method: str, path: str, query: str) -> tuple[str, str | None]:
    """The kind of a request, and for a unit GET the unit it reads (to count fetches per unit)."""
    if method == "GET" and "list-type=2" in query:
        return "LIST", None
    if method == "GET" and "/weights/" in path:  # bench_weights_fanout.py's collectors
        return "weights GET", None
    if method == "GET" and "/units/" in path:
        return "unit GET", path.split("/units/")[0] + "/" + path.split("/units/")[1].split("/")[0]
    if method == "GET" and path.endswith("/zarr.json"):
        return "record GET", None
    if method == "PUT":
        return "PUT", None
    return "other", None


def serve(port_file: str) -> None:
    """moto's S3 app behind a counter: ``/__counts`` answers (and ``/__reset`` also clears) the
    counts by access key id and kind, and the units each key fetched."""
    import logging

    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    from rlhf_pipeline.bench.moto_etags import lock_moto_etags

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    lock_moto_etags()
    moto_app = DomainDispatcherApplication(create_backend_app)
    lock = threading.Lock()
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    units: dict[str, set[str]] = collections.defaultdict(set)
    # requests by the first character of the shard's name: the key prefix S3 splits a bucket on first
    partitions: collections.Counter = collections.Counter()

    def app(environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path in ("/__counts", "/__reset"):
            with lock:
                body = json.dumps({"counts": counts, "units": {k: sorted(v) for k, v in units.items()},
                                   "partitions": partitions}).encode()
                if path == "/__reset":
                    counts.clear()
                    units.clear()
                    partitions.clear()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        key = environ.get("HTTP_AUTHORIZATION", "").partition("Credential=")[2].partition("/")[0]
        kind, unit = _kind(environ["REQUEST_METHOD"], path, environ.get("QUERY_STRING", ""))
        parts = path.split("/")  # /bucket/buffer-prefix/shard-name/...
        with lock:
            counts[key][kind] += 1
            if unit is not None:
                units[key].add(unit)
            if kind != "LIST" and len(parts) > 3 and parts[3]:
                partitions[parts[3][0]] += 1
        return moto_app(environ, start_response)

    server = make_server("127.0.0.1", 0, app, threaded=True)
    Path(port_file).write_text(str(server.server_port))
    server.serve_forever()



class CountingServer:
    """:func:`serve` in its own process: in this one its threads would share the ranks' GIL."""

    def __init__(self):
        import subprocess

        self._port_file = Path(tempfile.mkdtemp()) / "port"
        self.process = subprocess.Popen([sys.executable, __file__, "--serve", str(self._port_file)])
        deadline = time.monotonic() + 60
        while not self._port_file.exists() or not self._port_file.read_text():
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError("the moto server did not start")
            time.sleep(0.05)
        self.endpoint = f"http://127.0.0.1:{int(self._port_file.read_text())}"

    def counts(self, *, reset: bool) -> dict:
        import urllib.request

        with urllib.request.urlopen(f"{self.endpoint}/__{'reset' if reset else 'counts'}") as answer:
            return json.loads(answer.read())

    def options(self, key: str) -> dict:
        """``storage_options`` of a client that signs with access key id ``key``."""
        return {"endpoint_url": self.endpoint, "key": key, "secret": "s"}

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


# ---------------------------------------------------------------------------- one learner step
@dataclasses.dataclass
class Mode:
    name: str
    shared_refresh: bool
    affinity: bool


MODES = (Mode("before", False, False), Mode("shared refresh", True, False), Mode("shared + affinity", True, True))


class SimulatedRanks:
    """RANKS readers of one buffer, rank 0 drawing with ``sampler``; :meth:`step` is one learner step."""

    def __init__(self, readers: list, keys: list[str], sampler: str, batch_size: int, mode: Mode,
                 max_staleness: int | None = 2):
        from rlhf_pipeline.learn.distributed import DataParallel

        self.mode, self.readers, self.keys = mode, readers, keys
        self.ranks = [DataParallel(rank=r, world_size=len(readers)) for r in range(len(readers))]
        self.sampler = _sampler(sampler, self.readers[0], batch_size, max_staleness)
        self.stop_event = threading.Event()
        self._draws = 0

    def step(self, pool: ThreadPoolExecutor) -> None:
        from rlhf_pipeline.learn.shard_rows import row_names

        main, reader0 = self.ranks[0], self.readers[0]
        sampled = self.sampler.draw(self._draws)
        self._draws += 1
        if self.mode.affinity:
            sampled = main.order_by_rank(sampled, reader0)
        reader0.read(sampled.positions, fields=("done", "step"))  # the learner's multi-turn test, rank 0 only
        names = row_names(reader0, sampled.positions)
        mine, _ = main.local_positions(sampled.positions, sampled.rank_rows)
        reader0.read(mine)
        shared = main.view_changes(names) if self.mode.shared_refresh else dataclasses.replace(names, view=None)
        # about what broadcast_object_list sends (the sampler state stays on rank 0)
        self.broadcast_bytes = len(pickle.dumps((dataclasses.replace(sampled, sampler_state={}), shared)))

        def other_rank(r: int) -> None:
            rank, reader = self.ranks[r], self.readers[r]
            slice_names, _ = rank.local_names(rank.received(shared), sampled.rank_rows)
            reader.read(rank.positions_in_view(reader, slice_names, stop=self.stop_event, timeout_s=60))

        list(pool.map(other_rank, range(1, len(self.ranks))))


def _sampler(name: str, store, batch_size: int, max_staleness: int | None):
    """``name`` over ``store``, drawing from the rows appended from now on; with ``max_staleness`` set it
    reads the new rows' ``policy_version`` on rank 0, as the learner's samplers do by default."""
    if name == "exact":
        from rlhf_pipeline.learn.samplers.exact import ExactUseSampler

        sampler = ExactUseSampler(store, batch_size=batch_size, max_staleness=max_staleness)
        sampler.load_state_dict({})  # a state of no sampler: cursors at each shard's end
        return sampler
    from rlhf_pipeline.learn.samplers.window import FreshRowSampler

    # the newest rows, one step's appends: each draw is random over every shard's newest fragment
    return FreshRowSampler(store, batch_size=batch_size, window=batch_size, seed=0, max_staleness=max_staleness,
                           new_rows_per_draw=batch_size, min_next_row=int(store.next_row))


# ---------------------------------------------------------------------------- opening the buffer
OPENINGS = ("each rank opens", "rank 0's records")


def open_readers(server: CountingServer, prefix: str, keys: list[str], opening: str, pool) -> tuple[list, int]:
    """Every rank's reader of the buffer, opened as ``opening`` says, and the bytes rank 0 sends the
    other ranks to open theirs (0 when each opens its own)."""
    from rlhf_pipeline.storage import open_buffer

    def options(key: str) -> dict:
        return {"storage_options": server.options(key), "refresh_interval_s": 0, "refresh_threads": 4}

    if opening == "each rank opens":
        return list(pool.map(lambda key: open_buffer(prefix, **options(key)), keys)), 0
    from rlhf_pipeline.learn.distributed import ReceivedRecords, SharedView
    from rlhf_pipeline.learn.shard_rows import open_in_view, published_view

    main = open_buffer(prefix, **options(keys[0]))
    sent = SharedView().opened(published_view(main))  # what DataParallel.open_buffer broadcasts on the draw channel

    def open_other(key: str):
        return open_in_view(prefix, ReceivedRecords().unpack(sent), **options(key))

    return [main] + list(pool.map(open_other, keys[1:])), len(pickle.dumps(sent))


def measure_opening(server: CountingServer, prefix: str, keys: list[str], pool, log=print) -> tuple[list[dict], list]:
    """Per way of opening: the requests each rank sent to open the buffer. Returns the readers of the
    last way (rank 0's records) open, for the steps."""
    results, readers = [], []
    for opening in OPENINGS:
        for reader in readers:
            reader.close()
        server.counts(reset=True)
        started = time.perf_counter()
        readers, sent_bytes = open_readers(server, prefix, keys, opening, pool)
        seconds = time.perf_counter() - started
        counts = {key: collections.Counter(value) for key, value in server.counts(reset=True)["counts"].items()}
        per_rank = [counts.get(key, collections.Counter()) for key in keys]
        results.append({"opening": opening, "rank 0 LIST": per_rank[0]["LIST"],
                        "rank 0 record GET": per_rank[0]["record GET"],
                        "others LIST": sum(c["LIST"] for c in per_rank[1:]),
                        "others record GET": sum(c["record GET"] for c in per_rank[1:]),
                        "others other": sum(c["unit GET"] + c["PUT"] + c["other"] for c in per_rank[1:]),
                        "most by one other rank": max((sum(c.values()) for c in per_rank[1:]), default=0),
                        "sent KB": sent_bytes / 1e3, "seconds": seconds})
        log(f"[bench fanout] opening, {opening}: {len(keys)} readers of the buffer in {seconds:.1f} s")
    return results, readers


OPENING_COLUMNS = [("rank 0: LIST", "rank 0 LIST", 0), ("rank 0: record GETs", "rank 0 record GET", 0),
                   ("other ranks: LIST", "others LIST", 0), ("other ranks: record GETs", "others record GET", 0),
                   ("other ranks: other requests", "others other", 0),
                   ("requests of the busiest other rank", "most by one other rank", 0),
                   ("records sent by rank 0, KB", "sent KB", 0), ("seconds (this machine)", "seconds", 1)]


def opening_table(results: list[dict]) -> str:
    lines = ["| opening | " + " | ".join(name for name, _, _ in OPENING_COLUMNS) + " |",
             "|---|" + "---|" * len(OPENING_COLUMNS)]
    for result in results:
        cells = [f"{result[key]:,.{digits}f}" for _, key, digits in OPENING_COLUMNS]
        lines.append(f"| {result['opening']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the run
def _rows(count: int, seed: int):
    from rlhf_pipeline.schema.synthetic import synthetic_batch

    return synthetic_batch(count, group_size=2, prompt_len=(4, 8), response_len=(4, 8), seed=seed)


def measure(shards: int, ranks: int, steps: int, rows: int, samplers: list[str], modes=MODES,
            log=print, shard_names: str = "spread", max_staleness: int | None = 2) -> tuple[list[dict], list[dict]]:
    """The opening's request counts by sender and kind (:func:`measure_opening`), and per sampler and
    mode: each step's request counts by sender and kind, and fetches per unit. ``shard_names``:
    ``spread`` (``<hh>-shard-NNNN``, as a run makes them at a URL) or ``plain`` (``shard-NNNN``, as
    buffers at a URL were made before). ``max_staleness``: the samplers' (the learner's default, 2)."""
    import boto3
    import torch

    from rlhf_pipeline.files.shard_names import shard_name, spread_shard_name
    from rlhf_pipeline.schema import StoreSchema
    from rlhf_pipeline.storage.zarr import ZarrTrajectoryStore

    name = {"spread": spread_shard_name, "plain": shard_name}[shard_names]
    torch.set_num_threads(1)
    server = CountingServer()
    results, opened = [], []
    try:
        boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1", aws_access_key_id="setup",
                     aws_secret_access_key="s").create_bucket(Bucket="bench")
        prefix = f"s3://bench/fanout-{uuid.uuid4().hex[:8]}"
        collector_options = server.options("collector")
        # segments far larger than the run: no seal replaces the fragments being read
        with ThreadPoolExecutor(16) as pool:
            writers = list(pool.map(lambda k: ZarrTrajectoryStore.create(
                f"{prefix}/{name(k)}", StoreSchema(), segment_rows=1 << 20, storage_options=collector_options),
                range(shards)))
            appended = 0

            def collect() -> None:
                nonlocal appended
                list(pool.map(lambda k: writers[k].append(_rows(rows, seed=appended * shards + k)), range(shards)))
                appended += 1

            readers = []
            try:
                collect()
                keys = [f"rank{r}" for r in range(ranks)]  # the key each rank signs with: who sent what
                opened, readers = measure_opening(server, prefix, keys, pool, log=log)
                for sampler in samplers:
                    for mode in modes:
                        simulated = SimulatedRanks(readers, keys, sampler, shards * rows, mode, max_staleness)
                        per_step = []
                        for number in range(steps):
                            started = time.perf_counter()
                            server.counts(reset=True)
                            collect()
                            written = server.counts(reset=True)
                            appended_s = time.perf_counter() - started
                            simulated.step(pool)
                            per_step.append(_summary(server.counts(reset=True), keys, written))
                            per_step[-1]["broadcast KB"] = simulated.broadcast_bytes / 1e3
                            log(f"[bench fanout] {sampler}, {mode.name}: step {number + 1}/{steps} (appends "
                                f"{appended_s:.1f} s, step {time.perf_counter() - started - appended_s:.1f} s)")
                        results.append({"sampler": sampler, "mode": mode.name, "steps": per_step})
            finally:
                for reader in readers:
                    reader.close()
                for writer in writers:
                    writer.close()
    finally:
        server.stop()
    return opened, results


def _summary(answer: dict, keys: list[str], written: dict) -> dict[str, float]:
    """One step's counts: rank 0's and the other ranks' by kind, fetches per unit, and the collectors'
    PUTs (``written``: what their appends before the step sent)."""
    counts = {key: collections.Counter(value) for key, value in answer["counts"].items()}
    rank0, others = counts.get(keys[0], collections.Counter()), collections.Counter()
    for key in keys[1:]:
        others.update(counts.get(key, {}))
    fetched = collections.Counter(unit for key in keys for unit in answer["units"].get(key, []))
    by_slice = collections.Counter(unit for key in keys[1:] for unit in answer["units"].get(key, []))
    out = {f"rank 0 {kind}": float(rank0[kind]) for kind in KINDS}
    out.update({f"others {kind}": float(others[kind]) for kind in KINDS})
    out["collectors PUT"] = float(written["counts"].get("collector", {}).get("PUT", 0))
    out["units read"] = float(len(fetched))
    out["ranks per unit"] = sum(fetched.values()) / max(1, len(fetched))
    # without rank 0's read of the whole draw's done/step: the fan-out of the slices alone
    out["other ranks per unit"] = sum(by_slice.values()) / max(1, len(by_slice))
    # the step's reads and the appends before it, by the key prefix each went to
    partitions = collections.Counter(answer.get("partitions", {})) + collections.Counter(written.get("partitions", {}))
    out["busiest prefix %"] = 100.0 * max(partitions.values(), default=0) / max(1, sum(partitions.values()))
    return out


def _cell(values: list[float], digits: int = 0) -> str:
    median = statistics.median(values)
    if min(values) == max(values):
        return f"{median:,.{digits}f}"
    return f"{median:,.{digits}f} ({min(values):,.{digits}f}-{max(values):,.{digits}f})"


COLUMNS = [("rank 0: LIST + record GETs", lambda s: s["rank 0 LIST"] + s["rank 0 record GET"], 0),
           ("other ranks: LIST + record GETs", lambda s: s["others LIST"] + s["others record GET"], 0),
           ("unit GETs, all ranks", lambda s: s["rank 0 unit GET"] + s["others unit GET"], 0),
           ("units read", lambda s: s["units read"], 0),
           ("ranks per unit read", lambda s: s["ranks per unit"], 2),
           ("ranks 1+ per unit they read", lambda s: s["other ranks per unit"], 2),
           ("collectors: PUTs", lambda s: s["collectors PUT"], 0),
           ("draw broadcast, KB", lambda s: s["broadcast KB"], 0),
           ("busiest key prefix, % of requests", lambda s: s["busiest prefix %"], 0)]


def table(results: list[dict]) -> str:
    lines = ["| sampler | mode | " + " | ".join(name for name, _, _ in COLUMNS) + " |",
             "|---|---|" + "---|" * len(COLUMNS)]
    for result in results:
        cells = [_cell([get(step) for step in result["steps"]], digits) for _, get, digits in COLUMNS]
        lines.append(f"| {result['sampler']} | {result['mode']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=256)
    parser.add_argument("--ranks", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3, help="learner steps measured per sampler and mode")
    parser.add_argument("--rows", type=int, default=4, help="rows each collector appends per step (one fragment)")
    parser.add_argument("--samplers", nargs="+", default=["exact", "window"], choices=["exact", "window"])
    parser.add_argument("--opening-only", action="store_true", help="measure opening the buffer, no steps")
    parser.add_argument("--modes", nargs="+", default=[mode.name for mode in MODES],
                        choices=[mode.name for mode in MODES], help="the modes measured (default: all three)")
    parser.add_argument("--shard-names", choices=["spread", "plain"], default="spread",
                        help="spread: <hh>-shard-NNNN, as runs make shards at a URL; plain: shard-NNNN, as before")
    parser.add_argument("--max-staleness", type=lambda v: None if v == "none" else int(v), default=2,
                        help="the samplers' staleness bound, as learner.max_staleness (default 2; none: off)")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve)
        return 0
    print(f"# {args.shards} shards ({args.shard_names} names), {args.ranks} ranks, a global batch of "
          f"{args.shards * args.rows} rows ({args.rows} per shard per step); load average at start {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores", file=sys.stderr)
    opened, results = measure(args.shards, args.ranks, 0 if args.opening_only else args.steps, args.rows,
                              [] if args.opening_only else args.samplers,
                              modes=[mode for mode in MODES if mode.name in args.modes],
                              log=lambda line: print(line, file=sys.stderr, flush=True), shard_names=args.shard_names,
                              max_staleness=args.max_staleness)
    print(opening_table(opened))
    if results:
        print()
        print(table(results))
    print(f"# load average at end {os.getloadavg()[0]:.1f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from rlhf_pipeline.bench.page import script_main

    sys.exit(script_main(__file__, main, sys.argv[1:]))
