"""The requests a whole run at an ``s3://`` URL sends, by kind, from one or more checkouts, alternating.

Each repeat runs every checkout's ``run pipelines/default.py --home s3://... --steps N`` once (the order
reversed every other repeat) against its own moto S3 server on loopback, in a process of its own with
its request log on, and reads the log: every request, by method and by what it is about (a LIST of a
prefix, or the first part of the key under the run: ``buffer``, ``weights``, ``pacing.json``, ...).
A checkout runs its own code: the command runs with it as working directory and on ``PYTHONPATH``.
The table gives the median count of each kind over the repeats with its range, then the totals, the
run's wall time, the seconds a learner step took and the load at the starts. ``--latency-ms`` answers
each request that much later, as a cloud's round trip does::

    python benchmarks/bench_run_requests.py --checkout before=/tmp/older --checkout after=. --repeat 3

(``/tmp/older``: e.g. ``git worktree add /tmp/older <commit>``.) moto answers in a few milliseconds on
loopback: the counts carry to a cloud, the wall times only with the round trip a cloud adds (20-50 ms a
request; ``--latency-ms 30``). Needs the s3 and test-s3 extras.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUCKET = "bench-run-requests"
_REQUEST = re.compile(r'"(GET|PUT|POST|HEAD|DELETE) (\S+) HTTP/')


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_moto(log: Path, latency_s: float = 0.0) -> tuple[subprocess.Popen, str]:
    """moto's S3 server in a process of its own, one log line per request (werkzeug's) into ``log``;
    each request answered ``latency_s`` late, as a round trip to a cloud adds."""
    port = free_port()
    code = ("import time; from moto.server import DomainDispatcherApplication, ThreadedMotoServer; "
            "answer = DomainDispatcherApplication.__call__; "
            f"DomainDispatcherApplication.__call__ = lambda app, *a: time.sleep({latency_s}) or answer(app, *a); "
            f"ThreadedMotoServer(ip_address='127.0.0.1', port={port}, verbose=True).start(); time.sleep(1e9)")
    server = subprocess.Popen([sys.executable, "-c", code], stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return server, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    server.kill()
    raise RuntimeError("moto's server did not start")


def kind_of(method: str, target: str, run_prefix: str) -> str:
    """What a request is about: ``LIST weights/``, ``PUT buffer``, ``DELETE (batch) buffer``..."""
    path, _, query = target.partition("?")
    if "list-type=" in query:
        prefix = re.search(r"prefix=([^&]*)", query)
        listed = (prefix.group(1) if prefix else "").replace("%2F", "/").removeprefix(run_prefix)
        # a unit's own prefix (buffer/<shard>/units/<unit>/) is one kind, whatever the unit
        listed = re.sub(r"units/[^/]+/", "units/<unit>/", listed)
        listed = re.sub(r"\d{4,}", "N", listed)
        return f"LIST {listed or '/'}"
    if method == "POST" and query.startswith("delete"):
        return "DeleteObjects (its keys are in the body)"
    key = path.removeprefix(f"/{BUCKET}/").removeprefix(run_prefix)
    head = key.split("/", 1)[0] or "/"
    return f"{method} {re.sub(r'[0-9]{4,}', 'N', head)}"


def run_once(checkout: Path, steps: int, scratch: Path, latency_s: float = 0.0) -> dict:
    """One run from ``checkout`` against a fresh moto; its requests by kind, its wall time, the load."""
    log = scratch / f"moto-{uuid.uuid4().hex[:8]}.log"
    server, endpoint = start_moto(log, latency_s)
    try:
        env = {**os.environ, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint,
               "XDG_CACHE_HOME": str(scratch / uuid.uuid4().hex[:8]),
               "PYTHONPATH": os.pathsep.join([str(checkout), *filter(None, [os.environ.get("PYTHONPATH")])])}
        subprocess.run([sys.executable, "-c", f"import boto3; boto3.client('s3').create_bucket(Bucket={BUCKET!r})"],
                       env=env, check=True)
        prefix = uuid.uuid4().hex[:8]
        command = [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", "pipelines/default.py", "--steps", str(steps),
                   "--home", f"s3://{BUCKET}/{prefix}", "--run-name", "r"]
        load = os.getloadavg()[0]
        started = time.time()
        result = subprocess.run(command, cwd=checkout, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, check=False)
        wall = time.time() - started
        if result.returncode != 0:
            raise SystemExit(f"the run from {checkout} failed (exit code {result.returncode}):\n{result.stderr[-3000:]}")
        step_s = step_seconds(f"s3://{BUCKET}/{prefix}/r", checkout, env)
    finally:
        server.kill()
        server.wait()
    kinds = Counter(kind_of(method, target, f"{prefix}/r/")
                    for method, target in _REQUEST.findall(log.read_text(errors="replace")))
    kinds.pop("PUT /", None)  # the bucket's creation, before the run
    return {"kinds": kinds, "total": sum(kinds.values()), "wall_s": wall, "load": load, "step_s": step_s}


def step_seconds(run: str, checkout: Path, env: dict[str, str]) -> float:
    """The seconds between the run's first and last learner steps, per step, from the times its metrics
    log records (read by the checkout's own code, in a process with the server's address)."""
    code = ("import json, sys; from rlhf_pipeline.learn.metrics import read_metrics; "
            "from rlhf_pipeline.runs.lineage import run_store_at; "
            "print(json.dumps([r['time'] for r in read_metrics('metrics.jsonl', store=run_store_at(sys.argv[1]))]))")
    times = json.loads(subprocess.run([sys.executable, "-c", code, run], cwd=checkout, env=env, capture_output=True,
                                      text=True, check=True).stdout)
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")  # --steps 1: no gap


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", action="append", default=[], metavar="NAME=PATH",
                        help="a checkout to run `run` from (repeatable; default: this one, as 'this')")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rows", type=int, default=16, help="the kinds shown, the most frequent first (the rest summed)")
    parser.add_argument("--latency-ms", type=float, default=0.0,
                        help="added to every request's answer, as a cloud's round trip (20-50 ms) adds")
    args = parser.parse_args(argv)
    sides = [(c.split("=", 1)[0], Path(c.split("=", 1)[1]).resolve()) for c in args.checkout] or [("this", REPO)]
    runs: dict[str, list[dict]] = {name: [] for name, _ in sides}
    with tempfile.TemporaryDirectory(prefix="bench-run-requests-") as scratch:
        for repeat in range(args.repeat):
            for name, checkout in (sides if repeat % 2 == 0 else sides[::-1]):
                record = run_once(checkout, args.steps, Path(scratch), args.latency_ms / 1e3)
                runs[name].append(record)
                print(f"{name}: {record['total']} requests, {record['wall_s']:.1f} s, load {record['load']:.1f}",
                      file=sys.stderr, flush=True)
    every = Counter()
    for records in runs.values():
        for record in records:
            every.update(record["kinds"])
    shown = [kind for kind, _ in every.most_common(args.rows)]

    def cell(values: list[float], digits: int = 0) -> str:
        return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"

    late = f", {args.latency_ms:g} ms added to each request" if args.latency_ms else ""
    print(f"`python benchmarks/bench_run_requests.py {' '.join(argv)}`: `run pipelines/default.py --steps {args.steps}` "
          f"with the whole run at an s3:// URL on moto{late}; medians of {args.repeat} runs [range]")
    print(f"| requests | {' | '.join(name for name, _ in sides)} |")
    print(f"|---|{'---|' * len(sides)}")
    for kind in shown:
        print(f"| `{kind}` | {' | '.join(cell([r['kinds'][kind] for r in runs[name]]) for name, _ in sides)} |")
    rest = [[sum(n for kind, n in r["kinds"].items() if kind not in shown) for r in runs[name]] for name, _ in sides]
    print(f"| the rest | {' | '.join(cell(values) for values in rest)} |")
    print(f"| **all** | {' | '.join(cell([r['total'] for r in runs[name]]) for name, _ in sides)} |")
    print(f"| wall s | {' | '.join(cell([r['wall_s'] for r in runs[name]], 1) for name, _ in sides)} |")
    print(f"| s a learner step (its first to its last) | "
          f"{' | '.join(cell([r['step_s'] for r in runs[name]], 3) for name, _ in sides)} |")
    print(f"| load at the starts | {' | '.join(cell([r['load'] for r in runs[name]], 1) for name, _ in sides)} |")
    if len(sides) > 1:
        base = statistics.median(r["total"] for r in runs[sides[0][0]])
        print("\nrequests against " + sides[0][0] + ": " + ", ".join(
            f"{name} {statistics.median(r['total'] for r in runs[name]) / base:.2f}x" for name, _ in sides[1:]))
    return 0


if __name__ == "__main__":
    from rlhf_pipeline.bench.page import script_main

    sys.exit(script_main(__file__, main, sys.argv[1:]))
