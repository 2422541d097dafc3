"""Requests per published weights version for N collectors on each of M machines, a run at a URL,
before (every collector GETs every version) and after sharing one download per machine
(``files/machine_cache.py``), counted by the server.

moto's S3 server runs in its own process behind ``bench_fanout.CountingServer``, which counts every
request by the access key id that signed it. Collectors are real processes polling as
``collect_main`` does (``WeightsPoller.poll`` between sleeps of ``--poll-s``), each signing with its
own key. Both modes run side by side on the same published versions: a ``before`` collector has no
cache; an ``after`` collector shares one cache directory with the collectors of its simulated
machine. The learner (this process) publishes ``--versions`` versions of a state dict of
``--model-mb`` MB with ``publish_weights`` and waits, after each, until every collector has loaded
it; each version's counts are the requests sent from its publish until the last collector loaded it.

    python benchmarks/bench_weights_fanout.py --machines 2 --collectors 4 --versions 5 --model-mb 16

Prints one table row per mode: per published version, the weight GETs (in all, and per machine),
the MB they downloaded, the collectors' LISTs (their polls: how many depends on the poll interval
and on how long a version takes to reach everyone) and the seconds from the publish until the last
collector loaded it; median and range over the versions. Needs the s3 and test-s3 extras.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fanout import CountingServer  # the counting moto server, one copy of it

MODES = ("before", "after")
GIVE_UP_S = 600.0


def collector(url: str, endpoint: str, key: str, cache_dir: str, last: int, poll_s: float) -> int:
    """One collector's weights side: polls until it has loaded version ``last``, printing each version."""
    import torch

    from rlhf_pipeline.coordination.weights import WeightsPoller
    from rlhf_pipeline.files.machine_cache import MachineCache
    from rlhf_pipeline.files.object_run_store import ObjectRunStore

    torch.set_num_threads(1)
    store = ObjectRunStore(url, storage_options={"endpoint_url": endpoint, "key": key, "secret": "s"})
    poller = WeightsPoller(store, cache=MachineCache(cache_dir) if cache_dir != "-" else None)
    deadline = time.monotonic() + GIVE_UP_S
    while poller.current_version < last and time.monotonic() < deadline:
        update = poller.poll()
        if update is None:
            time.sleep(poll_s)
        else:  # the wall clock: the learner compares it with its publish, on the same machine
            print(update[1], time.time(), flush=True)
    return 0 if poller.current_version >= last else 1


def _state(version: int, model_mb: float):
    import torch

    return {"w": torch.full((max(1, int(model_mb * 2**20 / 4)),), float(version))}


