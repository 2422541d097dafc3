"""``rlhf-pipeline bench generation``: our sampling loop, HF ``generate``, a vLLM engine and a vLLM
server on the same model, prompts and seeds, each in a process of its own.

Cases ``long`` (many long completions a call: ``tokens_per_s``, ``ttft_s``, ``weight_update_s``) and
``pipeline`` (the default pipeline's rounds, :mod:`.generation_rounds`); once per engine
``engine_start_s`` and ``peak_rss_mib``. Engines are asked in turn, the order rotating; figures are
medians with their range, the load beside; an engine that cannot run is skipped, saying why.
Method and figures: docs/benchmarks.md#generation-engines-rlhf-pipeline-bench-generation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rlhf_pipeline.bench.e2e_bench import default_pipeline
from rlhf_pipeline.bench.generation_rounds import COLLECTOR_ENGINES, FIGURES, SAME_MODEL, format_rounds_table, ratios
from rlhf_pipeline.bench.generation_side import ENGINES, MODELS
from rlhf_pipeline.bench.storage_backends import log

CASES = ("long", "pipeline")
REPEATED = ("tokens_per_s", "ttft_s", "weight_update_s")
"""Figures measured every repeat (median and range); the others are measured once per engine."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES), metavar="CASE",
                        help="long: long completions, one call per figure; pipeline: the default pipeline's "
                             "rounds, a weight update before each (default both)")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["2m", "20m"], metavar="SIZE",
                        help="model sizes (2m, 20m; default both)")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES), metavar="ENGINE",
                        help=f"engines ({', '.join(ENGINES)}; default all)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per engine (default %(default)s)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per call (default %(default)s)")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (default %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="most tokens per completion (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=20,
                        help="pipeline case: rounds per engine per repeat (default %(default)s)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="pipeline case: a setting of pipelines/default.py for both engines (repeatable)")
    parser.add_argument("--threads", type=int, default=1,
                        help="long case: torch threads of every engine (default 1); the pipeline case takes the "
                             "pipeline's `threads`")
    parser.add_argument("--vllm-python", default=None, metavar="PATH",
                        help="the vLLM environment's python (default: .venv-vllm beside the checkout)")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                        help="write one JSON document to PATH (or stdout without PATH) instead of the table")


