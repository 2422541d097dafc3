"""Storage benchmark: every backend on the same synthetic GRPO data, side by side.

Why one file: one benchmark end to end: running a backend in its own process, the ratios against the
baselines and the table are one measurement's parts; the backends and the data spec are apart in
:mod:`.storage_backends`.

Per backend, each in a fresh subprocess: ``write_us_per_completion``, ``batches_per_s`` (padded
batches of 64; the fastest of ``SAMPLE_ROUNDS`` slices), ``useful_tokens_per_s``,
``disk_bytes_per_raw_byte`` and ``peak_rss_mb``. Durable stores are compared with ``raw-numpy-fsync``,
the others with ``raw-numpy``. Method and figures: docs/benchmarks.md#storage-rlhf-pipeline-bench-storage.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhf_pipeline.bench.storage_backends import (
    BACKENDS,
    BASELINE,
    DEFAULT_BACKENDS,
    DURABLE_BASELINE,
    LOCATION_BACKENDS,
    REMOTE_BACKENDS,
    BenchSpec,
    directory_bytes,
    load_backend,
    log,
)

if TYPE_CHECKING:
    import torch
    from tensordict import TensorDict

    from rlhf_pipeline.schema import StoreSchema, TrajectoryBatch
    from rlhf_pipeline.storage.base import TrajectoryStore

# sampling rates come from the fastest of these consecutive slices of the sampled batches
# (as timeit takes the minimum): the machine is shared, and the slowest slices measure the
# neighbours more than the backend; the rate over all slices is reported too
SAMPLE_ROUNDS = 4
RECORD_FIELDS = ("backend", "completions", "write_us_per_completion", "batches_per_s",
                 "useful_tokens_per_s", "disk_bytes_per_raw_byte", "peak_rss_mb", "durable")


# =========================================================================== our stores
class TrajectoryStoreBackend:
    """Any ``TrajectoryStore``: ``append`` per batch; per sample ``PaddedCollator.read``, i.e. the
    store's fused ``read_padded`` where it has one (memmap, zarr), else ``read`` (no text) + ``pad_batch``."""

    def __init__(self, name: str, create: Callable[[Path, StoreSchema], TrajectoryStore], *,
                 durable: bool = True):
        self.name = name
        self.durable = durable  # fsyncs each append: its writes compare with raw-numpy-fsync
        self._create = create

    def setup(self, directory: Path, spec: BenchSpec) -> None:
        from rlhf_pipeline.schema.padding import PaddedCollator

        self._dir = directory
        self._store = self._create(directory / "buffer", spec.schema)
        self._collator = PaddedCollator(index_dtype=spec.torch_index_dtype)

    def write(self, batch: TrajectoryBatch) -> None:
        self._store.append(batch)

    def finish_writes(self) -> None:
        pass  # append publishes each batch

    def sample_padded(self, positions: torch.Tensor) -> TensorDict:
        # the store's fused read-and-pad when it has one (memmap, zarr), else read (no text) + pad_batch
        return self._collator.read(self._store, positions)

    def disk_bytes(self) -> int:
        return directory_bytes(self._dir)

    def close(self) -> None:
        self._store.close()


def MemmapBackend(*, durable: bool = True, segment_rows: int | None = None,
                  name: str | None = None) -> TrajectoryStoreBackend:
    """Our memmap store as a learner uses it: ``durable=True`` fsyncs every append."""

    def create(path: Path, schema: StoreSchema) -> TrajectoryStore:
        from rlhf_pipeline.storage.memmap.store import DEFAULT_SEGMENT_ROWS, MemmapTrajectoryStore

        return MemmapTrajectoryStore.create(str(path), schema, durable=durable,
                                            segment_rows=segment_rows or DEFAULT_SEGMENT_ROWS)

    return TrajectoryStoreBackend(name or ("memmap" if durable else "memmap-nofsync"), create, durable=durable)


def MemmapNoFsyncBackend() -> TrajectoryStoreBackend:
    """The memmap store without fsyncs: what the baselines do, so the write cost compares like for like."""
    return MemmapBackend(durable=False)


def MemmapSmallSegmentsBackend() -> TrajectoryStoreBackend:
    """The memmap store in segments of 256 rows: 64 segments at the default size, so a batch of
    64 touches ~40 of them, as on a buffer of a million rows in the default 4,096-row segments.
    Sampling should cost what ``memmap`` costs: the row index makes lookups independent of
    the number of segments."""
    return MemmapBackend(segment_rows=256, name="memmap-seg256")


