"""Replay benchmark: a recorded buffer read in epoch order, memmap against a Zarr store four times
its decoded-unit cache (``bench replay``).

Orders ``shuffle`` and ``sequential`` (the epoch sampler) against ``uniform``, each in a fresh
read-only subprocess, each batch the learner's draw plus ``PaddedCollator.read``. Reports
``batches_per_s`` (best of ``--repeat``; every run in ``batches_per_s_runs``), ``peak_rss_mb``,
``vs_memmap`` and ``vs_uniform``. Figures: docs/benchmarks.md#replay-rlhf-pipeline-bench-replay.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from rlhf_pipeline.bench.storage_backends import BenchSpec, log, directory_bytes

BACKENDS = ("memmap", "zarr")
ORDERS = ("shuffle", "sequential", "uniform")
DEFAULT_SPEC = replace(BenchSpec(), completions=32_768)
SEGMENT_ROWS = 4096
UNIFORM_BATCHES = 48  # uniform batches over a Zarr store beyond its cache take ~0.3 s each
RECORD_FIELDS = ("backend", "order", "completions", "batches", "batches_per_s", "peak_rss_mb", "import_rss_mb",
                 "cache_bytes", "raw_bytes", "disk_bytes", "vs_memmap", "vs_uniform")


# =========================================================================== data
def write_stores(directory: Path, spec: BenchSpec, *, segment_rows: int = SEGMENT_ROWS,
                 progress: bool = True) -> dict[str, Any]:
    """Writes the spec's data to ``directory/memmap`` and ``directory/zarr``; returns their sizes."""
    from tqdm import tqdm

    from rlhf_pipeline.storage import create_store
    from rlhf_pipeline.schema.synthetic import raw_payload_bytes

    stores = {name: create_store(directory / name, name, schema=spec.schema, segment_rows=segment_rows,
                                 durable=False) for name in BACKENDS}
    raw_bytes = 0
    try:
        batches = -(-spec.completions // spec.write_batch_size)
        for batch in tqdm(spec.batches(), total=batches, desc="replay bench: write", disable=not progress,
                          file=sys.stderr, leave=False, mininterval=1.0):
            raw_bytes += raw_payload_bytes(batch)
            for store in stores.values():
                store.append(batch)
    finally:
        for store in stores.values():
            store.close()
    return {"raw_bytes": raw_bytes, "disk_bytes": {name: directory_bytes(directory / name) for name in BACKENDS}}


# =========================================================================== one run
def peak_rss_mb() -> float:
    """This process's peak RSS since its last exec (``VmHWM``): unlike ``ru_maxrss``, not the
    parent's peak at fork, which is kept across exec and would hide a small worker's."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_order(location: str, backend: str, order: str, *, batch_size: int, window_rows: int,
              cache_bytes: int | None, seed: int = 0, uniform_batches: int = UNIFORM_BATCHES) -> dict[str, Any]:
    """Opens the store read-only and reads one epoch's batches (or as many uniform ones); in this process."""
    import torch

    from rlhf_pipeline.schema.padding import PaddedCollator
    from rlhf_pipeline.learn.samplers.epoch import EpochSampler
    from rlhf_pipeline.storage import open_store

    torch.set_num_threads(1)  # as the storage benchmark: timings of one core on a shared machine
    import_rss_mb = peak_rss_mb()
    options = {"cache_bytes": cache_bytes} if backend == "zarr" else {}
    collator = PaddedCollator()
    with open_store(location, mode="r", **options) as store:
        sampler = EpochSampler(store, batch_size=batch_size, order="shuffle" if order == "uniform" else order,
                               seed=seed, shuffle_window_rows=window_rows)
        batches = min(uniform_batches, sampler.batches_per_epoch) if order == "uniform" else sampler.batches_per_epoch
        generator = torch.Generator().manual_seed(seed + 1)
        start = time.perf_counter()
        for draw in range(batches):
            if order == "uniform":
                positions = torch.randint(0, sampler.rows, (batch_size,), generator=generator)
            else:
                positions = sampler.draw(draw).positions
            collator.read(store, positions)
        seconds = time.perf_counter() - start
    return {"backend": backend, "order": order, "batches": batches, "seconds": seconds,
            "batches_per_s": batches / seconds,
            # the kernel reports VmHWM as max(its recorded peak, an approximate current RSS), so a
            # later reading can come out a little below an earlier one: the peak is at least both
            "peak_rss_mb": max(peak_rss_mb(), import_rss_mb), "import_rss_mb": import_rss_mb,
            "cache_bytes": cache_bytes, "window_rows": window_rows if order == "shuffle" else None}


def _run_isolated(location: str, backend: str, order: str, **kwargs) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-replay-record-") as tmp:
        record_path = Path(tmp) / "record.json"
        command = [sys.executable, "-m", "rlhf_pipeline.bench.replay_bench", "--worker", json.dumps(
            {"location": location, "backend": backend, "order": order, **kwargs}), "--record", str(record_path)]
        result = subprocess.run(command, stdout=2)  # library chatter never reaches a --json stdout
        if result.returncode != 0 or not record_path.exists():
            raise RuntimeError(f"replay bench {backend}/{order} failed (exit code {result.returncode}); see above")
        return json.loads(record_path.read_text())


# =========================================================================== all runs
def run_benchmark(spec: BenchSpec, *, window_rows: int = SEGMENT_ROWS, segment_rows: int = SEGMENT_ROWS,
                  repeat: int = 1, orders: tuple[str, ...] = ORDERS, isolate: bool = True,
                  progress: bool = True) -> list[dict[str, Any]]:
    """One record per (backend, order): the best of ``repeat`` round-robin runs."""
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    with tempfile.TemporaryDirectory(prefix="bench-replay-") as tmp:
        sizes = write_stores(Path(tmp), spec, segment_rows=segment_rows, progress=progress)
        cache_bytes = sizes["raw_bytes"] // 4
        log(f"[bench replay] {spec.completions} completions, {sizes['raw_bytes'] / 1e6:.0f} MB raw; zarr "
             f"{sizes['disk_bytes']['zarr'] / 1e6:.0f} MB on disk, cache_bytes {cache_bytes / 1e6:.0f} MB", progress)
        runs: dict[tuple[str, str], list[dict[str, Any]]] = {(b, o): [] for b in BACKENDS for o in orders}
        for number in range(repeat):
            for backend, order in runs:
                kwargs = {"batch_size": spec.sample_batch_size, "window_rows": window_rows,
                          "cache_bytes": cache_bytes if backend == "zarr" else None, "seed": spec.seed + number}
                location = str(Path(tmp) / backend)
                record = (_run_isolated(location, backend, order, **kwargs) if isolate
                          else run_order(location, backend, order, **kwargs))
                runs[backend, order].append(record)
                log(f"[bench replay] run {number + 1}/{repeat} {backend} {order}: "
                     f"{record['batches_per_s']:.0f} batches/s, peak RSS {record['peak_rss_mb']:.0f} MB", progress)
    records = []
    for (backend, _), found in runs.items():
        best = dict(max(found, key=lambda r: r["batches_per_s"]))
        best.update(completions=spec.completions, raw_bytes=sizes["raw_bytes"],
                    disk_bytes=sizes["disk_bytes"][backend], runs=len(found),
                    batches_per_s_runs=[r["batches_per_s"] for r in found],
                    batches_per_s_median=statistics.median(r["batches_per_s"] for r in found),
                    peak_rss_mb=max(r["peak_rss_mb"] for r in found))
        records.append(best)
    return add_ratios(records)


def add_ratios(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rate = {(r["backend"], r["order"]): r["batches_per_s"] for r in records}
    for r in records:
        memmap = rate.get(("memmap", r["order"]))
        uniform = rate.get((r["backend"], "uniform"))
        r["vs_memmap"] = r["batches_per_s"] / memmap if memmap else None
        r["vs_uniform"] = r["batches_per_s"] / uniform if uniform else None
    return records


def format_table(records: list[dict[str, Any]]) -> str:
    lines = ["| backend | order | batches/s (64) | runs | vs memmap (same order) | vs uniform (same backend) "
             "| peak RSS MB | RSS over imports MB |", "|" + "---|" * 8]
    for r in records:
        runs = " / ".join(f"{x:.3g}" for x in r.get("batches_per_s_runs", [r["batches_per_s"]]))
        ratio = (lambda x: f"{x:.2f}x" if x is not None else "n/a")
        lines.append(f"| {r['backend']} | {r['order']} | {r['batches_per_s']:.3g} | {runs} | {ratio(r['vs_memmap'])} "
                     f"| {ratio(r['vs_uniform'])} | {r['peak_rss_mb']:.0f} | {r['peak_rss_mb'] - r['import_rss_mb']:.0f} |")
    return "\n".join(lines)


# =========================================================================== CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--completions", type=int, default=DEFAULT_SPEC.completions,
                        help="synthetic completions written to each store (default %(default)s)")
    parser.add_argument("--window-rows", type=int, default=SEGMENT_ROWS,
                        help="shuffle window of the epoch order, in rows (default: one 4,096-row unit)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run every (backend, order) N times round-robin, keep the best (default %(default)s)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SPEC.seed, help="data and order seed")
    parser.add_argument("--json", action="store_true", help="print one JSON array of records instead of a table")
    parser.add_argument("--in-process", action="store_true",
                        help="run every (backend, order) in this process (faster; peak RSS is then cumulative)")


def main(args: argparse.Namespace) -> int:
    if args.completions < 1 or args.repeat < 1 or args.window_rows < 0:
        raise SystemExit("--completions and --repeat must be >= 1, --window-rows >= 0")
    spec = replace(DEFAULT_SPEC, completions=args.completions, seed=args.seed)
    records = run_benchmark(spec, window_rows=args.window_rows, repeat=args.repeat, isolate=not args.in_process,
                            progress=not args.json or sys.stderr.isatty())
    if args.json:
        print(json.dumps(records))
    else:
        print(f"replay benchmark: {spec.completions} completions in {SEGMENT_ROWS}-row units, padded batches of "
              f"{spec.sample_batch_size}, one epoch per run; zarr cache_bytes = raw payload / 4 "
              f"({records[0]['raw_bytes'] / 4e6:.0f} MB)" + (f"; best of {args.repeat}" if args.repeat > 1 else ""))
        print(format_table(records))
    return 0


def _worker_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="one (backend, order) run of the replay benchmark (internal)")
    parser.add_argument("--worker", required=True, help="run_order's arguments as JSON")
    parser.add_argument("--record", required=True, help="where to write the JSON record")
    args = parser.parse_args(argv)
    options = json.loads(args.worker)
    record = run_order(options.pop("location"), options.pop("backend"), options.pop("order"), **options)
    Path(args.record).write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
