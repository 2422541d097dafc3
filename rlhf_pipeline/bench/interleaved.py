"""Padded sampling of several backends at the same moments: ``bench storage --interleaved``.

Every backend is set up in this one process and sampled round-robin, the order shuffled every
round (seeded) so none always inherits another's cold caches; ratios are of per-round medians
against ``raw-numpy``. Design: docs/benchmarks.md#sampling-at-the-same-moments.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rlhf_pipeline.bench.storage_backends import BASELINE, BenchSpec, log, load_backend


def sample_interleaved(spec: BenchSpec, backends: list[str], *, rounds: int = 15,
                       batches_per_round: int = 20, progress: bool = True) -> list[dict[str, Any]]:
    """One record per backend: ``ms_per_batch_min`` / ``_median`` over ``rounds`` interleaved rounds."""
    import torch

    if rounds < 1 or batches_per_round < 1:
        raise ValueError("rounds and batches_per_round must be >= 1")
    torch.set_num_threads(1)  # as the per-backend runs: timings of one core
    generator = torch.Generator().manual_seed(spec.seed + 2)
    per_round: dict[str, list[float]] = {name: [] for name in backends}
    with tempfile.TemporaryDirectory(prefix="bench-interleaved-") as tmp:
        opened = []
        try:
            for name in backends:
                backend = load_backend(name)
                directory = Path(tmp) / name
                directory.mkdir()
                backend.setup(directory, spec)
                opened.append((name, backend))
                for batch in spec.batches():
                    backend.write(batch)
                backend.finish_writes()
                log(f"[bench storage] {name}: {spec.completions} completions written", progress)
            for number in range(rounds):
                positions = [torch.randint(0, spec.completions, (spec.sample_batch_size,), generator=generator)
                             for _ in range(batches_per_round)]
                order = list(opened)
                random.Random(spec.seed * 1_000_003 + number).shuffle(order)
                for name, backend in order:
                    start = time.perf_counter()
                    for index in positions:
                        backend.sample_padded(index)
                    per_round[name].append((time.perf_counter() - start) / batches_per_round * 1e3)
                log(f"[bench storage] interleaved round {number + 1}/{rounds}: "
                     + ", ".join(f"{n} {per_round[n][-1]:.2f} ms" for n, _ in opened), progress)
        finally:
            for _, backend in opened:
                backend.close()
    base = statistics.median(per_round[BASELINE]) if BASELINE in per_round else None
    return [{
        "backend": name,
        "completions": spec.completions,
        "rounds": rounds,
        "batches_per_round": batches_per_round,
        "ms_per_batch_min": min(times),
        "ms_per_batch_median": statistics.median(times),
        "ms_per_batch_rounds": times,
        "sampling_vs_raw_median": base / statistics.median(times) if base else None,
    } for name, times in per_round.items()]


def format_interleaved(records: list[dict[str, Any]]) -> str:
    lines = ["| backend | ms/batch min | ms/batch median | sampling vs raw (median) |", "|---|---|---|---|"]
    for r in records:
        ratio = r["sampling_vs_raw_median"]
        lines.append(f"| {r['backend']} | {r['ms_per_batch_min']:.2f} | {r['ms_per_batch_median']:.2f} "
                     f"| {f'{ratio:.2f}x' if ratio is not None else 'n/a'} |")
    return "\n".join(lines)
