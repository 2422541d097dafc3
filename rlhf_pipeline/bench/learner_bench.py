"""``rlhf-pipeline bench learner``: learner steps on length-skewed rows, padded against packed, TRL beside.

The sides train the same rows from the same weights in alternation (padded, packed, TRL, ...), a
fresh AdamW each repeat; packing is planned before the timed step and reported apart
(``prefetch_ms``). Workloads ``skewed`` and ``short``; method and figures:
docs/benchmarks.md#learner-rlhf-pipeline-bench-learner.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

SIDES = ("padded", "packed", "trl")


@dataclass(frozen=True)
class Workload:
    rows: int
    micro_batch_tokens: int
    threads: int
    prompt: tuple[str, float, float, int, int]  # (distribution, a, b, low, high)
    response: tuple[str, float, float, int, int]
    model: dict[str, Any]
    padded_attention: str = "sdpa"


WORKLOADS = {
    # lognormal: (median, sigma); uniform: (low, high) inclusive; each clipped to [low, high]
    "skewed": Workload(rows=16, micro_batch_tokens=8192, threads=2,
                       prompt=("lognormal", 130, 0.45, 32, 256), response=("lognormal", 450, 0.75, 16, 1024),
                       model=dict(vocab_size=16_384, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                                  num_key_value_heads=2, intermediate_size=1408)),
    "short": Workload(rows=64, micro_batch_tokens=4096, threads=1,
                      prompt=("uniform", 6, 8, 6, 8), response=("uniform", 1, 6, 1, 6),
                      model=dict(tiny=True), padded_attention="eager"),
}
QUICK = dict(rows=4, micro_batch_tokens=256, response=("lognormal", 40, 0.75, 4, 96),
             prompt=("lognormal", 20, 0.45, 4, 40),
             model=dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=128))


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ====================================================================== data and model
def draw_lengths(spec: tuple[str, float, float, int, int], count: int, generator):
    import torch

    kind, a, b, low, high = spec
    if kind == "lognormal":
        values = torch.exp(torch.log(torch.tensor(float(a))) + b * torch.randn(count, generator=generator)).round()
    else:
        values = torch.randint(int(a), int(b) + 1, (count,), generator=generator).float()
    return values.clamp(low, high).long()


def make_rows(workload: Workload, steps: int, seed: int, vocab_size: int) -> list:
    """``steps`` batches of stored rows (``TrajectoryBatch``, ragged, as ``store.read_ragged`` gives them)."""
    import torch

    from rlhf_pipeline.schema.synthetic import batch_with_lengths

    generator = torch.Generator().manual_seed(seed)
    batches = []
    for step in range(steps):
        prompts = draw_lengths(workload.prompt, workload.rows, generator)
        responses = draw_lengths(workload.response, workload.rows, generator)
        batches.append(batch_with_lengths(prompts, responses, group_size=4, seed=seed * 1000 + step,
                                          vocab_size=vocab_size))
    return batches


def make_batches(rows: list) -> list:
    """The padded batches of ``rows`` (``pad_batch``, int32 ids as the learner reads them)."""
    import torch

    from rlhf_pipeline.schema.padding import pad_batch

    return [pad_batch(batch, pad_token_id=0, index_dtype=torch.int32) for batch in rows]


def make_model(workload: Workload):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlhf_pipeline.models.tiny import char_tokenizer, tiny_causal_lm

    torch.manual_seed(0)
    if workload.model.get("tiny"):  # the default pipeline's model, as pipelines/default.py builds it
        tokenizer = char_tokenizer()
        return tiny_causal_lm(len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=tokenizer.eos_token_id).train()
    config = Qwen2Config(**workload.model, max_position_embeddings=4096, tie_word_embeddings=True,
                         pad_token_id=0, attn_implementation=workload.padded_attention)
    return Qwen2ForCausalLM(config).train()


# ====================================================================== one side's steps
class Side:
    """A model copy, its optimizer, and the learner step of one side."""

    def __init__(self, name: str, initial_model, workload: Workload):
        self.name = name
        self.workload = workload
        self.initial = {k: v.clone() for k, v in initial_model.state_dict().items()}
        self.model = copy.deepcopy(initial_model)
        self.trl = None
        if name == "packed":
            from rlhf_pipeline.learn.packed_attention import use_packed_attention

            use_packed_attention(self.model)

    def prepare(self, batches: list, rows: list) -> list:
        """What the prefetch thread starts from: padded batches, stored rows (packed), or TRL's chunks."""
        if self.name == "packed":
            return rows
        if self.name != "trl":
            return batches
        if self.trl is None:
            from rlhf_pipeline.bench.trl_side import TrlGrpoSide

            widest = max(b["tokens", "full"].shape[1] for b in batches)
            self.trl = TrlGrpoSide(self.model, rows_per_step=self.workload.rows, widest_row=widest,
                                   micro_batch_tokens=self.workload.micro_batch_tokens)
            self.model = self.trl.model
        return [self.trl.inputs(b) for b in batches]

    def run(self, prepared: list) -> dict[str, float]:
        """Train on every prepared batch from the initial weights: seconds, first loss, positions run.

        The padded and packed sides run the learner's own step (``learn/step.py``: ``plan_step``,
        ``train_step`` with ``learner.packing`` false or true); TRL's side the same clip and AdamW
        around its loss and backward."""
        import torch

        from rlhf_pipeline.learn.step import make_optimizer
        from rlhf_pipeline.learn.settings import LearnerSettings
        from rlhf_pipeline.learn.step import plan_step, train_step

        settings = LearnerSettings(micro_batch_tokens=self.workload.micro_batch_tokens, lr=1e-5,
                                   packing=self.name == "packed")
        prefetch_s = 0.0
        if self.name == "packed":  # the learner's prefetch thread: planned and packed from ragged rows
            from rlhf_pipeline.learn.batch import PackedBatch

            start = time.perf_counter()
            prepared = [PackedBatch.from_stored(rows, settings.micro_batch_tokens) for rows in prepared]
            prefetch_s = time.perf_counter() - start
        self.model.load_state_dict(self.initial)
        optimizer, scheduler = make_optimizer(self.model, settings, total_steps=len(prepared))
        first_loss, positions, plan_s = None, 0, 0.0
        start = time.perf_counter()
        for batch in prepared:
            if self.name == "trl":
                optimizer.zero_grad(set_to_none=True)
                loss = self.trl.loss_and_backward(batch)
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), settings.max_grad_norm)
                optimizer.step()
                positions += sum(chunk["prompt_ids"].numel() + chunk["completion_ids"].numel() for chunk in batch)
            else:
                planned = time.perf_counter()
                plan = plan_step(batch, settings)
                plan_s += time.perf_counter() - planned
                loss = train_step(self.model, optimizer, scheduler, plan, settings).losses["loss"]
                positions += sum(part.batch.num_tokens if settings.packing else part.batch["tokens", "full"].numel()
                                 for part in plan.micro_batches)
            first_loss = loss if first_loss is None else first_loss
        unmeasured = float("nan") if self.name == "trl" else None  # TRL's side has no plan_step
        return {"seconds": time.perf_counter() - start, "first_loss": first_loss, "positions": positions,
                "plan_ms": unmeasured or 1e3 * plan_s / len(prepared),
                "prefetch_ms": unmeasured or 1e3 * prefetch_s / len(prepared)}


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the VmHWM high-water mark (Linux >= 4.0)
        return True
    except OSError:
        return False


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ====================================================================== the benchmark
def run_benchmark(workload: Workload, *, steps: int, repeat: int, sides: tuple[str, ...], seed: int = 0,
                  progress: bool = True) -> dict[str, Any]:
    import torch

    torch.set_num_threads(workload.threads)
    initial = make_model(workload)
    vocab = initial.config.vocab_size
    rows = make_rows(workload, steps, seed, vocab)
    batches = make_batches(rows)
    response_tokens = sum(int(b["masks", "response"].sum()) for b in batches)
    real_tokens = sum(int(b["masks", "all_attention_mask"].sum()) for b in batches)
    runners = {name: Side(name, initial, workload) for name in sides}
    prepared = {name: runner.prepare(batches, rows) for name, runner in runners.items()}
    per_run: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    for number in range(repeat):
        for name in sides:
            exact_rss = _reset_peak_rss()
            result = runners[name].run(prepared[name])
            result["peak_rss_mb"] = _peak_rss_mb() if exact_rss else float("nan")
            result["load_average"] = os.getloadavg()[0]
            per_run[name].append(result)
            if progress:
                _log(f"[bench learner] repeat {number + 1}/{repeat} {name}: {result['seconds']:.2f} s, "
                     f"{response_tokens / result['seconds']:,.0f} response tokens/s "
                     f"(load average {result['load_average']:.1f})")
    for runner in runners.values():
        if runner.trl is not None:
            runner.trl.close()
    records = []
    for name, runs in per_run.items():
        seconds = [r["seconds"] for r in runs]
        response_rates = [response_tokens / s for s in seconds]
        token_rates = [real_tokens / s for s in seconds]
        records.append({
            "side": name, "rows_trained": workload.rows * steps, "response_tokens": response_tokens,
            "tokens": real_tokens, "positions": runs[0]["positions"],
            "padding_fraction": 1 - real_tokens / runs[0]["positions"],
            "response_tokens_per_s_median": statistics.median(response_rates),
            "response_tokens_per_s_min": min(response_rates), "response_tokens_per_s_max": max(response_rates),
            "tokens_per_s_median": statistics.median(token_rates),
            "tokens_per_s_min": min(token_rates), "tokens_per_s_max": max(token_rates),
            "seconds_runs": seconds,
            **{f"{key}_{stat}": fn(r[key] for r in runs) for key in ("plan_ms", "prefetch_ms")
               for stat, fn in (("median", statistics.median), ("min", min), ("max", max))},
            "peak_rss_mb_median": statistics.median(r["peak_rss_mb"] for r in runs),
            "first_loss": runs[0]["first_loss"],
            "load_average_runs": [r["load_average"] for r in runs],
        })
    by_side = {r["side"]: r for r in records}
    for r in records:
        # per repeat: this side's rate over the padded side's in the same alternation round
        if "padded" in by_side:
            base = per_run["padded"]
            ratios = [b["seconds"] / s["seconds"] for s, b in zip(per_run[r["side"]], base)]
            r["vs_padded_median"] = r["tokens_per_s_median"] / by_side["padded"]["tokens_per_s_median"]
            r["vs_padded_range"] = [min(ratios), max(ratios)]
    parameters = sum(p.numel() for p in initial.parameters())
    return {"workload": workload, "parameters": parameters, "steps": steps, "repeat": repeat, "records": records}


