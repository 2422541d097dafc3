"""The space retention frees on a long run's buffer, and what it costs a round.

    python benchmarks/bench_retention.py                      # memmap and Zarr, 3 repeats
    python benchmarks/bench_retention.py --rounds 2000 --max-rows 16384 --repeats 5 --json out.json

A collector's shard is simulated as a run writes it: ``--rounds`` rounds of 64 rows (16 groups of
4 GRPO completions, prompts of 20-60 and responses of 20-400 tokens, an ``advantage`` column), round
r sampled by policy version r, into a store of ``--segment-rows``. Without retention the shard grows
with every round; with ``max_rows`` the writer applies retention after each round as a run's
collector does (``storage/retention.py``: the rule's cut, whole segments, no group cut in two;
no floor here, so the rule alone decides). Memmap is made with ``evict_grace_s=0`` so that a dropped
segment's files go at once (a run's default grace of 60 s only delays the same freeing).

Printed per backend: rows held and bytes on disk (``du``'s apparent size of every file) at tenths
of the run, with and without retention; the time of the retention step per round (finding the cut
plus the drop: median and 99th percentile over every round); medians [min-max] over ``--repeats``;
the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROUND_ROWS, GROUP = 64, 4


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def rounds_of(total_rounds: int, seed: int):
    import torch

    from rlhf_pipeline.schema.synthetic import synthetic_batches

    batches = synthetic_batches(total_rounds * ROUND_ROWS, group_size=GROUP, prompt_len=(20, 60),
                                response_len=(20, 400), batch_size=ROUND_ROWS, seed=seed,
                                optional_fields=("advantage",), vocab_size=32_000)
    for r, batch in enumerate(batches):
        ids = torch.arange(r * ROUND_ROWS, (r + 1) * ROUND_ROWS)
        yield batch.with_columns(trajectory_id=ids, group_id=ids // GROUP,
                                 policy_version=torch.full((ROUND_ROWS,), r, dtype=torch.int64))


def one_run(backend: str, folder: Path, rounds: int, segment_rows: int, max_rows: int | None, seed: int) -> dict:
    from rlhf_pipeline.schema import StoreSchema
    from rlhf_pipeline.storage import create_store
    from rlhf_pipeline.storage.retention import RetentionSettings, wanted_cut, whole_cut

    path = folder / f"{backend}-{max_rows}"
    extra = {"evict_grace_s": 0.0} if backend == "memmap" else {}
    store = create_store(path, backend, schema=StoreSchema(optional=("advantage",)), segment_rows=segment_rows,
                         durable=False, **extra)
    rules = RetentionSettings(max_rows=max_rows)
    timeline, step_s, dropped = [], [], 0
    every = max(1, rounds // 10)
    for r, batch in enumerate(rounds_of(rounds, seed)):
        store.append(batch)
        if rules.enabled:
            started = time.perf_counter()
            cut = whole_cut(store, wanted_cut(store, rules, newest_version=r, clock=None, now=0.0), store.next_row)
            dropped += sum(d.rows for d in store.drop_rows_before(cut))
            step_s.append(time.perf_counter() - started)
        if (r + 1) % every == 0:
            store.flush() if hasattr(store, "flush") else None
            timeline.append({"round": r + 1, "rows_written": store.next_row, "rows_held": len(store),
                             "bytes": du(path)})
    store.close()
    return {"timeline": timeline, "rows_dropped": dropped, "step_s": step_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--segment-rows", type=int, default=1024)
    parser.add_argument("--max-rows", type=int, default=8192)
    parser.add_argument("--backends", nargs="+", default=["memmap", "zarr"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write every measurement here")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    load_before = os.getloadavg()
    results: dict[str, dict] = {}
    for backend in args.backends:
        for label, max_rows in (("kept every row", None), (f"retention.max_rows={args.max_rows}", args.max_rows)):
            runs = []
            for repeat in range(args.repeats):
                with tempfile.TemporaryDirectory(prefix="bench-retention-") as folder:
                    runs.append(one_run(backend, Path(folder), args.rounds, args.segment_rows, max_rows, seed=repeat))
            results[f"{backend} / {label}"] = {"runs": runs}
    load_after = os.getloadavg()

    for name, result in results.items():
        runs = result["runs"]
        print(f"\n{name}  ({args.rounds} rounds of {ROUND_ROWS} rows, segment_rows={args.segment_rows})")
        print(f"  {'round':>6} {'rows written':>13} {'rows held':>10} {'MiB on disk: median [min-max]':>32}")
        for i, point in enumerate(runs[0]["timeline"]):
            mib = [run["timeline"][i]["bytes"] / 2**20 for run in runs]
            print(f"  {point['round']:>6} {point['rows_written']:>13} {point['rows_held']:>10} "
                  f"{statistics.median(mib):>14.1f} [{min(mib):.1f}-{max(mib):.1f}]")
        steps = [s for run in runs for s in run["step_s"]]
        if steps:
            steps.sort()
            print(f"  retention step per round: median {statistics.median(steps) * 1e3:.3f} ms, "
                  f"p99 {steps[int(0.99 * (len(steps) - 1))] * 1e3:.3f} ms over {len(steps)} rounds; "
                  f"rows dropped per run {runs[0]['rows_dropped']}")
    print(f"\nload average (1, 5, 15 min): before {load_before}, after {load_after}; cores {os.cpu_count()}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "load_before": load_before,
                                               "load_after": load_after, "results": results}))
    return 0


if __name__ == "__main__":
    from rlhf_pipeline.bench.page import script_main

    sys.exit(script_main(__file__, main, sys.argv[1:]))
