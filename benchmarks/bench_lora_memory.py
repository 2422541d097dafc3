"""The learner's memory with LoRA against full fine-tuning with a reference model, side by side on the
same model; what one weight sync carries; and how the loop engine should sample an adapter version.

Each mode runs in a fresh child process (its peak RSS is its own), on the same tiny Qwen2 built from a
config (``--hidden``, ``--layers``; 4 heads, the char tokenizer's vocabulary), on one thread:

- ``full``: the policy trains every weight (AdamW over all of them) and a frozen copy of the initial
  policy scores the reference log-probs, as a full fine-tuning run with a KL term holds it;
- ``lora``: the policy is the base frozen with a rank ``--rank`` adapter on every linear layer of a
  block (AdamW over the adapter only), and the reference is the same model with the adapter disabled
  (``transforms/ref_logprobs.py``: ``reference_of``, peft's ``disable_adapter``): no second model.

Each takes ``--steps`` steps: reference log-probs of a batch of ``--rows`` rows of ``--tokens`` tokens
(no gradient), then forward, backward and the optimizer step. Reported: parameters and trainable ones,
the optimizer state's MB, the reference copy's MB, the bytes of one published version (whole weights
against the adapter, as ``coordination/weights.py`` writes them), peak RSS over the process's RSS before
the model was built (``ru_maxrss``), and the median step time. Then, in the ``lora`` child, one round of
the loop's sampling (``generation/loop.py``'s ``decode_steps``: ``--rows`` prompts, ``--new-tokens``
tokens) with the adapter merged into the weights (what the loop engine does) against peft's unmerged
forward (two more matmuls per target layer per token).

    python benchmarks/bench_lora_memory.py                      # hidden 512, 8 layers: ~25 M parameters
    python benchmarks/bench_lora_memory.py --hidden 128 --layers 2 --steps 2 --json   # what the test runs
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

MODES = ("full", "lora")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux


def tensor_mb(tensors) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def child(mode: str, args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(1)
    from safetensors.torch import save

    from rlhf_pipeline.models import char_tokenizer, tiny_causal_lm
    from rlhf_pipeline.models.lora import adapter_tensors, with_lora
    from rlhf_pipeline.schema.ragged import RaggedTensor
    from rlhf_pipeline.transforms.ref_logprobs import reference_log_probs, reference_of

    import peft  # noqa: F401  (imported in both modes before the baseline: its modules are not the model's)

    vocab = len(char_tokenizer())
    baseline = rss_mb()
    policy = tiny_causal_lm(vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=4, seed=0).train()
    if mode == "full":
        reference = tiny_causal_lm(vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=4, seed=0)
        reference.requires_grad_(False)
        reference_mb = tensor_mb(reference.parameters())
        # own copies, as publish_weights makes them (a tied lm_head shares the embedding's memory)
        published = len(save({k: v.detach().clone() for k, v in policy.state_dict().items()}))
    else:
        policy = with_lora(policy, args.rank, 2.0 * args.rank, 0.0, TARGETS).train()
        reference, reference_mb = policy, 0.0
        published = len(save(adapter_tensors(policy)))
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    half = args.tokens // 2
    ids = torch.randint(2, vocab, (args.rows, args.tokens), generator=generator)
    prompts = RaggedTensor.from_sequences(ids[:, :half].tolist(), torch.int64)
    responses = RaggedTensor.from_sequences(ids[:, half:].tolist(), torch.int64)
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        with reference_of(reference):
            reference_log_probs(reference, prompts, responses)
        logits = policy(input_ids=ids).logits[:, half - 1:-1]
        loss = -logits.log_softmax(-1).gather(-1, ids[:, half:, None]).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    result = {
        "mode": mode, "parameters": sum(p.numel() for p in policy.parameters()),
        "trainable": sum(p.numel() for p in trainable), "optimizer_mb": tensor_mb(state),
        "reference_copy_mb": reference_mb, "published_bytes": published,
        "peak_rss_over_baseline_mb": peak_rss_mb() - baseline, "step_s_median": statistics.median(times),
    }
    if mode == "lora":
        result.update(sampling_round(policy, args))
    return result


def sampling_round(policy, args: argparse.Namespace) -> dict:
    """Seconds of one sampling round with the adapter merged into the weights, and through peft."""
    import torch

    from rlhf_pipeline.generation.loop import decode_steps
    from rlhf_pipeline.generation.sampling import SamplingConfig

    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.01)  # a trained adapter: not zero
    policy.eval()
    prompts = [[2 + (i * 7 + t) % 50 for t in range(args.tokens // 2)] for i in range(args.rows)]
    config = SamplingConfig(max_new_tokens=args.new_tokens)

    def round_s(model) -> float:
        started = time.perf_counter()
        for _ in decode_steps(model, prompts, config, pad_token_id=0, eos_token_id=1,
                              generator=torch.Generator().manual_seed(0)):
            pass
        return time.perf_counter() - started

    unmerged = min(round_s(policy) for _ in range(2))
    merged_model = policy.merge_and_unload()  # what the loop engine samples with: W0 + scaling * B @ A
    merged = min(round_s(merged_model) for _ in range(2))
    return {"round_s_peft_forward": unmerged, "round_s_merged": merged}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the results as one JSON document")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args)))
        return 0
    forwarded = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--json"]
    results = []
    for mode in MODES:
        done = subprocess.run([sys.executable, __file__, "--child", mode, *forwarded], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"bench_lora_memory: the {mode} child failed:\n{done.stderr[-2000:]}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    full, lora = results
    summary = {"peak_ratio_lora_over_full": lora["peak_rss_over_baseline_mb"] / full["peak_rss_over_baseline_mb"],
               "published_ratio": lora["published_bytes"] / full["published_bytes"], "load": load}
    if args.json:
        print(json.dumps({"modes": results, **summary}))
        return 0
    print(f"hidden {args.hidden}, {args.layers} layers, rank {args.rank}, {args.rows} rows x {args.tokens} tokens, "
          f"{args.steps} steps, 1 thread, load {load}")
    print(f"{'mode':5} {'params':>11} {'trainable':>10} {'optim MB':>9} {'ref copy MB':>11} {'sync MB':>8} "
          f"{'peak MB':>8} {'step s':>7}")
    for r in results:
        print(f"{r['mode']:5} {r['parameters']:>11,} {r['trainable']:>10,} {r['optimizer_mb']:>9.1f} "
              f"{r['reference_copy_mb']:>11.1f} {r['published_bytes'] / 2**20:>8.2f} "
              f"{r['peak_rss_over_baseline_mb']:>8.1f} {r['step_s_median']:>7.3f}")
    print(f"LoRA / full: peak memory {summary['peak_ratio_lora_over_full']:.2f}, bytes per sync "
          f"{summary['published_ratio']:.4f}")
    print(f"one sampling round of the adapter version: merged {lora['round_s_merged']:.3f} s, peft forward "
          f"{lora['round_s_peft_forward']:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
