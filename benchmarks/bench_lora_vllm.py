"""Tokens per second of the collector's vLLM engine with and without a LoRA adapter, side by side on one
model and one machine; and what loading one adapter version costs (its load and its canary).

Two engines (``generation/vllm_engine.py``), one after the other, on a tiny Qwen2 built from a config
(``--hidden``, ``--layers``, head size 32 or more for vLLM's CPU attention):

- ``plain``: a server started without LoRA, as a full fine-tuning run starts it;
- ``lora``: a server started for a rank ``--rank`` run (``--enable-lora``, ``vllm_adapters.py``), measured
  first sampling the base (version 0: requests name no adapter), then with an adapter version loaded
  (every linear layer of a block, its B drawn so the adapter is not zero) and every request naming it.

Each measurement is ``--rounds`` rounds of ``--prompts`` prompts x ``--group`` completions of
``--new-tokens`` tokens (EOS ignored: every completion has that many), after one round of warm-up;
reported: new tokens per second over the rounds (the median round). vLLM reports 2-4x slower decoding
with LoRA on GPUs, from the Punica kernels; on a CPU they run as PyTorch fallbacks.

    python benchmarks/bench_lora_vllm.py                          # hidden 256, 4 layers
    python benchmarks/bench_lora_vllm.py --hidden 64 --layers 2 --rounds 2
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time


def tokens_per_second(engine, prompts, args) -> float:
    from rlhf_pipeline.generation import SampleRequest, SamplingConfig

    sampling = SamplingConfig(max_new_tokens=args.new_tokens)
    rates = []
    for round_index in range(args.rounds + 1):
        requests = [SampleRequest(p, n=args.group) for p in prompts]
        started = time.perf_counter()
        groups = engine.sample(requests, list(range(round_index * 1000, round_index * 1000 + len(requests))),
                               sampling)
        elapsed = time.perf_counter() - started
        tokens = sum(len(c.token_ids) for g in groups for c in g.completions)
        if round_index:  # the first round warms the engine up
            rates.append(tokens / elapsed)
    return statistics.median(rates)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args(argv)

    import os

    import torch

    from rlhf_pipeline.generation.settings import find_vllm_python
    from rlhf_pipeline.generation.vllm_adapters import AdapterServing
    from rlhf_pipeline.generation.vllm_engine import VLLMEngine
    from rlhf_pipeline.learn.settings import LoraSettings
    from rlhf_pipeline.models import tiny_model_and_tokenizer
    from rlhf_pipeline.models.lora import PolicyAdapter, adapter_config_of, adapter_tensors, canary_of, with_lora

    torch.set_num_threads(1)
    python = find_vllm_python(None)
    model, tok = tiny_model_and_tokenizer(seed=0, hidden_size=args.hidden, num_layers=args.layers,
                                          num_heads=max(1, args.hidden // 64))
    prompts = [tok(f"{i}+{i * 7}=", add_special_tokens=False)["input_ids"] for i in range(args.prompts)]
    lora = LoraSettings(rank=args.rank)
    policy = with_lora(copy.deepcopy(model), lora.rank, lora.alpha, 0.0, list(lora.target_modules))
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.02)
    adapter = PolicyAdapter(adapter_tensors(policy), config=adapter_config_of(policy), base_digest="",
                            canary=canary_of(policy, model.config.vocab_size, 1))
    figures: dict[str, float] = {}
    engine = VLLMEngine.from_model(copy.deepcopy(model), python=python, stop_token_ids=[tok.eos_token_id])
    try:
        figures["plain_tokens_per_s"] = tokens_per_second(engine, prompts, args)
    finally:
        engine.close()
    engine = VLLMEngine.from_model(copy.deepcopy(model), python=python, stop_token_ids=[tok.eos_token_id],
                                   adapters=AdapterServing.of(lora, max_staleness=1))
    try:
        figures["lora_server_base_tokens_per_s"] = tokens_per_second(engine, prompts, args)
        started = time.perf_counter()
        engine.load_weights(adapter, 1)
        figures["adapter_version_load_s"] = time.perf_counter() - started  # write, load, canary
        figures["adapter_load_request_s"] = engine.adapters.last_load_s
        figures["canary_difference"] = engine.adapters.last_difference
        figures["adapter_tokens_per_s"] = tokens_per_second(engine, prompts, args)
    finally:
        engine.close()
    with open("/proc/loadavg") as file:
        load = " ".join(file.read().split()[:3])
    parameters = sum(p.numel() for p in model.parameters())
    if args.json:
        print(json.dumps({**figures, "parameters": parameters, "load": load}))
        return
    print(f"hidden {args.hidden}, {args.layers} layers ({parameters:,} parameters), rank {args.rank}, "
          f"{args.prompts} prompts x {args.group} x {args.new_tokens} tokens, {args.rounds} rounds, "
          f"OMP threads {os.environ.get('OMP_NUM_THREADS', 1)}, load {load}")
    print(f"{'engine':<34}{'tokens/s':>10}")
    print(f"{'plain server':<34}{figures['plain_tokens_per_s']:>10.0f}")
    print(f"{'LoRA server, base (no adapter)':<34}{figures['lora_server_base_tokens_per_s']:>10.0f}")
    print(f"{'LoRA server, adapter v1':<34}{figures['adapter_tokens_per_s']:>10.0f}")
    print(f"adapter / plain: {figures['adapter_tokens_per_s'] / figures['plain_tokens_per_s']:.2f}; one version "
          f"loaded in {figures['adapter_version_load_s']:.2f} s (its load request "
          f"{figures['adapter_load_request_s']:.3f} s, the rest the canary), canary difference "
          f"{figures['canary_difference']:.2g}")


if __name__ == "__main__":
    from rlhf_pipeline.bench.page import script_main

    sys.exit(script_main(__file__, main, sys.argv[1:]))