def format_report(name: str, result: dict[str, Any]) -> str:
    w: Workload = result["workload"]
    lines = [f"bench learner, workload {name!r}: {w.rows} rows x {result['steps']} steps, "
             f"{result['parameters'] / 1e6:.1f}M-parameter model, micro-batches of {w.micro_batch_tokens} tokens, "
             f"{w.threads} thread(s); prompt lengths {w.prompt}, response lengths {w.response}; "
             f"medians [min-max] over {result['repeat']} alternating repeats",
             "| side | trained response tok/s | all non-pad tok/s | vs padded (median, per-repeat range) "
             "| training thread ms/step before the forward | prefetch packing ms/step | padding fraction "
             "| peak RSS MB | first-step loss |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["records"]:
        ratio = (f"{r['vs_padded_median']:.2f}x ({r['vs_padded_range'][0]:.2f}-{r['vs_padded_range'][1]:.2f})"
                 if "vs_padded_median" in r else "-")
        lines.append(
            f"| {r['side']} | {r['response_tokens_per_s_median']:,.0f} [{r['response_tokens_per_s_min']:,.0f}-"
            f"{r['response_tokens_per_s_max']:,.0f}] | {r['tokens_per_s_median']:,.0f} [{r['tokens_per_s_min']:,.0f}-"
            f"{r['tokens_per_s_max']:,.0f}] | {ratio} | {_milliseconds(r, 'plan_ms')} | "
            f"{_milliseconds(r, 'prefetch_ms')} | {r['padding_fraction']:.2f} | {r['peak_rss_mb_median']:,.0f} "
            f"| {r['first_loss']:.6f} |")
    return "\n".join(lines)


def _milliseconds(record: dict[str, Any], key: str) -> str:
    """``median [min-max]`` of a per-step time, or ``-`` where the side has none (TRL)."""
    if record[f"{key}_median"] != record[f"{key}_median"]:  # nan
        return "-"
    return f"{record[f'{key}_median']:.2f} [{record[f'{key}_min']:.2f}-{record[f'{key}_max']:.2f}]"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Learner steps on synthetic rows, padded against packed (and TRL's GRPOTrainer loss-and-backward "
        "when trl is installed), run in alternation; reports trained tokens/s, padding fraction and peak RSS "
        "as medians and ranges. Workload 'skewed': prompt lengths clipped log-normal (median 130, sigma 0.45, "
        "32-256 tokens, mean ~140), response lengths clipped log-normal (median 450, sigma 0.75, 16-1,024 "
        "tokens, mean ~520), 16 rows a step, a Qwen2 model of 19.7M parameters built from a config. "
        "Workload 'short': the default pipeline's rows (prompts 6-8, answers 1-6 tokens) and model.")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="skewed",
                        help="skewed: clipped log-normal prompts (median 130, 32-256) and responses (median 450, "
                             "16-1,024), a 19.7M-parameter Qwen2; short: the default pipeline's rows and model "
                             "(default %(default)s)")
    parser.add_argument("--steps", type=int, default=2, help="learner steps per side and repeat (default %(default)s)")
    parser.add_argument("--repeat", type=int, default=3, help="alternating repeats of the sides (default %(default)s)")
    parser.add_argument("--rows", type=int, default=None, help="rows per step (default: the workload's)")
    parser.add_argument("--micro-batch-tokens", type=int, default=None, help="token budget per forward "
                        "(default: the workload's)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the workload's)")
    parser.add_argument("--no-trl", action="store_true", help="leave TRL out even when it is installed")
    parser.add_argument("--quick", action="store_true", help="a tiny model and short rows: seconds, for tests")
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")


