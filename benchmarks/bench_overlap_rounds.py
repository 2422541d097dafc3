"""Rounds ahead: ``python benchmarks/bench_overlap_rounds.py [--engines vllm vllm-server] [--rounds 10] [--repeats 3] [--json [PATH]]``.

What ``generation.overlap_rounds`` buys: streamed rounds (``stream_groups``) one after the other,
against the same rounds with each next round submitted once the current round's first group ended
(``collect/overlap.py``), on one engine, prompts and seeds. The model and prompts are
``bench_stream_groups.py``'s (the default pipeline's shape with head size 32, warm-started on the toy
task, sampled at temperature 2 so some completions ramble to the limit: a round's long tail). A
collector writes to a memmap store; nothing else runs between rounds (a run's collector also saves its
position and reads pacing there, more time the engine idles without overlap).

Per engine and mode, ``--repeats`` runs of ``--rounds`` rounds each after one warm-up round (modes
alternate, the order flipped each repeat); printed, median and range over the repeats:

* ``rounds_per_s``: rounds over the wall time from the warm-up round's end to the last round's end;
* ``engine_idle_share``: the share of that time the engine had no request of the collector's in
  flight (``engine_idle_s``: from a round's last group to the next round's submission; 0 for a round
  submitted ahead before the previous one's last group ended);
* ``ahead``: rounds submitted ahead (all but the first, when overlap is on).

The load average before and after is printed: on a busy machine every time here stretches.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_stream_groups import engine_for, policy, spread, write_report  # noqa: E402  (the same model, prompts and engines)


def run_rounds(engine, tok, args, where: Path, overlap: bool) -> dict:
    from rlhf_pipeline.collect import Collector, CollectorConfig, PromptSource, SamplingConfig
    from rlhf_pipeline.collect.toy_task import toy_prompts, toy_reward
    from rlhf_pipeline.schema import StoreSchema
    from rlhf_pipeline.storage import create_store, make_replay_buffer

    store = create_store(where / f"{time.monotonic_ns()}", "memmap", schema=StoreSchema())
    config = CollectorConfig(prompts_per_batch=args.prompts, num_generations=args.group_size, seed=args.seed,
                             sampling=SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature),
                             stream_groups=True, overlap_rounds=overlap)
    source = PromptSource(toy_prompts(1000, seed=args.seed), seed=args.seed, required_fields=("answer",))
    collector = Collector(engine, tok, source, {"toy": toy_reward}, make_replay_buffer(store).extend, config)
    total = args.rounds + 1  # round 0 warms up
    idle, ahead, started = 0.0, 0, None
    for k in range(total):
        more = k + 1 < total
        collector.collect(next_round=lambda _rows: more)
        if k == 0:
            started = time.perf_counter()
            continue
        idle += collector.last_metrics.get("engine_idle_s", 0.0)
        ahead += int(collector.last_metrics.get("submitted_ahead", 0.0))
    elapsed = time.perf_counter() - started
    store.close()
    return {"rounds_per_s": args.rounds / elapsed, "engine_idle_share": idle / elapsed, "ahead": float(ahead)}


def bench_engine(name: str, model, tok, args, where: Path) -> dict:
    started = time.perf_counter()
    engine, server = engine_for(name, model, tok, where)
    start_s = time.perf_counter() - started
    runs: dict[bool, list[dict]] = {False: [], True: []}
    try:
        for repeat in range(args.repeats):
            for overlap in ((False, True) if repeat % 2 == 0 else (True, False)):
                runs[overlap].append(run_rounds(engine, tok, args, where, overlap))
    finally:
        engine.close()
        if server is not None:
            server.stop()
    summary = {"engine_start_s": start_s}
    for overlap, results in runs.items():
        summary["overlap" if overlap else "one_after_the_other"] = {
            key: spread([r[key] for r in results]) for key in results[0]}
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", nargs="+", choices=["vllm", "vllm-server"], default=["vllm"])
    parser.add_argument("--rounds", type=int, default=10, help="rounds counted per run (default 10)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per engine and mode (default 3)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts (groups) per round (default 16)")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="response limit (default 64)")
    parser.add_argument("--warm-start-steps", type=int, default=150, help="toy-task warm start (default 150)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=2.0, help="sampling temperature (default 2.0)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8, help="attention heads (head size hidden/heads: 32 for vLLM)")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                        help="write the results as JSON (to PATH, or stdout)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    load_before = os.getloadavg()
    model, tok = policy(args.warm_start_steps, args.seed, args.hidden, args.layers, args.heads)
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-overlap-") as where:
        for name in args.engines:
            results[name] = bench_engine(name, model, tok, args, Path(where))
    report = {"load_before": load_before, "load_after": os.getloadavg(), "settings": vars(args), "engines": results}
    print("| engine | rounds | rounds/s (median, range) | engine idle share (median, range) | rounds ahead |")
    print("|---|---|---|---|---|")
    for name, summary in results.items():
        for mode in ("one_after_the_other", "overlap"):
            s = summary[mode]
            print(f"| {name} | {mode.replace('_', ' ')} | {s['rounds_per_s']['median']:.3f} "
                  f"({s['rounds_per_s']['min']:.3f}-{s['rounds_per_s']['max']:.3f}) | "
                  f"{s['engine_idle_share']['median']:.3f} ({s['engine_idle_share']['min']:.3f}-"
                  f"{s['engine_idle_share']['max']:.3f}) | {s['ahead']['median']:.0f} of {args.rounds} |")
    starts = ", ".join(f"{name} {summary['engine_start_s']:.1f} s" for name, summary in results.items())
    print(f"engine start {starts}; load average before {load_before[0]:.2f}, after {report['load_after'][0]:.2f}")
    write_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
