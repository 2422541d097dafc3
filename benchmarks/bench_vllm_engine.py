"""Our sampling loop against a vLLM engine in its own process, on the same model, prompts and settings.

    python benchmarks/bench_vllm_engine.py                       # the default pipeline's model (138k parameters)
    python benchmarks/bench_vllm_engine.py --hidden 256 --heads 4 --layers 4 --repeats 5 --json

Both engines get the same requests: ``--prompts`` chat prompts of the toy task, ``--group`` completions
of each, up to ``--max-new-tokens`` tokens, temperature 1, seeds from the same generator state.
Timed, ``--repeats`` times each, in alternation (loop, vLLM, loop, ...) so both meet the same moments
of a shared machine: one ``sample`` call (generated tokens per second: tokens the completions hold,
EOS included), and for vLLM one ``update_weights`` of a state dict (the collector's route: written
to a safetensors file, reloaded in the engine's process, tied head repacked, prefix cache reset)
and the engine's start (once). Reports the median and the range, and the load before and after.
Needs the vLLM environment (``rlhf-pipeline setup-vllm``); our loop on ``--loop-threads`` threads
(default 1; vLLM's process binds its own).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--loop-threads", type=int, default=1, help="torch threads of our loop (default 1)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = parser.parse_args()

    import torch

    from rlhf_pipeline.collect.toy_task import toy_prompts
    from rlhf_pipeline.generation import SamplingConfig
    from rlhf_pipeline.generation.engine import SampleRequest
    from rlhf_pipeline.generation.loop import LoopEngine
    from rlhf_pipeline.generation.settings import find_vllm_python
    from rlhf_pipeline.generation.vllm_engine import VLLMEngine
    from rlhf_pipeline.models import tiny_model_and_tokenizer

    torch.set_num_threads(args.loop_threads)
    load_before = os.getloadavg()
    model, tok = tiny_model_and_tokenizer(hidden_size=args.hidden, num_heads=args.heads, num_layers=args.layers)
    other, _ = tiny_model_and_tokenizer(seed=1, hidden_size=args.hidden, num_heads=args.heads, num_layers=args.layers)
    parameters = sum(p.numel() for p in model.parameters())
    requests = [SampleRequest(record.render(tok), n=args.group) for record in toy_prompts(args.prompts, seed=0)]
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens)
    loop = LoopEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=[tok.eos_token_id])
    started = time.perf_counter()
    vllm = VLLMEngine.from_model(model, python=find_vllm_python(None), stop_token_ids=[tok.eos_token_id])
    start_s = time.perf_counter() - started
    rates: dict[str, list[float]] = {"loop": [], "vllm": []}
    updates: list[float] = []
    try:
        vllm.sample(requests, sampling, torch.Generator().manual_seed(0))  # its first call warms it up
        for repeat in range(args.repeats):
            for name, engine in (("loop", loop), ("vllm", vllm)):
                generator = torch.Generator().manual_seed(repeat)
                started = time.perf_counter()
                groups = engine.sample(requests, sampling, generator)
                elapsed = time.perf_counter() - started
                tokens = sum(len(c.token_ids) for g in groups for c in g.completions)
                rates[name].append(tokens / elapsed)
            weights = (other if repeat % 2 == 0 else model).state_dict()
            vllm.update_weights(weights, vllm.policy_version + 1)
            updates.append(vllm.stats.last_update_s)
    finally:
        vllm.close()
    load_after = os.getloadavg()

    def summary(values: list[float]) -> dict[str, float]:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    result = {
        "parameters": parameters, "prompts": args.prompts, "group": args.group,
        "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "loop_threads": args.loop_threads, "vllm": vllm.vllm_version,
        "loop_tokens_per_s": summary(rates["loop"]), "vllm_tokens_per_s": summary(rates["vllm"]),
        "weight_update_s": summary(updates), "engine_start_s": start_s,
        "load_before": load_before[0], "load_after": load_after[0],
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"model {parameters:,} parameters; {args.prompts} prompts x {args.group}, up to {args.max_new_tokens} "
          f"tokens; {args.repeats} repeats; our loop on {args.loop_threads} thread(s); vLLM {result['vllm']}; load {load_before[0]:.1f} -> {load_after[0]:.1f}")
    for label, key, unit in (("our loop", "loop_tokens_per_s", "tokens/s"), ("vLLM", "vllm_tokens_per_s", "tokens/s"),
                             ("weight update", "weight_update_s", "s")):
        s = result[key]
        print(f"  {label:<14} {s['median']:>10.3f} {unit}  (range {s['min']:.3f}-{s['max']:.3f})")
    print(f"  engine start   {start_s:>10.1f} s")


if __name__ == "__main__":
    main()