def main(args: argparse.Namespace) -> int:
    from rlhf_pipeline.bench.trl_side import trl_version

    workload = WORKLOADS[args.workload]
    if args.quick:
        workload = replace(workload, **QUICK, padded_attention="sdpa")
    overrides = {k: v for k, v in (("rows", args.rows), ("micro_batch_tokens", args.micro_batch_tokens),
                                   ("threads", args.threads)) if v is not None}
    workload = replace(workload, **overrides)
    if args.steps < 1 or args.repeat < 1 or workload.rows < 2:
        raise SystemExit("bench learner: --steps and --repeat must be >= 1 and --rows >= 2")
    trl = None if args.no_trl else trl_version()
    sides = SIDES if trl is not None else SIDES[:2]
    if trl is None and not args.no_trl:
        _log("[bench learner] TRL is not installed (pip install -e .[bench-trl]): padded and packed only")
    result = run_benchmark(workload, steps=args.steps, repeat=args.repeat, sides=sides)
    if args.json:
        w = result.pop("workload")
        print(json.dumps({**result, "workload": args.workload, "quick": args.quick, "trl_version": trl,
                          "rows": w.rows, "micro_batch_tokens": w.micro_batch_tokens, "threads": w.threads,
                          "prompt_lengths": list(w.prompt), "response_lengths": list(w.response)}))
    else:
        print(format_report(args.workload + (" (quick)" if args.quick else ""), result))
    return 0
