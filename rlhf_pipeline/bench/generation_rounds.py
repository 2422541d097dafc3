"""The pipeline case of ``rlhf-pipeline bench generation``: the default pipeline's rounds, each after
a weight update, on our loop and on vLLM.

Each engine's process builds the default pipeline's real collector (``num_heads=2``, vLLM's CPU head
size) from its warm-started policy; per round ``set_policy_state`` with alternating weights, then
``collect()``. Reports ``generate_s``, ``update_s`` and ``rounds_per_s`` (means per repeat, then
median and range). Figures: docs/benchmarks.md#the-pipeline-case.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

COLLECTOR_ENGINES = ("loop", "vllm", "vllm-server")
"""The engines a pipeline's collector runs in this case (hf is no collector engine); ``vllm-server``
is the pipeline at ``generation.url`` of a server started here with the documented command
(``vllm_server_process.py``), serving the same model on as many threads as the owned engine."""
FIGURES = ("generate_s", "update_s", "rounds_per_s")
SAME_MODEL = ("num_heads=2",)
"""vLLM's CPU attention takes no head size of 16 (the default 64 / 4): both engines get 64 / 2."""
NOISE = 1e-3


class PipelineRounds:
    """One engine's side of the pipeline case: the pipeline's collector; :meth:`round` is one round."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from rlhf_pipeline.bench.e2e_bench import default_pipeline
        from rlhf_pipeline.pipeline import RunPaths, load_pipeline_module, make_settings
        from rlhf_pipeline.runs.processes import build_pipeline

        engine = "loop" if args.engine == "vllm-server" else args.engine  # the server's URL is set below
        overrides = [*SAME_MODEL, *args.set, f"generation.engine={engine}"]
        if args.engine == "vllm" and args.vllm_python:
            overrides.append(f"generation.python={args.vllm_python}")
        module = load_pipeline_module(default_pipeline())
        settings = make_settings(module, overrides)
        self.work_dir = Path(tempfile.mkdtemp(prefix=f"bench-generation-rounds-{args.engine}-", dir=args.work_dir))
        pipeline = build_pipeline(module, settings, RunPaths(self.work_dir / "run"))
        if pipeline.settings.threads is not None:  # as the collector's process: one thread beside the learner
            torch.set_num_threads(pipeline.settings.threads)
        model = pipeline.make_model()
        model.load_state_dict(torch.load(args.weights, map_location="cpu", weights_only=True))
        self.weights = [{k: v.clone() for k, v in model.state_dict().items()}, moved(model, seed=1)]
        self.parameters = sum(p.numel() for p in model.parameters())
        self.store = pipeline.create_buffer(self.work_dir / "buffer")
        started = time.perf_counter()
        self.server = None
        if args.engine == "vllm-server":  # started as a user starts one; its start is the engine's
            from rlhf_pipeline.bench.vllm_server_process import VLLMServerProcess, save_model_dir
            from rlhf_pipeline.generation.settings import find_vllm_python

            model_dir = save_model_dir(model, pipeline.tokenizer, self.work_dir / "model")
            self.server = VLLMServerProcess(find_vllm_python(args.vllm_python), model_dir, self.work_dir,
                                            omp_threads=torch.get_num_threads())
            settings.generation.url = self.server.url
        self.collector = pipeline.make_collector(model, self.store, collector_index=0)
        self.start_s = time.perf_counter() - started
        self.version = 0

    @property
    def engine(self) -> Any:
        return self.collector.engine

    def round(self) -> dict[str, float]:
        self.version += 1
        started = time.perf_counter()
        self.collector.set_policy_state(self.weights[self.version % 2], self.version)
        updated = time.perf_counter()
        self.collector.collect()
        ended = time.perf_counter()
        metrics = self.collector.last_metrics
        return {"update_s": updated - started, "round_s": ended - started, "generate_s": metrics["generate_s"],
                "rows": metrics["rows"], "response_len_mean": metrics["response_len_mean"]}

    def close(self) -> None:
        import shutil

        self.collector.close()
        self.store.close()
        if self.server is not None:
            self.server.stop()
        shutil.rmtree(self.work_dir, ignore_errors=True)


def moved(model: Any, seed: int) -> dict[str, Any]:
    """``model``'s state with every parameter moved by ``NOISE`` standard normal noise; a tied head
    moves with its embedding, as a learner's step keeps it."""
    import copy

    import torch

    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(NOISE * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    return other.state_dict()


def ratios(engines: dict[str, Any], base: str = "loop") -> dict[str, dict[str, float]]:
    """Each other engine's median over ``base``'s, per figure; only engines that ran."""
    reference = engines.get(base, {})
    if "generate_s" not in reference:
        return {}
    return {name: {f: r[f]["median"] / reference[f]["median"] for f in FIGURES if reference[f]["median"] > 0}
            for name, r in engines.items() if name != base and "generate_s" in r}


def format_rounds_table(case: dict[str, Any]) -> list[str]:
    def cell(s: dict[str, float], digits: int) -> str:
        return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"

    engines = case["engines"]
    parameters = next((r["parameters"] for r in engines.values() if "parameters" in r), None)
    lines = ["", f"pipeline case: pipelines/default.py's round ({' '.join(case['settings']['overrides'])}"
             + (f", {parameters:,} parameters" if parameters else "")
             + f"), a weight update before each; {case['settings']['rounds']} rounds a repeat",
             "| engine | generation s/round | weight update s/round | rounds/s | start s | peak RSS MiB |",
             "|---|---|---|---|---|---|"]
    for engine, r in engines.items():
        if "skipped" in r:
            lines.append(f"| {engine} | skipped: {r['skipped']} | | | | |")
            continue
        lines.append(f"| {engine} | {cell(r['generate_s'], 4)} | {cell(r['update_s'], 4)} | "
                     f"{cell(r['rounds_per_s'], 2)} | {r['engine_start_s']:.1f} | {r['peak_rss_mib']:.0f} |")
    for name, over in case["ratios"].items():
        lines.append(f"| {name} / loop | " + " | ".join(f"{over[f]:.2f}x" for f in FIGURES) + " | | |")
    if "vllm" in engines and "vllm-server" in engines:
        over = ratios(engines, base="vllm").get("vllm-server")
        if over:
            lines.append("| vllm-server / vllm | " + " | ".join(f"{over[f]:.2f}x" for f in FIGURES) + " | | |")
    return lines