def measure(machines: int, collectors: int, versions: int, model_mb: float, poll_s: float = 0.05,
            log=print) -> dict[str, list[dict]]:
    """Per mode, one dict per published version: weight GETs in all and per machine, LISTs, and
    the seconds from the publish (its start) until the mode's last collector loaded it."""
    import boto3

    from rlhf_pipeline.coordination.weights import publish_weights
    from rlhf_pipeline.files.object_run_store import ObjectRunStore

    server = CountingServer()
    scratch = Path(tempfile.mkdtemp(prefix="bench-weights-"))
    processes: dict[str, subprocess.Popen] = {}
    try:
        boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1", aws_access_key_id="setup",
                     aws_secret_access_key="s").create_bucket(Bucket="bench")
        url = f"s3://bench/weights-{uuid.uuid4().hex[:8]}"
        learner = ObjectRunStore(url, storage_options=server.options("learner"))
        publish_weights(learner, _state(0, model_mb), 0)  # the initial policy, before collectors start
        for mode in MODES:
            for machine in range(machines):
                for index in range(collectors):
                    cache = str(scratch / f"machine-{machine}") if mode == "after" else "-"
                    processes[f"{mode}.m{machine}.c{index}"] = subprocess.Popen(
                        [sys.executable, __file__, "--collector", url, server.endpoint, f"{mode}.m{machine}.c{index}",
                         cache, str(versions), str(poll_s)], stdout=subprocess.PIPE, text=True)
        for name, process in processes.items():  # every collector started and holding version 0
            if process.stdout.readline().split()[:1] != ["0"]:
                raise RuntimeError(f"collector {name} did not load version 0")
        log(f"[bench weights] {len(processes)} collectors hold version 0")
        results: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for version in range(1, versions + 1):
            server.counts(reset=True)
            started = time.time()
            publish_weights(learner, _state(version, model_mb), version)
            loaded_at = {}
            for name, process in processes.items():
                line = process.stdout.readline().split()
                if line[:1] != [str(version)]:
                    raise RuntimeError(f"collector {name} did not load version {version}")
                loaded_at[name] = float(line[1])
            counts = server.counts(reset=True)["counts"]
            for mode in MODES:
                seconds = max(at for name, at in loaded_at.items() if name.startswith(f"{mode}.")) - started
                gets: collections.Counter = collections.Counter()
                lists = 0
                for key, kinds in counts.items():
                    if key.startswith(f"{mode}."):
                        gets[key.split(".")[1]] += kinds.get("weights GET", 0)
                        lists += kinds.get("LIST", 0)
                total = sum(gets.values())
                results[mode].append({"GETs": total, "GETs per machine": total / machines, "LISTs": lists,
                                      "MB": total * model_mb, "seconds": seconds})
            log(f"[bench weights] version {version}/{versions} reached every collector in "
                f"{max(loaded_at.values()) - started:.2f} s")
        for name, process in processes.items():
            if process.wait(timeout=60) != 0:
                raise RuntimeError(f"collector {name} failed")
        return results
    finally:
        for process in processes.values():
            process.kill()
        server.stop()


def _cell(values: list[float], digits: int = 0) -> str:
    median = statistics.median(values)
    if min(values) == max(values):
        return f"{median:,.{digits}f}"
    return f"{median:,.{digits}f} ({min(values):,.{digits}f}-{max(values):,.{digits}f})"


def table(results: dict[str, list[dict]], machines: int, collectors: int) -> str:
    header = ("| mode | machines × collectors | weight GETs per version | GETs per machine | MB downloaded "
              "per version | collectors' LISTs per version | s until every collector has it |")
    lines = [header, "|---|---|---|---|---|---|---|"]
    for mode, rows in results.items():
        cells = [_cell([row[name] for row in rows], digits)
                 for name, digits in (("GETs", 0), ("GETs per machine", 1), ("MB", 1), ("LISTs", 0), ("seconds", 2))]
        lines.append(f"| {mode} | {machines} × {collectors} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--collector"]:
        url, endpoint, key, cache, last, poll_s = argv[1:]
        return collector(url, endpoint, key, cache, int(last), float(poll_s))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--machines", type=int, default=2)
    parser.add_argument("--collectors", type=int, default=4, help="collector processes per machine (per mode)")
    parser.add_argument("--versions", type=int, default=5, help="versions published after the initial one")
    parser.add_argument("--model-mb", type=float, default=16.0, help="size of each published version")
    parser.add_argument("--poll-s", type=float, default=0.05, help="a collector's sleep between polls")
    args = parser.parse_args(argv)
    print(f"# {args.machines} machines × {args.collectors} collectors per mode, {args.versions} versions of "
          f"{args.model_mb:g} MB; load average at start {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores",
          file=sys.stderr)
    results = measure(args.machines, args.collectors, args.versions, args.model_mb, args.poll_s,
                      log=lambda line: print(line, file=sys.stderr, flush=True))
    print(table(results, args.machines, args.collectors))
    print(f"# load average at end {os.getloadavg()[0]:.1f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from rlhf_pipeline.bench.page import script_main

    sys.exit(script_main(__file__, main, sys.argv[1:]))
