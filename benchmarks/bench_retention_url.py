"""What a retaining parent at a URL pays to find its branches (``runs/retention.py``), counted by
the server: moto's S3 server in its own process behind ``bench_fanout.CountingServer``.

A parent's Zarr shard at ``s3://bench/<home>/parent`` holds 480 rows in segments of 16, its learner
far ahead; beside it in the home are ``--runs`` other runs (a ``settings.json`` each) and
``--branches`` branches reading its rows from row 0 (their ``parent-rows/`` selection and
``branch.json``, as ``branch`` writes them). ``retention.max_rows=48`` asks every round to drop
most of the shard, and the branches keep it all, the steady state of a parent beside a branch:

* ``round, a recent look``: a collector's retention step in a round within ``RESCAN_S`` of the last
  look (it reuses it: the rows are kept with no listing);
* ``round, looking``: the same round once ``RESCAN_S`` passed: a look (one LIST of the home and the
  reads of the runs beside it, ``runs/lineage.py``), then nothing dropped.

Both include the floors every retention step reads (the learner's intake, the checkpoints' list).

    python benchmarks/bench_retention_url.py --runs 10 --branches 1 --repeat 5

Prints one line per case: requests (LIST, other) and seconds, median [min-max] over ``--repeat``.
Needs the s3 and test-s3 extras.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fanout import CountingServer  # noqa: E402  the counting moto server, one copy of it

ROWS, SEGMENT, GROUP = 480, 16, 6


def setup(home: str, runs: int, branches: int, scratch: Path):
    """The parent's shard and run state, the other runs and the branches; returns (paths, store)."""
    from rlhf_pipeline.coordination.pacing import LearnerIntake, PacingPublisher
    from rlhf_pipeline.files.object_run_store import ObjectRunStore
    from rlhf_pipeline.files.run_paths import RunPaths
    from rlhf_pipeline.runs.branch import PARENT_ROWS, write_parent_rows
    from rlhf_pipeline.schema.synthetic import synthetic_batches
    from rlhf_pipeline.storage import create_store
    from rlhf_pipeline.storage.selection import publish_selection

    paths = RunPaths.at_url(f"{home}/parent")
    store = create_store(paths.shard_location(0), "zarr", segment_rows=SEGMENT)
    for batch in synthetic_batches(ROWS, group_size=GROUP, batch_size=2 * GROUP, prompt_len=(2, 12),
                                   response_len=(1, 20)):
        store.append(batch)
    where, run_store = paths.state_object(paths.pacing)
    PacingPublisher(where, store=run_store).publish(LearnerIntake(consumed={"shard-0000": ROWS}))
    for i in range(runs):
        ObjectRunStore(f"{home}/run-{i:04d}").create("settings.json", b"{}")
    shard = paths.shard_location(0).rsplit("/", 1)[-1]
    for i in range(branches):
        url = f"{home}/branch-{i:04d}"
        write_parent_rows(paths.buffer_location, scratch / f"branch-{i}", {shard: ROWS // 2}, 5)
        publish_selection(scratch / f"branch-{i}", ObjectRunStore(url), PARENT_ROWS)
        ObjectRunStore(url).create("branch.json", json.dumps({"parent": paths.url, "step": 5, "replay_source": None,
                                                              "buffer_rows": {shard: ROWS // 2}}).encode())
    return paths, store


def measure(runs: int, branches: int, repeat: int) -> dict[str, list[tuple[int, int, float]]]:
    import boto3

    server = CountingServer()
    os.environ.update(AWS_ACCESS_KEY_ID="retention", AWS_SECRET_ACCESS_KEY="s", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=server.endpoint)
    try:
        boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1").create_bucket(Bucket="bench")
        from rlhf_pipeline.learn.settings import LearnerSettings
        from rlhf_pipeline.runs.retention import ShardRetention
        from rlhf_pipeline.storage.retention import RetentionSettings

        with tempfile.TemporaryDirectory() as scratch:
            paths, store = setup(f"s3://bench/runs-{uuid.uuid4().hex[:8]}", runs, branches, Path(scratch))
        retention = ShardRetention(RetentionSettings(max_rows=48), paths, "shard-0000", paths.shard_location(0),
                                   LearnerSettings(batch_size=16, sample_window=32))
        retention.after_round(store, None)  # the first look
        cases = {
            "round, a recent look": lambda: retention.after_round(store, None),
            "round, looking": lambda: (setattr(retention.branches, "rescan_s", 0.0),
                                       retention.after_round(store, None)),
        }
        results: dict[str, list[tuple[int, int, float]]] = {}
        for name, case in cases.items():
            for _ in range(repeat):
                server.counts(reset=True)
                started = time.perf_counter()
                case()
                seconds = time.perf_counter() - started
                kinds = server.counts(reset=True)["counts"].get("retention", {})
                results.setdefault(name, []).append((kinds.get("LIST", 0), sum(kinds.values()) - kinds.get("LIST", 0),
                                                     seconds))
        assert store.first_row == 0, "the branches were to keep every row"
        store.close()
        return results
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="other runs beside the parent (no branches)")
    parser.add_argument("--branches", type=int, default=1, help="branches of the parent beside it")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    for name, rows in measure(args.runs, args.branches, args.repeat).items():
        lists, others, seconds = zip(*rows)
        print(f"{name:22s} LIST {statistics.median(lists):g}  other requests {statistics.median(others):g} "
              f"[{min(others)}-{max(others)}]  {statistics.median(seconds) * 1000:.1f} ms "
              f"[{min(seconds) * 1000:.1f}-{max(seconds) * 1000:.1f}]")
    return 0


if __name__ == "__main__":
    from rlhf_pipeline.bench.page import script_main

    sys.exit(script_main(__file__, main, sys.argv[1:]))