# =========================================================================== one backend
def run_backend(name: str, spec: BenchSpec, *, progress: bool = True) -> dict[str, Any]:
    """Runs one backend in this process and returns its record."""
    import torch
    from tqdm import tqdm

    from rlhf_pipeline.schema.synthetic import raw_payload_bytes

    torch.set_num_threads(1)  # the machine is shared; one thread keeps timings comparable
    backend = load_backend(name)
    import_rss_mb = _peak_rss_mb()
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as tmp:
        backend.setup(Path(tmp), spec)
        try:
            write_seconds, raw_bytes = 0.0, 0
            num_batches = -(-spec.completions // spec.write_batch_size)
            for batch in tqdm(spec.batches(), total=num_batches, desc=f"{name}: write",
                              disable=not progress, file=sys.stderr, leave=False, mininterval=1.0):
                raw_bytes += raw_payload_bytes(batch)
                start = time.perf_counter()
                backend.write(batch)
                write_seconds += time.perf_counter() - start
            start = time.perf_counter()
            backend.finish_writes()
            write_seconds += time.perf_counter() - start
            disk_bytes = backend.disk_bytes()

            positions = spec.sample_positions()
            backend.sample_padded(positions[0])  # warm-up: lazy imports, first-touch allocations
            rounds = [[0, 0.0, 0] for _ in range(SAMPLE_ROUNDS)]  # (batches, seconds, tokens) per round
            for i, index in enumerate(tqdm(positions, desc=f"{name}: sample", disable=not progress,
                                           file=sys.stderr, leave=False, mininterval=1.0)):
                start = time.perf_counter()
                padded = backend.sample_padded(index)
                elapsed = time.perf_counter() - start
                tokens = int(padded["prompt_lengths"].sum() + padded["response_lengths"].sum())
                current = rounds[i * SAMPLE_ROUNDS // len(positions)]
                current[0] += 1
                current[1] += elapsed
                current[2] += tokens
        finally:
            backend.close()
    rounds = [r for r in rounds if r[0]]
    best = max(rounds, key=lambda r: r[0] / r[1])
    total_batches, total_seconds = sum(r[0] for r in rounds), sum(r[1] for r in rounds)
    return {
        "backend": name,
        "completions": spec.completions,
        "write_us_per_completion": write_seconds / spec.completions * 1e6,
        "batches_per_s": best[0] / best[1],
        "useful_tokens_per_s": best[2] / best[1],
        "batches_per_s_all_rounds": total_batches / total_seconds,
        "disk_bytes_per_raw_byte": disk_bytes / raw_bytes,
        "peak_rss_mb": _peak_rss_mb(),
        "import_rss_mb": import_rss_mb,
        "disk_bytes": disk_bytes,
        "raw_bytes": raw_bytes,
        "sample_batch_size": spec.sample_batch_size,
        "write_batch_size": spec.write_batch_size,
        "durable": bool(getattr(backend, "durable", False)),
    }


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


# =========================================================================== all backends
def run_benchmark(spec: BenchSpec, backends: list[str], *, isolate: bool = True,
                  progress: bool = True, repeat: int = 1) -> list[dict[str, Any]]:
    """One record per backend; ``isolate`` runs each in a fresh subprocess (per-backend RSS).

    ``repeat > 1`` runs the backends round-robin that many times (A B C A B C ...), so
    every backend meets the machine's slow and fast moments alike, and keeps each
    backend's best write time and best sampling rate (the minimum, as ``timeit`` does);
    every run's figures stay in ``*_runs``. Ratios (:func:`add_ratios`) are then taken
    between best figures measured side by side rather than at one arbitrary moment each.
    """
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in backends}
    for round_index in range(repeat):
        for name in backends:
            label = f"{name} (run {round_index + 1}/{repeat})" if repeat > 1 else name
            log(f"[bench storage] {label}: {spec.completions} completions", progress)
            record = _run_isolated(name, spec, progress) if isolate else run_backend(name, spec, progress=progress)
            runs[name].append(record)
            log(f"[bench storage] {label}: write {record['write_us_per_completion']:.1f} us/completion, "
                 f"{record['batches_per_s']:.0f} batches/s", progress)
    return add_ratios([_best_of(records) for records in runs.values()])


def _best_of(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One record from a backend's runs: best write, best sampling (and its tokens/s), max RSS."""
    fastest_sampling = max(records, key=lambda r: r["batches_per_s"])
    best = dict(fastest_sampling)
    best["write_us_per_completion"] = min(r["write_us_per_completion"] for r in records)
    best["peak_rss_mb"] = max(r["peak_rss_mb"] for r in records)
    best["runs"] = len(records)
    best["write_us_per_completion_runs"] = [r["write_us_per_completion"] for r in records]
    best["batches_per_s_runs"] = [r["batches_per_s"] for r in records]
    return best


def add_ratios(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adds ``write_vs_raw`` (time over the raw baseline of the same durability, named in
    ``write_baseline``) and ``batches_per_s_vs_raw`` to each record, where the baseline ran."""
    by_name = {r["backend"]: r for r in records}
    for r in records:
        write_base = by_name.get(DURABLE_BASELINE if r.get("durable") else BASELINE)
        r["write_baseline"] = write_base["backend"] if write_base else None
        r["write_vs_raw"] = (r["write_us_per_completion"] / write_base["write_us_per_completion"]
                             if write_base else None)
        sample_base = by_name.get(BASELINE)
        r["batches_per_s_vs_raw"] = r["batches_per_s"] / sample_base["batches_per_s"] if sample_base else None
    return records


def _run_isolated(name: str, spec: BenchSpec, progress: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-record-") as tmp:
        record_path = Path(tmp) / "record.json"
        command = [sys.executable, "-m", "rlhf_pipeline.bench.storage_bench", "--worker", name,
                   "--spec", json.dumps(asdict(spec)), "--record", str(record_path)]
        if not progress:
            command.append("--quiet")
        # the worker's stdout goes to our stderr (fd 2): library chatter never reaches a --json stdout
        result = subprocess.run(command, stdout=2)
        if result.returncode != 0 or not record_path.exists():
            raise RuntimeError(f"backend {name!r} failed (exit code {result.returncode}); see the log above")
        return json.loads(record_path.read_text())


# =========================================================================== report
def format_table(records: list[dict[str, Any]]) -> str:
    """A Markdown table. Write ratios are against the raw baseline of the same durability
    (``raw-numpy-fsync`` for backends that fsync each append, else ``raw-numpy``), sampling
    ratios against ``raw-numpy``; "n/a" where that baseline did not run."""
    records = add_ratios([dict(r) for r in records])  # against the baselines in this table
    header = ("| backend | fsync | write µs/compl | write vs raw (same fsync) | batches/s (64) "
              "| sampling vs raw | useful Mtok/s | disk / raw | peak RSS MB |")
    lines = [header, "|" + "---|" * 9]
    for r in records:
        write_ratio = f"{r['write_vs_raw']:.2f}x" if r["write_vs_raw"] is not None else "n/a"
        sample_ratio = f"{r['batches_per_s_vs_raw']:.2f}x" if r["batches_per_s_vs_raw"] is not None else "n/a"
        lines.append(
            f"| {r['backend']} | {'yes' if r.get('durable') else 'no'} | {r['write_us_per_completion']:.1f} "
            f"| {write_ratio} | {r['batches_per_s']:.0f} | {sample_ratio} "
            f"| {r['useful_tokens_per_s'] / 1e6:.1f} | {r['disk_bytes_per_raw_byte']:.3f} | {r['peak_rss_mb']:.0f} |"
        )
    return "\n".join(lines)


# =========================================================================== CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = BenchSpec()
    parser.add_argument("--completions", type=int, default=defaults.completions,
                        help="synthetic completions written to each backend (default %(default)s)")
    parser.add_argument("--backends", nargs="+", default=None, metavar="NAME",
                        help=f"backends to run, in order, from {list(BACKENDS)} "
                             f"(default: {' '.join(DEFAULT_BACKENDS)})")
    parser.add_argument("--sample-batches", type=int, default=defaults.sample_batches,
                        help="padded batches of 64 sampled per backend (default %(default)s)")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="data and position seed")
    parser.add_argument("--index-dtype", choices=("int32", "int64"), default=defaults.index_dtype,
                        help="dtype of the token ids and position_ids every backend returns: int32 is what "
                             "the learner reads, int64 pad_batch's default (default %(default)s)"),
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run the backends round-robin N times and keep each one's best figures "
                             "(steadier ratios on a shared machine; default %(default)s)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON array of records (one per backend) instead of a table")
    parser.add_argument("--interleaved", action="store_true",
                        help="instead: sample every backend in one process, round-robin, and compare "
                             "median ms per batch at the same moments (bench/interleaved.py)")
    parser.add_argument("--in-process", action="store_true",
                        help="run every backend in this process (faster; peak RSS is then cumulative)")
    parser.add_argument("--location", default=None, metavar="URL",
                        help="an object-store URL (s3://BUCKET/prefix) for the zarr-s3 backend, which runs "
                             f"beside the local ones (default with it: {' '.join(LOCATION_BACKENDS)}); the "
                             "benchmark writes under a fresh prefix there and deletes it afterwards")
    parser.add_argument("--storage-option", dest="storage_options", action="append", default=[],
                        metavar="KEY=VALUE", help="an fsspec option for --location, e.g. "
                        "endpoint_url=http://127.0.0.1:9000, key=..., secret=... (repeatable; otherwise the AWS_* "
                        "environment variables); VALUE is read as JSON when it parses (true, 3), else as a string")


def main(args: argparse.Namespace) -> int:
    backends = args.backends or list(LOCATION_BACKENDS if args.location else DEFAULT_BACKENDS)
    if set(backends) & set(REMOTE_BACKENDS) and not args.location:
        raise SystemExit("the zarr-s3 backend writes to an object store: pass --location s3://BUCKET/prefix")
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise SystemExit(f"unknown backend(s) {unknown}; choose from {list(BACKENDS)}")
    if args.completions < 1 or args.sample_batches < 1 or args.repeat < 1:
        raise SystemExit("--completions, --sample-batches and --repeat must be >= 1")
    spec = BenchSpec(completions=args.completions, sample_batches=args.sample_batches, seed=args.seed,
                     index_dtype=args.index_dtype, location=args.location,
                     storage_options=parse_storage_options(args.storage_options))
    if args.interleaved:
        from rlhf_pipeline.bench.interleaved import format_interleaved, sample_interleaved

        records = sample_interleaved(spec, backends)
        if args.json:
            print(json.dumps(records))
        else:
            print(f"padded sampling at the same moments: {spec.completions} completions, batches of "
                  f"{spec.sample_batch_size}, {spec.index_dtype} ids, {records[0]['rounds']} interleaved rounds of "
                  f"{records[0]['batches_per_round']} batches per backend")
            print(format_interleaved(records))
        return 0
    records = run_benchmark(spec, backends, isolate=not args.in_process, repeat=args.repeat)
    if args.json:
        print(json.dumps(records))
    else:
        print(f"storage benchmark: {spec.completions} completions, groups of {spec.group_size}, prompt "
              f"{spec.min_prompt_len}-{spec.max_prompt_len}, response {spec.min_response_len}-"
              f"{spec.max_response_len} tokens; writes in batches of {spec.write_batch_size}; "
              f"{spec.sample_batches} padded batches of {spec.sample_batch_size} ({spec.index_dtype} ids)"
              + (f"; best of {args.repeat} round-robin runs per backend" if args.repeat > 1 else "")
              + (f"; zarr-s3 at {args.location}" if args.location else ""))
        print(format_table(records))
    return 0


def parse_storage_options(items: list[str]) -> tuple[tuple[str, Any], ...]:
    """``["endpoint_url=http://...", "anon=true"]`` -> ``(("endpoint_url", "http://..."), ("anon", True))``."""
    options = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--storage-option {item!r}: expected KEY=VALUE, e.g. endpoint_url=http://127.0.0.1:9000")
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = value
        options.append((key, parsed))
    return tuple(options)


def _worker_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="run one storage-benchmark backend (internal)")
    parser.add_argument("--worker", required=True)
    parser.add_argument("--spec", required=True, help="BenchSpec as JSON")
    parser.add_argument("--record", required=True, help="where to write the JSON record")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    spec_fields = json.loads(args.spec)
    spec_fields["optional_fields"] = tuple(spec_fields["optional_fields"])
    spec_fields["storage_options"] = tuple(tuple(pair) for pair in spec_fields["storage_options"])
    record = run_backend(args.worker, BenchSpec(**spec_fields), progress=not args.quiet)
    Path(args.record).write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
