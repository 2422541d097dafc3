"""Streamed rounds: ``python benchmarks/bench_stream_groups.py [--engines loop vllm vllm-server] [--rounds 8] [--json [PATH]]``.

How soon a round's first group reaches the buffer with ``generation.stream_groups`` on, against the
round's end, for our loop, the vLLM engine the collector owns and a vLLM server at a URL: the default pipeline's model shape
with two heads (hidden 64, 2 layers, head size 32, which vLLM's CPU attention takes), warm-started on
the toy task so completions end at different lengths as a policy's do (most answer in a few tokens,
some run to ``max_new_tokens``), a collector writing to a memmap store.

Per engine, rounds alternate streamed and whole (one append) on the same engine, prompts and seeds;
the first of each is a warm-up and not counted. Printed per engine, median and range over rounds:

* ``first_group_s``: round start to the first committed group (streamed);
* ``first_ended_s``: to the first group the engine finished: what committing in the order groups end
  would give (what in-order commit costs is ``first_group_s - first_ended_s``);
* ``order_wait_s``: mean seconds a finished group waited behind earlier unfinished ones;
* ``round_s``: to the last commit, streamed and whole (``whole_round_s``): what streaming costs or saves
  on the round itself;
* ``chunks`` and ``groups_per_chunk``: appends per round.

The load average before and after is printed: on a busy machine every time here stretches.
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

METRICS = ("first_group_s", "first_ended_s", "order_wait_s", "round_s", "chunks", "groups_per_chunk")


def policy(warm_start_steps: int, seed: int, hidden: int, layers: int, heads: int):
    import torch

    from rlhf_pipeline.collect.toy_task import warm_start
    from rlhf_pipeline.models import tiny_model_and_tokenizer

    torch.manual_seed(seed)
    model, tok = tiny_model_and_tokenizer(hidden_size=hidden, num_layers=layers, num_heads=heads, seed=seed)
    if warm_start_steps:
        warm_start(model, tok, warm_start_steps, lr=3e-3, seed=seed)
    return model, tok


def raise_eos_logit(model, tok, bias: float) -> None:
    """Adds ``bias`` to the EOS logit in this process (the loop engine only): completion lengths then
    fall off geometrically up to the limit, a longer tail than the warm-started policy's."""
    import torch

    shift = torch.zeros(model.config.vocab_size)
    shift[tok.eos_token_id] = bias
    model.lm_head.register_forward_hook(lambda module, inputs, logits: logits + shift)


def engine_for(name: str, model, tok, where: Path):
    """``(engine, server)``: loop or vllm as a pipeline makes them; vllm-server: a vLLM server started
    here (``rlhf_pipeline/bench/vllm_server_process.py``, as ``bench generation`` does) at a URL."""
    from rlhf_pipeline.generation.settings import GenerationSettings, find_vllm_python, make_engine

    if name != "vllm-server":
        return make_engine(GenerationSettings(engine=name), model, pad_token_id=tok.pad_token_id,
                           stop_token_ids=[tok.eos_token_id]), None
    from rlhf_pipeline.bench.vllm_server_process import VLLMServerProcess, save_model_dir
    from rlhf_pipeline.generation.vllm_url import VLLMURLEngine

    server = VLLMServerProcess(find_vllm_python(None), save_model_dir(model, tok, where / "model"), where)
    return VLLMURLEngine(server.url, model, stop_token_ids=[tok.eos_token_id], tokenizer=tok), server


