"""``rlhf-pipeline bench curation``: prioritized sampling and ``filter`` against their baselines,
alternating rounds, medians compared.

``prioritized``: one learner-style draw of 64 with weights plus ``update_priority``, at 10^4 and 10^6
rows, against ``torch.multinomial`` over ``p^alpha``. ``filter``: the storage benchmark's buffer
filtered on ``group_reward_std > 0 and response_length < 768`` (dry run, selection, new buffer)
against ``convert``. Figures: docs/benchmarks.md#curation-rlhf-pipeline-bench-curation.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rlhf_pipeline.bench.storage_backends import log

WHERE = "group_reward_std > 0 and response_length < 768"


# =========================================================================== prioritized
def bench_prioritized(rows: int, *, rounds: int, steps: int, quiet: bool) -> list[dict[str, Any]]:
    import torch
    from torchrl.data import LazyTensorStorage

    from rlhf_pipeline.storage.prioritized import PrioritizedSampler

    torch.set_num_threads(1)
    logging.getLogger("torchrl").setLevel(logging.WARNING)  # its INFO lines go to stdout, which --json owns
    alpha, beta, batch = 0.6, 0.4, 64
    generator = torch.Generator().manual_seed(0)
    storage = LazyTensorStorage(rows)
    storage.set(torch.arange(rows), torch.zeros(rows))
    priorities = torch.rand(rows, dtype=torch.float64, generator=generator) + 0.01
    sampler = PrioritizedSampler(alpha, beta, eps=0.0)
    sampler.sample(storage, 1, generator=generator)  # first sight of the rows: default priorities
    start = time.perf_counter()
    sampler.update_priority(torch.arange(rows), priorities)
    setup_s = time.perf_counter() - start
    weights_plain = priorities ** alpha  # the baseline's state: the p^alpha array itself

    def ours() -> None:
        index, info = sampler.sample(storage, batch, generator=generator)
        sampler.update_priority(index, torch.rand(batch, dtype=torch.float64, generator=generator) + 0.01)

    def plain() -> None:
        index = torch.multinomial(weights_plain, batch, replacement=True, generator=generator)
        _ = (weights_plain[index] / weights_plain.min()) ** -beta
        weights_plain[index] = (torch.rand(batch, dtype=torch.float64, generator=generator) + 0.01) ** alpha

    per_round: dict[str, list[float]] = {"ours (sum tree)": [], "plain O(N) multinomial": []}
    for number in range(rounds):
        for name, step in (("ours (sum tree)", ours), ("plain O(N) multinomial", plain)):
            start = time.perf_counter()
            for _ in range(steps):
                step()
            per_round[name].append((time.perf_counter() - start) / steps * 1e6)
        log(f"[bench curation] prioritized N={rows} round {number + 1}/{rounds}: "
            + ", ".join(f"{n} {t[-1]:.0f} us" for n, t in per_round.items()), not quiet)
    base = statistics.median(per_round["plain O(N) multinomial"])
    return [{"measure": "prioritized", "method": name, "rows": rows, "batch": batch,
             "us_per_step_median": statistics.median(times), "us_per_step_min": min(times),
             "us_per_step_rounds": times, "speedup_vs_plain": base / statistics.median(times),
             "initial_update_all_rows_s": setup_s if name.startswith("ours") else None}
            for name, times in per_round.items()]


# =========================================================================== filter
def bench_filter(completions: int, *, rounds: int, quiet: bool) -> list[dict[str, Any]]:
    from rlhf_pipeline.bench.storage_backends import BenchSpec
    from rlhf_pipeline.storage import create_store
    from rlhf_pipeline.storage.convert import convert
    from rlhf_pipeline.storage.filtering import filter_buffer

    spec = BenchSpec(completions=completions)
    with tempfile.TemporaryDirectory(prefix="bench-curation-") as tmp:
        source = Path(tmp) / "source"
        with create_store(source, "memmap", spec.schema, durable=False) as store:
            for batch in spec.batches():
                store.append(batch)
        log(f"[bench curation] filter: {completions} completions written", not quiet)
        methods = {
            "filter --dry-run (count)": lambda out: filter_buffer(source, None, WHERE),
            "filter --selection": lambda out: filter_buffer(source, out, WHERE, selection=True),
            "filter (new buffer)": lambda out: filter_buffer(source, out, WHERE, durable=False),
            "convert (baseline: copy all)": lambda out: convert(str(source), str(out), "memmap", durable=False),
        }
        per_round: dict[str, list[float]] = {name: [] for name in methods}
        kept: dict[str, int] = {}
        for number in range(rounds):
            for k, (name, run) in enumerate(methods.items()):
                out = Path(tmp) / f"out-{number}-{k}"
                start = time.perf_counter()
                result = run(out)
                per_round[name].append(time.perf_counter() - start)
                kept[name] = getattr(result, "rows_kept", getattr(result, "rows", None))
            log(f"[bench curation] filter round {number + 1}/{rounds}: "
                + ", ".join(f"{n} {t[-1]:.2f} s" for n, t in per_round.items()), not quiet)
    base = statistics.median(per_round["convert (baseline: copy all)"])
    return [{"measure": "filter", "method": name, "rows": completions, "rows_kept": kept[name],
             "seconds_median": statistics.median(times), "seconds_min": min(times), "seconds_rounds": times,
             "rows_per_s_median": completions / statistics.median(times),
             "time_vs_convert": statistics.median(times) / base}
            for name, times in per_round.items()]


# =========================================================================== report
def format_tables(records: list[dict[str, Any]]) -> str:
    lines = ["| prioritized step (sample 64 + update 64) | rows | µs/step median | µs/step min | speed vs plain |",
             "|---|---|---|---|---|"]
    for r in (r for r in records if r["measure"] == "prioritized"):
        lines.append(f"| {r['method']} | {r['rows']:,} | {r['us_per_step_median']:.0f} | {r['us_per_step_min']:.0f} "
                     f"| {r['speedup_vs_plain']:.2f}x |")
    lines += ["", "| filter | rows | kept | s median | s min | rows/s | time vs convert |",
              "|---|---|---|---|---|---|---|"]
    for r in (r for r in records if r["measure"] == "filter"):
        lines.append(f"| {r['method']} | {r['rows']:,} | {r['rows_kept']:,} | {r['seconds_median']:.2f} "
                     f"| {r['seconds_min']:.2f} | {r['rows_per_s_median']:,.0f} | {r['time_vs_convert']:.2f}x |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 1_000_000],
                        help="rows the prioritized sampler holds (default: %(default)s)")
    parser.add_argument("--completions", type=int, default=16_384,
                        help="synthetic completions in the filtered buffer (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="alternating rounds per measurement (default %(default)s)")
    parser.add_argument("--steps", type=int, default=200, help="prioritized steps per round (default %(default)s)")
    parser.add_argument("--only", choices=("prioritized", "filter"), help="run one of the two measurements")
    parser.add_argument("--json", action="store_true", help="print one JSON array of records")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def main(args: argparse.Namespace) -> int:
    if args.rounds < 1 or args.steps < 1 or args.completions < 1 or min(args.rows) < 1:
        raise SystemExit("--rounds, --steps, --completions and --rows must be >= 1")
    records: list[dict[str, Any]] = []
    if args.only in (None, "prioritized"):
        for rows in args.rows:
            records += bench_prioritized(rows, rounds=args.rounds, steps=args.steps, quiet=args.quiet)
    if args.only in (None, "filter"):
        records += bench_filter(args.completions, rounds=args.rounds, quiet=args.quiet)
    if args.json:
        print(json.dumps(records))
    else:
        print(f"curation benchmark: medians over {args.rounds} alternating rounds; filter --where {WHERE!r}")
        print(format_tables(records))
    return 0
