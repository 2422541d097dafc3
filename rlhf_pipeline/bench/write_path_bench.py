"""Write-path benchmark: group advantage + KL reward on the way into the buffer, per completion.

Our stores behind a ``ReplayBuffer`` with the transforms attached, against torchrl's
``MCAdvantage`` + ``LazyStackStorage``, raw files of the final rows (the floor) and
``memmap-append-only`` (the store alone). Reports ``write_path_us_per_completion``, ``vs_raw`` and
``stack_us_per_completion`` (transforms alone); ``--no-fsync`` compares like with like,
``--misaligned`` leaves half a group pending per write, ``--ref-completions N`` times the reference
model. Figures: docs/benchmarks.md#write-path-rlhf-pipeline-bench-write-path.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BACKENDS = ("raw-numpy", "memmap-append-only", "memmap", "zarr", "torchrl-mcadvantage-lazystack")
FULL_FIELDS = ("advantage", "ref_log_probs", "kl", "token_rewards")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--completions", type=int, default=4096, help="completions written (default %(default)s)")
    parser.add_argument("--group-size", type=int, default=8, help="GRPO group size (default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=512, help="rows per extend (default %(default)s)")
    parser.add_argument("--backends", nargs="+", default=None, metavar="NAME",
                        help=f"backends to run, in order (default: all of {list(BACKENDS)})")
    parser.add_argument("--misaligned", action="store_true",
                        help="shift writes by half a group so every extend leaves a group pending")
    parser.add_argument("--ref-completions", type=int, default=64,
                        help="completions scored by a tiny reference model for tokens/s (0: skip)")
    parser.add_argument("--no-fsync", action="store_true",
                        help="create stores with durable=False (raw-numpy never fsyncs either)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON array of records")


def main(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(1)
    backends = args.backends or list(BACKENDS)
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise SystemExit(f"unknown backend(s) {unknown}; choose from {list(BACKENDS)}")
    if args.completions < 1 or args.batch_size < 1 or args.completions % args.group_size:
        raise SystemExit("--completions must be a positive multiple of --group-size; --batch-size >= 1")
    records = []
    for name in backends:
        _log(f"[bench write-path] {name}: {args.completions} completions")
        record = run_backend(name, args)
        if record is None:
            _log(f"[bench write-path] {name}: not available here, skipped")
            continue
        records.append(record)
        gc.collect()
    base = next((r for r in records if r["backend"] == "raw-numpy"), None)
    for r in records:
        r["vs_raw"] = r["write_path_us_per_completion"] / base["write_path_us_per_completion"] if base else None
    if args.ref_completions:
        records.append(reference_model_record(args.ref_completions, args.seed))
    if args.json:
        print(json.dumps(records))
    else:
        print(format_table(records, args))
    return 0


# ============================================================================ data
def _batches(args, optional_fields: tuple[str, ...]) -> list:
    from rlhf_pipeline.schema.synthetic import synthetic_batches

    batches = list(synthetic_batches(args.completions, group_size=args.group_size, batch_size=args.batch_size,
                                     seed=args.seed, optional_fields=optional_fields))
    return list(_misaligned(batches, args.group_size // 2)) if args.misaligned else batches


def _misaligned(batches: list, shift: int) -> Iterator:
    """The same rows re-cut so each write ends ``shift`` rows into a group."""
    from rlhf_pipeline.schema import TrajectoryBatch

    whole = TrajectoryBatch.cat(batches)
    size = len(batches[0])
    cuts = [0, *range(size - shift, len(whole), size), len(whole)]
    for a, b in zip(cuts[:-1], cuts[1:]):
        if b > a:
            yield whole.select(slice(a, b))


# ============================================================================ backends
def run_backend(name: str, args) -> dict[str, Any] | None:
    with tempfile.TemporaryDirectory(prefix="bench-write-path-") as tmp:
        if name == "raw-numpy":
            seconds = _run_raw(Path(tmp), args)
            extra: dict[str, Any] = {}
        elif name == "memmap-append-only":
            seconds = _run_append_only(Path(tmp), args)
            extra = {}
        elif name == "torchrl-mcadvantage-lazystack":
            seconds = _run_torchrl(args)
            extra = {}
        else:
            result = _run_ours(name, Path(tmp), args)
            if result is None:
                return None
            seconds, extra = result
    return {"backend": name, "completions": args.completions, "misaligned": bool(args.misaligned),
            "fsync": not args.no_fsync,
            "write_path_us_per_completion": seconds / args.completions * 1e6, **extra}


def _run_raw(directory: Path, args) -> float:
    from rlhf_pipeline.bench.baselines import RawNumpyBackend
    from rlhf_pipeline.bench.storage_backends import BenchSpec

    batches = _batches(args, FULL_FIELDS)
    backend = RawNumpyBackend()
    backend.setup(directory, BenchSpec(completions=args.completions, group_size=args.group_size,
                                       optional_fields=FULL_FIELDS))
    start = time.perf_counter()
    for batch in batches:
        backend.write(batch)
    backend.finish_writes()
    return time.perf_counter() - start


def _run_append_only(directory: Path, args) -> float:
    batches = _batches(args, FULL_FIELDS)
    store = _create_store("memmap", directory / "buffer", durable=not args.no_fsync)
    start = time.perf_counter()
    for batch in batches:
        store.append(batch)
    seconds = time.perf_counter() - start
    store.close()
    return seconds


def _create_store(name: str, path: Path, *, durable: bool):
    from rlhf_pipeline.schema import StoreSchema
    from rlhf_pipeline.storage import create_store

    try:
        return create_store(str(path), backend=name, schema=StoreSchema(FULL_FIELDS), durable=durable)
    except (KeyError, ValueError, ModuleNotFoundError) as err:
        _log(f"[bench write-path] {name}: {err}")
        return None


def _run_ours(name: str, directory: Path, args) -> tuple[float, dict[str, Any]] | None:
    from rlhf_pipeline.storage.torchrl_glue import make_replay_buffer
    from rlhf_pipeline.transforms import GroupAdvantage, KLReward, attach_write_path

    batches = _batches(args, ("ref_log_probs",))
    store = _create_store(name, directory / "buffer", durable=not args.no_fsync)
    if store is None:
        return None
    try:
        ga = GroupAdvantage(args.group_size)
        rb = attach_write_path(make_replay_buffer(store), ga, KLReward(0.05))
        start = time.perf_counter()
        for batch in batches:
            rb.extend(batch)
        seconds = time.perf_counter() - start
        if store.next_row != args.completions:
            raise RuntimeError(f"{name}: {store.next_row} rows stored, expected {args.completions}")
    finally:
        store.close()
    # the transforms alone, on the same rows, with no store behind them
    ga, kl = GroupAdvantage(args.group_size), KLReward(0.05)
    start = time.perf_counter()
    for batch in batches:
        kl.write(ga.write(batch))
    stack = time.perf_counter() - start
    return seconds, {"stack_us_per_completion": stack / args.completions * 1e6,
                     "groups_written": ga.metrics()["groups_written"]}


def _run_torchrl(args) -> float:
    from torchrl.data import LazyStackStorage, ReplayBuffer
    from torchrl.objectives.llm import MCAdvantage

    tds = [b.to_tensordict() for b in _batches(args, ("ref_log_probs",))]  # conversion not timed
    rb = ReplayBuffer(storage=LazyStackStorage(max_size=args.completions))
    mc = MCAdvantage(grpo_size=args.group_size, prompt_key="group_id")
    rb.append_transform(mc)  # MCAdvantage implements _inv_call, which extend runs without invert
    start = time.perf_counter()
    for td in tds:
        rb.extend(td)
    seconds = time.perf_counter() - start
    if len(rb) != args.completions:
        raise RuntimeError(f"torchrl buffer holds {len(rb)} rows, expected {args.completions}")
    return seconds


def reference_model_record(n: int, seed: int) -> dict[str, Any]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_pipeline.schema.synthetic import synthetic_batch
    from rlhf_pipeline.transforms import reference_log_probs

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=32_000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    model = LlamaForCausalLM(config).eval()
    batch = synthetic_batch(n, group_size=8 if n % 8 == 0 else 1, seed=seed)
    tokens = int(batch["prompt_tokens"].values.numel() + batch["response_tokens"].values.numel())
    start = time.perf_counter()
    reference_log_probs(model, batch["prompt_tokens"], batch["response_tokens"], tokens_per_microbatch=4096)
    seconds = time.perf_counter() - start
    return {"backend": "reference-model", "completions": n, "model": "tiny-llama h64 L2 V32000",
            "ref_tokens_per_s": tokens / seconds, "ref_us_per_completion": seconds / n * 1e6}


# ============================================================================ report
def format_table(records: list[dict[str, Any]], args) -> str:
    lines = [f"write-path benchmark: {args.completions} completions, groups of {args.group_size}, extends of "
             f"{args.batch_size} rows{' (misaligned by half a group)' if args.misaligned else ''}, "
             f"{'no fsync' if args.no_fsync else 'stores fsync each append'}",
             "| backend | write path µs/compl | vs raw | transforms alone µs/compl |", "|---|---|---|---|"]
    for r in records:
        if "write_path_us_per_completion" not in r:
            continue
        ratio = f"{r['vs_raw']:.2f}x" if r.get("vs_raw") is not None else "-"
        stack = f"{r['stack_us_per_completion']:.1f}" if "stack_us_per_completion" in r else "-"
        lines.append(f"| {r['backend']} | {r['write_path_us_per_completion']:.1f} | {ratio} | {stack} |")
    for r in records:
        if r["backend"] == "reference-model":
            lines.append(f"\nreference model ({r['model']}, CPU): {r['ref_tokens_per_s']:.0f} tokens/s, "
                         f"{r['ref_us_per_completion'] / 1e3:.1f} ms/completion")
    return "\n".join(lines)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