def check(args: argparse.Namespace) -> None:
    for name in ("repeats", "prompts", "group", "max_new_tokens", "threads", "rounds"):
        if getattr(args, name) < 1:
            raise SystemExit(f"bench generation: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def vllm_python(explicit: str | None) -> tuple[str | None, str]:
    """The vLLM environment's python, or None and why there is none."""
    from rlhf_pipeline.generation.settings import find_vllm_python
    from rlhf_pipeline.generation.vllm_setup import python_has_vllm

    if explicit and not (os.path.exists(explicit) and python_has_vllm(explicit)):
        return None, (f"--vllm-python {explicit} is not a Python with vLLM; pass the bin/python of the vLLM "
                      f"environment (`rlhf-pipeline setup-vllm` makes one)")
    try:
        return find_vllm_python(explicit), ""
    except ValueError as error:
        return None, str(error).replace("generation.engine=vllm", "the vllm engines").replace(
            "--set generation.python=", "--vllm-python ")


class Child:
    """One engine's process; :meth:`ask` sends an operation and returns its answer."""

    def __init__(self, engine: str, case: list[str], python: str | None, threads: int | None) -> None:
        """``case``: the side's arguments that say what it samples (``--size 2m ...``, ``--case pipeline ...``);
        ``threads``: its torch threads (None: the pipeline's ``threads``, as in a run)."""
        command = [sys.executable, "-m", "rlhf_pipeline.bench.generation_side", "--engine", engine, *case]
        if python:
            command += ["--vllm-python", python]
        env = dict(os.environ)
        if threads is not None:
            command += ["--threads", str(threads)]
            env["OMP_NUM_THREADS"] = str(threads)
        # its stderr is ours: progress and the libraries' output; its stdout is the protocol
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.engine = engine
        self.hello = self._read()

    def _read(self) -> dict[str, Any]:
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait()
            raise SystemExit(f"bench generation: the {self.engine} process exited ({code}); its output is above")
        return json.loads(line)

    def ask(self, op: str, **message: Any) -> dict[str, Any]:
        self.process.stdin.write(json.dumps({"op": op, **message}) + "\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.process.stdin.close()
            except OSError:
                pass
            self.process.wait()


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def start_child(case: str, engine: str, argv: list[str], python: str | None, threads: int | None,
                results: dict[str, Any]) -> Child | None:
    """``engine``'s process for ``case`` (a model size, or ``pipeline``), or None when it did not start;
    then ``results[engine]`` says why it is skipped."""
    log(f"[bench generation] {case}: starting {engine} (load average {os.getloadavg()[0]:.1f})")
    child = Child(engine, argv, python, threads=threads)
    if "error" not in child.hello:
        return child
    log(f"[bench generation] {case}: {engine} skipped: it did not start ({child.hello['error']})")
    results[engine] = {"skipped": f"it did not start: {child.hello['error']}"}
    child.close()
    return None


def bench_model(size: str, engines: list[str], args: argparse.Namespace, python: str | None) -> dict[str, Any]:
    """Every engine on one model size: ``{engine: figures}``, ``{"skipped": why}`` for one that cannot run."""
    results: dict[str, Any] = {}
    children: dict[str, Child] = {}
    try:
        for engine in engines:
            child = start_child(size, engine, ["--size", size, "--prompts", str(args.prompts), "--group",
                                               str(args.group)], python, args.threads, results)
            if child is None:
                continue
            children[engine] = child
            child.ask("sample", seed=10_000, max_new_tokens=args.max_new_tokens)  # warm-up, untimed
            log(f"[bench generation] {size}: {engine} started in {child.hello['start_s']:.1f}s")
        runs: dict[str, dict[str, list[float]]] = {e: {f: [] for f in (*REPEATED, "tokens", "completions")} for e in children}
        order = list(children)
        for repeat in range(args.repeats):
            turn = order[repeat % len(order):] + order[:repeat % len(order)] if order else []
            for engine in turn:
                child, figures = children[engine], runs[engine]
                call = child.ask("sample", seed=repeat, max_new_tokens=args.max_new_tokens)
                figures["tokens_per_s"].append(call["tokens"] / call["seconds"])
                figures["tokens"].append(call["tokens"])
                figures["completions"].append(call["completions"])
                figures["ttft_s"].append(child.ask("sample", seed=repeat, max_new_tokens=1)["seconds"])
                figures["weight_update_s"].append(child.ask("update")["seconds"])
            log(f"[bench generation] {size}: repeat {repeat + 1}/{args.repeats} done (load average "
                f"{os.getloadavg()[0]:.1f}): " + ", ".join(f"{e} {runs[e]['tokens_per_s'][-1]:.0f} tokens/s" for e in turn))
        for engine, child in children.items():
            memory = child.ask("memory")
            results[engine] = {
                **{f: summary(runs[engine][f]) for f in REPEATED},
                "tokens_per_call": runs[engine]["tokens"], "completions_per_call": runs[engine]["completions"],
                "engine_start_s": child.hello["start_s"],
                "peak_rss_mib": memory["engine_peak_rss_mib"], "driver_peak_rss_mib": memory["driver_peak_rss_mib"],
                "parameters": child.hello["parameters"], "vllm_version": child.hello.get("vllm_version"),
            }
    finally:
        for child in children.values():
            child.close()
    return {engine: results[engine] for engine in engines if engine in results}


def bench_rounds(engines: list[str], args: argparse.Namespace, python: str | None,
                 skipped: dict[str, str]) -> dict[str, Any]:
    """The pipeline case on ``engines``: ``{"settings": ..., "engines": {engine: figures or
    {"skipped": why}}, "ratios": vLLM's medians over the loop's}``."""
    from rlhf_pipeline.bench.tool_use_bench import initial_weights

    results: dict[str, Any] = {}
    for engine in engines:
        if engine not in COLLECTOR_ENGINES:
            results[engine] = {"skipped": f"no collector engine (the pipeline case runs {', '.join(COLLECTOR_ENGINES)})"}
        elif engine in skipped:
            results[engine] = {"skipped": skipped[engine]}
    runnable = [e for e in engines if e not in results]
    children: dict[str, Child] = {}
    with tempfile.TemporaryDirectory(prefix="bench-generation-rounds-") as scratch:
        weights = Path(scratch) / "policy.pt"
        if runnable:
            warm_s = initial_weights(default_pipeline(), [*SAME_MODEL, *args.set], weights)
            log(f"[bench generation] pipeline: the warm-started policy took {warm_s:.1f}s")
        try:
            for engine in runnable:
                argv = ["--case", "pipeline", "--weights", str(weights), *(f"--set={item}" for item in args.set)]
                child = start_child("pipeline", engine, argv, python, None, results)
                if child is None:
                    continue
                children[engine] = child
                child.ask("round")  # warm-up, untimed
            runs: dict[str, dict[str, list[float]]] = {e: {f: [] for f in (*FIGURES, "rows", "response_len")}
                                                       for e in children}
            order = list(children)
            for repeat in range(args.repeats):
                turn = order[repeat % len(order):] + order[:repeat % len(order)] if order else []
                for engine in turn:
                    rounds = [children[engine].ask("round") for _ in range(args.rounds)]
                    figures = runs[engine]
                    figures["generate_s"].append(sum(r["generate_s"] for r in rounds) / len(rounds))
                    figures["update_s"].append(sum(r["update_s"] for r in rounds) / len(rounds))
                    figures["rounds_per_s"].append(len(rounds) / sum(r["round_s"] for r in rounds))
                    figures["rows"].append(sum(r["rows"] for r in rounds) / len(rounds))
                    figures["response_len"].append(sum(r["response_len_mean"] for r in rounds) / len(rounds))
                log(f"[bench generation] pipeline: repeat {repeat + 1}/{args.repeats} done (load average "
                    f"{os.getloadavg()[0]:.1f}): " + ", ".join(f"{e} {runs[e]['rounds_per_s'][-1]:.2f} rounds/s"
                                                             for e in turn))
            for engine, child in children.items():
                memory = child.ask("memory")
                results[engine] = {
                    **{f: summary(runs[engine][f]) for f in FIGURES},
                    "rows_per_round": runs[engine]["rows"], "response_len_mean": runs[engine]["response_len"],
                    "engine_start_s": child.hello["start_s"], "peak_rss_mib": memory["engine_peak_rss_mib"],
                    "parameters": child.hello["parameters"],
                }
        finally:
            for child in children.values():
                child.close()
    ordered = {engine: results[engine] for engine in engines}
    return {"settings": {"overrides": [*SAME_MODEL, *args.set], "rounds": args.rounds}, "engines": ordered,
            "ratios": ratios(ordered)}


def main(args: argparse.Namespace) -> int:
    check(args)
    python, why = vllm_python(args.vllm_python)
    engines = list(dict.fromkeys(args.engines))
    skipped: dict[str, str] = {}
    if python is None:
        for engine in [e for e in engines if e.startswith("vllm")]:
            log(f"[bench generation] {engine} skipped: {why}")
            skipped[engine] = why
    running = [engine for engine in engines if engine not in skipped]
    load_before = os.getloadavg()
    models = {}
    if "long" in args.cases:
        for size in dict.fromkeys(args.models):
            models[size] = bench_model(size, running, args, python)
            models[size].update({engine: {"skipped": reason} for engine, reason in skipped.items()})
    pipeline = bench_rounds(engines, args, python, skipped) if "pipeline" in args.cases else None
    load_after = os.getloadavg()
    result = {
        "prompts": args.prompts, "group": args.group, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
        "threads": args.threads, "cpus": os.cpu_count(), "load_before": list(load_before),
        "load_after": list(load_after), "models": models, "pipeline": pipeline,
    }
    if args.json == "-":
        print(json.dumps(result, indent=2))
    elif args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(result, out, indent=2)
        log(f"[bench generation] wrote {args.json}")
    if args.json != "-":
        print(format_table(result))
    return 0


def format_table(result: dict[str, Any]) -> str:
    def cell(s: dict[str, float], digits: int) -> str:
        return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"

    lines = [f"{result['repeats']} repeats; loop and hf on {result['threads']} thread(s); {result['cpus']} CPUs; "
             f"load average {result['load_before'][0]:.1f} before, {result['load_after'][0]:.1f} after; "
             f"medians [ranges]"]
    if result["models"]:
        lines.append(f"long case: {result['prompts']} prompts x {result['group']} completions x "
                     f"{result['max_new_tokens']} tokens a call")
    for size, engines in result["models"].items():
        parameters = next((r["parameters"] for r in engines.values() if "parameters" in r), None)
        lines += ["", f"model {size}" + (f" ({parameters:,} parameters)" if parameters else ""),
                  "| engine | tokens/s | TTFT s | weight update s | start s | peak RSS MiB |", "|---|---|---|---|---|---|"]
        for engine, r in engines.items():
            if "skipped" in r:
                lines.append(f"| {engine} | skipped: {r['skipped']} | | | | |")
                continue
            lines.append(f"| {engine} | {cell(r['tokens_per_s'], 0)} | {cell(r['ttft_s'], 3)} | "
                         f"{cell(r['weight_update_s'], 3)} | {r['engine_start_s']:.1f} | {r['peak_rss_mib']:.0f} |")
    if result["pipeline"] is not None:
        lines += format_rounds_table(result["pipeline"])
    return "\n".join(lines)