def bench_engine(name: str, model, tok, args, where: Path) -> dict:
    from rlhf_pipeline.collect import Collector, CollectorConfig, PromptSource, SamplingConfig
    from rlhf_pipeline.collect.toy_task import toy_prompts, toy_reward
    from rlhf_pipeline.schema import StoreSchema
    from rlhf_pipeline.storage import create_store, make_replay_buffer

    started = time.perf_counter()
    engine, server = engine_for(name, model, tok, where)
    start_s = time.perf_counter() - started
    streamed: dict[str, list[float]] = {k: [] for k in METRICS}
    whole: list[float] = []
    lengths: list[int] = []
    try:
        collectors = {}
        for stream in (True, False):
            store = create_store(where / f"{name}-{'stream' if stream else 'whole'}", "memmap", schema=StoreSchema())
            config = CollectorConfig(prompts_per_batch=args.prompts, num_generations=args.group_size, seed=args.seed,
                                     sampling=SamplingConfig(max_new_tokens=args.max_new_tokens,
                                                             temperature=args.temperature), stream_groups=stream)
            source = PromptSource(toy_prompts(1000, seed=args.seed), seed=args.seed, required_fields=("answer",))
            collectors[stream] = Collector(engine, tok, source, {"toy": toy_reward}, make_replay_buffer(store).extend, config)
        for round_index in range(args.rounds + 1):  # round 0 warms each up
            for stream, collector in collectors.items():
                t0 = time.perf_counter()
                batch = collector.collect()
                elapsed = time.perf_counter() - t0
                if round_index == 0:
                    continue
                if stream:
                    for key in METRICS:
                        streamed[key].append(collector.last_metrics[key])
                    lengths += batch["response_tokens"].lengths().tolist()
                else:
                    whole.append(elapsed)
    finally:
        engine.close()
        if server is not None:
            server.stop()
    summary = {key: spread(values) for key, values in streamed.items()}
    summary["whole_round_s"] = spread(whole)
    summary["engine_start_s"] = start_s
    summary["response_len"] = {"median": statistics.median(lengths), "max": max(lengths),
                               f"at_limit_{args.max_new_tokens}": sum(x == args.max_new_tokens for x in lengths) / len(lengths)}
    return summary


def spread(values: list[float]) -> dict[str, float]:
    """Median, range and count of a figure over repeats (what every table here prints)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def write_report(report: dict, where: str | None) -> None:
    """``--json``: the report as JSON to stdout (``-``) or to the file named; None: nothing."""
    if where is None:
        return
    text = json.dumps(report, indent=2)
    if where == "-":
        print(text)
    else:
        Path(where).write_text(text + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", nargs="+", choices=["loop", "vllm", "vllm-server"],
                        default=["loop", "vllm", "vllm-server"])
    parser.add_argument("--rounds", type=int, default=8, help="rounds counted per engine and mode (default 8)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts (groups) per round (default 16)")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="response limit (default 64)")
    parser.add_argument("--warm-start-steps", type=int, default=150, help="toy-task warm start (default 150)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=2.0,
                        help="sampling temperature (default 2.0, vLLM's highest: the warm-started policy then "
                             "rambles past its answer in some completions, a round's long tail)")
    parser.add_argument("--eos-bias", type=float, default=0.0,
                        help="with --engines loop --warm-start-steps 0: add this to the EOS logit (a geometric tail)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (default 256: bench generation's 2m)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8, help="attention heads (head size hidden/heads: 32 for vLLM)")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                        help="write the results as JSON (to PATH, or stdout)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    load_before = os.getloadavg()
    if args.eos_bias and args.engines != ["loop"]:
        parser.error("--eos-bias changes the model in this process: run it with --engines loop")
    model, tok = policy(args.warm_start_steps, args.seed, args.hidden, args.layers, args.heads)
    if args.eos_bias:
        raise_eos_logit(model, tok, args.eos_bias)
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-stream-") as where:
        for name in args.engines:
            results[name] = bench_engine(name, model, tok, args, Path(where))
    report = {"load_before": load_before, "load_after": os.getloadavg(), "settings": vars(args), "engines": results}
    for name, summary in results.items():
        print(f"{name}: engine start {summary['engine_start_s']:.1f} s; response length median "
              f"{summary['response_len']['median']}, max {summary['response_len']['max']}")
        for key in (*METRICS, "whole_round_s"):
            s = summary[key]
            print(f"  {key:>16}: median {s['median']:.4f}  range {s['min']:.4f}-{s['max']:.4f}  (n={s['n']})")
    print(f"load average before {load_before[0]:.2f}, after {report['load_after'][0]:.2f}")
    write_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
