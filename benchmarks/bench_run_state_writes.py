"""What a run's state writes cost when the run lives at a URL, beside the same writes in a directory.

Times the run's own code paths (``publish_weights``, ``CheckpointManager.save``,
``PacingPublisher.publish``, ``PositionHistory.record``, and the polls a collector makes
while it waits: ``WeightsPoller.poll`` and ``read_intake``) through an ``ObjectRunStore`` on a moto
S3 server on loopback (in its own process, so its threads do not share this one's GIL) and through
a ``LocalRunStore`` in a temporary directory. Sizes are the default pipeline's: weights 0.6 MB,
a checkpoint 1.7 MB (model, AdamW moments, RNG), pacing.json ~200 bytes, a collector state ~7 KB.
Each figure is the median over ``--repeat`` calls with its range, and the requests one call sends.

    python benchmarks/bench_run_state_writes.py --repeat 20

With the azure extra and Azurite (``azurite-blob`` on ``PATH``, ``$AZURITE_BLOB``, or where
``.ci/run`` installs it), the same calls also go to an ``az://`` run on Azurite on loopback
(``--no-azure`` leaves it out).

moto and Azurite answer from memory on this machine: the figures are the client's and the
protocol's cost (request count, serialisation), not a cloud's round trip (add ~10-30 ms per request
in a region). Needs the s3 and test-s3 extras.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

BUCKET = "bench-run-state"
AZURITE_KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==")  # Azurite's
# published development key, not a secret


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server() -> tuple[subprocess.Popen, str]:
    port = free_port()
    code = ("import logging, time; logging.getLogger('werkzeug').setLevel(logging.ERROR); "
            "from moto.server import ThreadedMotoServer; "
            f"ThreadedMotoServer(ip_address='127.0.0.1', port={port}, verbose=False).start(); time.sleep(1e9)")
    server = subprocess.Popen([sys.executable, "-c", code])
    wait_listening(server, port, "moto's server")
    return server, f"http://127.0.0.1:{port}"


def wait_listening(server: subprocess.Popen, port: int, what: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    server.kill()
    raise RuntimeError(f"{what} did not start")


def azurite_command() -> str | None:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    installed = os.path.join(cache, "rlhf-pipeline", "azurite", "node_modules", ".bin", "azurite-blob")
    for candidate in (os.environ.get("AZURITE_BLOB"), shutil.which("azurite-blob"), installed):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def start_azurite(workdir: str) -> tuple[subprocess.Popen, str]:
    """Azurite in memory on a free port; the connection string of its development account."""
    port = free_port()
    server = subprocess.Popen([azurite_command(), "--blobHost", "127.0.0.1", "--blobPort", str(port),
                               "--inMemoryPersistence", "--silent", "--skipApiVersionCheck"], cwd=workdir,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_listening(server, port, "Azurite")
    return server, (f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={AZURITE_KEY};"
                    f"BlobEndpoint=http://127.0.0.1:{port}/devstoreaccount1;")


def time_calls(call, repeat: int) -> list[float]:
    out = []
    for i in range(repeat):
        started = time.perf_counter()
        call(i)
        out.append((time.perf_counter() - started) * 1000)
    return out


def bench(store, repeat: int) -> dict[str, tuple[list[float], float | None]]:
    import torch

    from rlhf_pipeline.collect.position_history import PositionHistory
    from rlhf_pipeline.coordination.pacing import (
        LearnerIntake,
        PacingPublisher,
        read_intake,
    )
    from rlhf_pipeline.coordination.weights import WeightsPoller, publish_weights
    from rlhf_pipeline.files.run_store import LocalRunStore
    from rlhf_pipeline.learn.checkpoint import CheckpointManager, Progress
    from rlhf_pipeline.storage.writer_state import encode

    remote = not isinstance(store, LocalRunStore)
    weights = {"w": torch.randn(150_000)}  # 0.6 MB, as the default policy
    checkpoint = {"model": weights, "optimizer": {"exp_avg": torch.randn(150_000), "exp_avg_sq": torch.randn(150_000)},
                  "rng": torch.get_rng_state()}
    intake = LearnerIntake(step=12, draws=12, consumed={"shard-0000": 832}, next_draw_rows=64, policy_version=12,
                           recent=[(v, 64, {"shard-0000": 16 * v}) for v in range(8)])

    position_state = encode({"prompt_order": torch.randperm(800), "rng": torch.get_rng_state()}, [])
    pacing = PacingPublisher("pacing.json", store=store) if remote else PacingPublisher(store.path("pacing.json"))
    manager = (CheckpointManager("checkpoints", keep_last=2, store=store) if remote
               else CheckpointManager(store.path("checkpoints"), keep_last=2))
    history = PositionHistory(store, "collector/shard-0000.history")
    poller = WeightsPoller(store)
    cases = {
        "weights publish (0.6 MB)": lambda i: publish_weights(store, weights, i),
        "checkpoint save (1.7 MB)": lambda i: manager.save(Progress(seed=0, step=i + 1), checkpoint),
        "pacing.json write": lambda i: pacing.publish(intake),
        "collector history entry write": lambda i: history.record(64 * (i + 1), position_state),
        "weights poll (nothing new)": lambda i: poller.poll(),
        "pacing.json read": lambda i: read_intake("pacing.json", store=store) if remote
        else read_intake(store.path("pacing.json")),
    }
    poller.current_version = 1 << 30  # every poll finds nothing newer: what a waiting collector mostly sees
    results = {}
    for name, call in cases.items():
        before = getattr(store, "requests", None)
        times = time_calls(call, repeat)
        sent = (store.requests - before) / repeat if before is not None else None
        results[name] = (times, sent)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--no-azure", action="store_true", help="leave the az:// run on Azurite out")
    args = parser.parse_args(argv)
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    from rlhf_pipeline.files.object_run_store import ObjectRunStore
    from rlhf_pipeline.files.run_store import LocalRunStore

    servers = []
    run = uuid.uuid4().hex[:8]
    try:
        with tempfile.TemporaryDirectory() as scratch:
            server, endpoint = start_server()
            servers.append(server)
            import boto3

            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
            stores = {"local directory": LocalRunStore(os.path.join(scratch, "run")),
                      "s3:// on moto": ObjectRunStore(f"s3://{BUCKET}/{run}/run",
                                                      storage_options={"endpoint_url": endpoint})}
            if not args.no_azure and azurite_command() is not None:
                server, connection = start_azurite(scratch)
                servers.append(server)
                from azure.storage.blob import BlobServiceClient

                BlobServiceClient.from_connection_string(connection).create_container(BUCKET)
                stores["az:// on Azurite"] = ObjectRunStore(f"az://{BUCKET}/{run}/run",
                                                            storage_options={"connection_string": connection})
            rows = {where: bench(store, args.repeat) for where, store in stores.items()}
    finally:
        for server in servers:
            server.kill()
            server.wait()
    load = os.getloadavg()
    print(f"run state writes, median [min-max] ms over {args.repeat} calls; load {load[0]:.2f} {load[1]:.2f}; "
          f"requests: sent per call")
    print(f"{'operation':30s}" + "".join(f" {where:>24s}" for where in rows) + f" {'requests':>9s}")
    for name in rows["local directory"]:
        cells = []
        for where in rows:
            times, _ = rows[where][name]
            cells.append(f"{statistics.median(times):7.2f} [{min(times):.2f}-{max(times):.2f}]")
        sent = "/".join(f"{rows[where][name][1]:.1f}" for where in rows if where != "local directory")
        print(f"{name:30s}" + "".join(f" {cell:>24s}" for cell in cells) + f" {sent:>9s}")


if __name__ == "__main__":
    from rlhf_pipeline.bench.page import script_main

    sys.exit(script_main(__file__, main, sys.argv[1:]))
