"""Full fine-tuning against LoRA, side by side on one model: what a weight sync costs (bytes, and the
seconds of the learner's publish and of the engine's load), the learner's peak memory and step time,
and the collector's tokens/s with the version applied.

Each mode runs ``--repeats`` times, each in a fresh child process (its peak RSS is its own), on the same
tiny Qwen2 built from a config (``--hidden``, ``--layers``; 4 heads, the char tokenizer's vocabulary), on
one thread; figures are medians over the repeats with their spread (min-max):

- ``full``: the policy trains every weight (AdamW over all of them) and a frozen copy of the initial
  policy scores the reference log-probs, as a full fine-tuning run with a KL term holds it; a sync
  publishes the whole weights and the engine loads them;
- ``lora``: the policy is the base frozen with a rank ``--rank`` adapter on every linear layer of a block
  (the learner's ``LoraPolicy``; AdamW over the adapter only), and the reference is the same model with
  the adapter disabled (``transforms/ref_logprobs.py``: ``reference_of``): no second model; a sync
  publishes the adapter with its canary, and the engine merges it into the base it holds and checks
  the canary (``generation/loop.py``).

A child first takes ``--steps`` learner steps (reference log-probs of ``--rows`` rows of ``--tokens``
tokens, then forward, backward, optimizer step): the step time, the optimizer state's and the reference
copy's MB, and the peak RSS over the process's RSS before the model was built (``ru_maxrss``, read
before the engine is built). Then ``--syncs`` syncs, each after one more step: ``publish_weights`` into a
run directory (``coordination/weights.py``, as the learner publishes) and the collector's side,
``WeightsPoller.poll`` and the engine's ``load_weights`` (the engine holding version 0 already, as a
running collector does). Then one sampling round of ``--rows`` prompts of ``--new-tokens`` tokens
through the engine: tokens/s with the version applied (the loop engine samples an adapter merged; in
the ``lora`` child also peft's unmerged forward, two more matmuls per target layer per token).

``--engines`` names the engines that load and sample (``ENGINES``: the loop engine now; a vLLM engine
adds its column there).

    python benchmarks/bench_lora_sync.py                      # hidden 512, 8 layers: ~34 M parameters
    python benchmarks/bench_lora_sync.py --hidden 64 --layers 1 --steps 1 --syncs 1 --repeats 1 --json   # the test's
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

MODES = ("full", "lora")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: figures each child reports that the summary gives as a median and a spread over the repeats
FIGURES = ("step_s", "peak_rss_over_baseline_mb", "publish_s", "load_s", "tokens_per_s")


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux


def tensor_mb(tensors) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def loop_engine(model, vocab: int):
    """The loop engine sampling with ``model`` (what a collector of a run builds)."""
    from rlhf_pipeline.generation.loop import LoopEngine

    return LoopEngine(model, pad_token_id=0, eos_token_id=vocab + 1)  # an id never sampled: full-length rounds


ENGINES = {"loop": loop_engine}


def child(mode: str, engine_name: str, args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(1)
    from rlhf_pipeline.coordination.weights import WeightsPoller, publish_weights
    from rlhf_pipeline.learn.lora import LoraPolicy
    from rlhf_pipeline.learn.settings import LoraSettings
    from rlhf_pipeline.models import char_tokenizer, tiny_causal_lm
    from rlhf_pipeline.schema.ragged import RaggedTensor
    from rlhf_pipeline.transforms.ref_logprobs import reference_log_probs, reference_of

    import peft  # noqa: F401  (imported in both modes before the baseline: its modules are not the model's)

    vocab = len(char_tokenizer())

    def build():
        return tiny_causal_lm(vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=4, seed=0)

    baseline = rss_mb()
    policy = build().train()
    base_state = {k: v.detach().clone() for k, v in policy.state_dict().items()}  # version 0, as published
    lora = None
    if mode == "full":
        reference = build()
        reference.requires_grad_(False)
        reference_mb = tensor_mb(reference.parameters())
    else:
        lora = LoraPolicy(LoraSettings(rank=args.rank, alpha=2.0 * args.rank, target_modules=TARGETS), base_state)
        policy = lora.wrap(policy).train()
        reference, reference_mb = policy, 0.0
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    half = args.tokens // 2
    ids = torch.randint(2, vocab, (args.rows, args.tokens), generator=generator)
    prompts = RaggedTensor.from_sequences(ids[:, :half].tolist(), torch.int64)
    responses = RaggedTensor.from_sequences(ids[:, half:].tolist(), torch.int64)

    def step() -> float:
        started = time.perf_counter()
        with reference_of(reference):
            reference_log_probs(reference, prompts, responses)
        logits = policy(input_ids=ids).logits[:, half - 1:-1]
        loss = -logits.log_softmax(-1).gather(-1, ids[:, half:, None]).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    step_times = [step() for _ in range(args.steps)]
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    result = {
        "mode": mode, "engine": engine_name, "parameters": sum(p.numel() for p in policy.parameters()),
        "trainable": sum(p.numel() for p in trainable), "optimizer_mb": tensor_mb(state),
        "reference_copy_mb": reference_mb, "peak_rss_over_baseline_mb": peak_rss_mb() - baseline,
        "step_s": statistics.median(step_times),
    }

    with tempfile.TemporaryDirectory() as run:
        publish_weights(run, base_state, 0)
        engine = ENGINES[engine_name](build(), vocab)
        poller = WeightsPoller(run)
        engine.load_weights(*poller.poll())  # version 0: the base a collector holds from its start
        publish_s, load_s, sizes = [], [], []
        for version in range(1, args.syncs + 1):
            step()
            started = time.perf_counter()
            published = policy.state_dict() if lora is None else lora.publication(policy, version)
            publish_weights(run, published, version, keep_versions=(0,))
            publish_s.append(time.perf_counter() - started)
            sizes.append(os.path.getsize(os.path.join(run, "weights", f"policy_{version:08d}.safetensors")))
            started = time.perf_counter()
            engine.load_weights(*poller.poll())
            load_s.append(time.perf_counter() - started)
        result.update(published_bytes=statistics.median(sizes), publish_s=statistics.median(publish_s),
                      load_s=statistics.median(load_s), tokens_per_s=tokens_per_s(engine, args))
        engine.close()
    if lora is not None:
        result.update(peft_forward_round(policy, args))
    return result


def tokens_per_s(engine, args: argparse.Namespace) -> float:
    """Sampled tokens a second over one round of ``--rows`` prompts through ``engine``."""
    from rlhf_pipeline.generation.engine import SampleRequest
    from rlhf_pipeline.generation.sampling import SamplingConfig

    requests = [SampleRequest([2 + (i * 7 + t) % 50 for t in range(args.tokens // 2)]) for i in range(args.rows)]
    started = time.perf_counter()
    groups = engine.sample(requests, list(range(args.rows)), SamplingConfig(max_new_tokens=args.new_tokens))
    elapsed = time.perf_counter() - started
    return sum(len(c.token_ids) for group in groups for c in group.completions) / elapsed


def peft_forward_round(policy, args: argparse.Namespace) -> dict:
    """Seconds of the same round through peft's unmerged forward, against the merged model."""
    import torch

    from rlhf_pipeline.generation.loop import decode_steps
    from rlhf_pipeline.generation.sampling import SamplingConfig

    policy.eval()
    prompts = [[2 + (i * 7 + t) % 50 for t in range(args.tokens // 2)] for i in range(args.rows)]
    config = SamplingConfig(max_new_tokens=args.new_tokens)

    def round_s(model) -> float:
        started = time.perf_counter()
        for _ in decode_steps(model, prompts, config, pad_token_id=0, eos_token_id=1,
                              generator=torch.Generator().manual_seed(0)):
            pass
        return time.perf_counter() - started

    return {"round_s_peft_forward": round_s(policy), "round_s_merged": round_s(policy.merge_and_unload())}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help="learner steps timed before the syncs")
    parser.add_argument("--syncs", type=int, default=3, help="weight syncs timed, each after one more step")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per mode and engine")
    parser.add_argument("--engines", default="loop", help=f"comma-separated, of {', '.join(ENGINES)}")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON document")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "ENGINE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, args)))
        return 0
    engines = args.engines.split(",")
    unknown = [name for name in engines if name not in ENGINES]
    if unknown:
        parser.error(f"--engines: unknown engine(s) {unknown}; known: {', '.join(ENGINES)}")
    forwarded = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--json"]
    runs: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.repeats):  # interleaved: a load that changes over the run hits both modes alike
        for engine in engines:
            for mode in MODES:
                done = subprocess.run([sys.executable, __file__, *forwarded, "--child", mode, engine],
                                      capture_output=True, text=True)
                if done.returncode != 0:
                    raise SystemExit(f"bench_lora_sync: the {mode} child ({engine}) failed:\n{done.stderr[-2000:]}")
                runs.setdefault((mode, engine), []).append(json.loads(done.stdout.strip().splitlines()[-1]))
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    results = []
    for (mode, engine), children in runs.items():
        summary = {k: v for k, v in children[0].items() if k not in FIGURES}
        summary.update({figure: spread([c[figure] for c in children]) for figure in FIGURES})
        for extra in ("round_s_peft_forward", "round_s_merged"):
            if extra in children[0]:
                summary[extra] = spread([c[extra] for c in children])
        results.append(summary)
    if args.json:
        print(json.dumps({"modes": results, "load": load, "repeats": args.repeats}))
        return 0
    print(f"hidden {args.hidden}, {args.layers} layers, rank {args.rank}, {args.rows} rows x {args.tokens} tokens, "
          f"{args.steps} steps, {args.syncs} syncs, {args.repeats} repeats, 1 thread, load {load}")
    print("medians over the repeats [min-max]")
    print(f"{'mode':5} {'engine':6} {'params':>11} {'trainable':>10} {'optim MB':>8} {'ref MB':>7} {'sync MB':>8} "
          f"{'publish s':>17} {'load s':>17} {'peak MB':>17} {'step s':>17} {'tokens/s':>17}")

    def shown(figure: dict, digits: int) -> str:
        return f"{figure['median']:.{digits}f} [{figure['min']:.{digits}f}-{figure['max']:.{digits}f}]"

    for r in results:
        print(f"{r['mode']:5} {r['engine']:6} {r['parameters']:>11,} {r['trainable']:>10,} {r['optimizer_mb']:>8.1f} "
              f"{r['reference_copy_mb']:>7.1f} {r['published_bytes'] / 2**20:>8.2f} {shown(r['publish_s'], 3):>17} "
              f"{shown(r['load_s'], 3):>17} {shown(r['peak_rss_over_baseline_mb'], 0):>17} "
              f"{shown(r['step_s'], 2):>17} {shown(r['tokens_per_s'], 1):>17}")
    for engine in engines:
        full, lora = (next(r for r in results if r["mode"] == m and r["engine"] == engine) for m in MODES)
        print(f"{engine}: LoRA / full: bytes per sync {lora['published_bytes'] / full['published_bytes']:.4f}, "
              f"seconds per sync {(lora['publish_s']['median'] + lora['load_s']['median']) / (full['publish_s']['median'] + full['load_s']['median']):.2f}, "
              f"peak memory {lora['peak_rss_over_baseline_mb']['median'] / full['peak_rss_over_baseline_mb']['median']:.2f}, "
              f"tokens/s {lora['tokens_per_s']['median'] / full['tokens_per_s']['median']:.2f}")
        print(f"{engine}: a LoRA round through peft's unmerged forward {shown(lora['round_s_peft_forward'], 3)} s, "
              f"merged {shown(lora['round_s_merged'], 3)} s")
    return 0


if __name__ == "__main__":
    from rlhf_pipeline.bench.page import script_main

    sys.exit(script_main(__file__, main, sys.argv[1:]))
