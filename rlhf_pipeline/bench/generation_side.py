"""One engine of ``rlhf-pipeline bench generation`` in a process of its own, driven over stdin and
stdout, one JSON object a line.

``python -m rlhf_pipeline.bench.generation_side --engine ENGINE --size 2m ...`` answers ``ready`` (or
``error``), then the operations ``sample`` (seeded; ``max_new_tokens`` 1 times the first token),
``update`` (the other of two weight sets), ``round`` (``--case pipeline``), ``memory`` and ``quit``.
Engines: ``loop``, ``hf``, ``vllm`` and ``vllm-server``, each stopping at the tokenizer's EOS.
Design: docs/benchmarks.md#generation-engines-rlhf-pipeline-bench-generation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rlhf_pipeline.bench.generation_rounds import PipelineRounds

ENGINES = ("loop", "hf", "vllm", "vllm-server")
MODELS: dict[str, dict[str, int]] = {
    # head size 32 in both: vLLM's CPU attention has no kernel for 16 (docs/generation.md). A layer of
    # hidden h holds 16 h^2 parameters (MLP 4h wide), so 2 layers of 256 make 2.1M and 5 of 512 21M
    "2m": {"hidden_size": 256, "num_layers": 2, "num_heads": 8},
    "20m": {"hidden_size": 512, "num_layers": 5, "num_heads": 16},
}


def peak_rss_mib(pid: int | str = "self") -> float:
    """``VmHWM`` (the most resident memory it ever had) of one process, in MiB; 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (vLLM's API server starts its engine core as a child)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # the field after the parenthesised name, which may itself hold spaces
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def memory(engine: Any, server: Any = None) -> dict[str, float]:
    """The peak resident memory of the engine's processes (this one for the loop and hf, the vLLM
    engine's or the server's tree) and of this process."""
    if server is not None:
        pids = process_tree(server.process.pid)
    else:
        pid = getattr(engine, "pid", None)
        pids = process_tree(pid) if pid else [os.getpid()]
    # the sum of each process's own peak: an upper bound when their peaks fell at different moments
    return {"engine_peak_rss_mib": sum(peak_rss_mib(pid) for pid in pids), "driver_peak_rss_mib": peak_rss_mib()}


class Side:
    """The long case's model, requests and one engine; the methods are the protocol's operations."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from rlhf_pipeline.collect.toy_task import toy_prompts
        from rlhf_pipeline.generation.engine import SampleRequest
        from rlhf_pipeline.models import tiny_model_and_tokenizer

        torch.set_num_threads(args.threads)
        self.engine_name = args.engine
        self.model, self.tokenizer = tiny_model_and_tokenizer(**MODELS[args.size])
        other, _ = tiny_model_and_tokenizer(seed=1, **MODELS[args.size])
        self.weights = [{k: v.clone() for k, v in self.model.state_dict().items()}, other.state_dict()]
        self.parameters = sum(p.numel() for p in self.model.parameters())
        self.stop = [int(self.tokenizer.eos_token_id)]
        self.requests = [SampleRequest(r.render(self.tokenizer), n=args.group) for r in toy_prompts(args.prompts, seed=0)]
        self.work_dir = Path(tempfile.mkdtemp(prefix=f"bench-generation-{args.engine}-", dir=args.work_dir))
        self.engine: Any = None
        self.server: Any = None
        self.updates = 0
        started = time.perf_counter()
        self._start(args)
        self.start_s = time.perf_counter() - started

    def _start(self, args: argparse.Namespace) -> None:
        from rlhf_pipeline.generation.loop import LoopEngine

        if self.engine_name == "loop":
            self.engine = LoopEngine(self.model, pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.stop)
        elif self.engine_name == "vllm":
            from rlhf_pipeline.generation.vllm_engine import VLLMEngine

            self.engine = VLLMEngine.from_model(self.model, python=args.vllm_python, stop_token_ids=self.stop,
                                                work_dir=self.work_dir / "engine")
        elif self.engine_name == "vllm-server":
            from rlhf_pipeline.bench.vllm_server_process import VLLMServerProcess, save_model_dir
            from rlhf_pipeline.generation.vllm_url import VLLMURLEngine

            model_dir = save_model_dir(self.model, self.tokenizer, self.work_dir / "model")
            self.server = VLLMServerProcess(args.vllm_python, model_dir, self.work_dir)
            self.engine = VLLMURLEngine(self.server.url, self.model, stop_token_ids=self.stop, tokenizer=self.tokenizer)

    def sample(self, seed: int, max_new_tokens: int) -> dict[str, float]:
        import torch

        from rlhf_pipeline.generation.sampling import SamplingConfig

        generator = torch.Generator().manual_seed(seed)
        started = time.perf_counter()
        if self.engine_name == "hf":
            tokens, completions = self._hf_generate(generator, max_new_tokens)
        else:
            from rlhf_pipeline.generation.engine import draw_seed

            seeds = [draw_seed(generator) for _ in self.requests]
            groups = self.engine.sample(self.requests, seeds, SamplingConfig(max_new_tokens=max_new_tokens))
            tokens = sum(len(c.token_ids) for g in groups for c in g.completions)
            completions = sum(len(g.completions) for g in groups)
        return {"seconds": time.perf_counter() - started, "tokens": tokens, "completions": completions}

    def _hf_generate(self, generator: Any, max_new_tokens: int) -> tuple[int, int]:
        import torch
        from transformers import GenerationConfig

        from rlhf_pipeline.generation.loop import left_pad

        prompts = [list(r.prompt_ids) for r in self.requests for _ in range(r.n)]
        ids, mask = left_pad(prompts, self.tokenizer.pad_token_id)
        # generate draws from torch's global generator: seed it from the call's own
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator)))
        config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                                  eos_token_id=self.stop, pad_token_id=self.tokenizer.pad_token_id)
        with torch.no_grad():
            new = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1]:]
        # a row's tokens: up to its first EOS, kept (generate pads a finished row to the batch's length)
        is_stop = new == self.stop[0]
        ended = is_stop.any(dim=1)
        lengths = torch.where(ended, is_stop.int().argmax(dim=1) + 1, torch.full_like(ended, new.shape[1], dtype=torch.long))
        return int(lengths.sum()), int(new.shape[0])

    def update(self) -> dict[str, float]:
        self.updates += 1
        weights = self.weights[self.updates % 2]
        started = time.perf_counter()
        if self.engine_name == "hf":
            self.model.load_state_dict(weights)
        else:
            self.engine.load_weights(weights, self.updates)
        return {"seconds": time.perf_counter() - started}

    def close(self) -> None:
        if self.engine is not None and self.engine_name != "hf":
            self.engine.close()
        if self.server is not None:
            self.server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", choices=ENGINES, required=True)
    parser.add_argument("--case", choices=("long", "pipeline"), default="long")
    parser.add_argument("--size", choices=sorted(MODELS), help="long case: the model")
    parser.add_argument("--prompts", type=int, help="long case: prompts per call")
    parser.add_argument("--group", type=int, help="long case: completions per prompt")
    parser.add_argument("--weights", help="pipeline case: the policy's state dict (torch.save)")
    parser.add_argument("--set", action="append", default=[], help="pipeline case: a setting of the pipeline")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args(argv)
    # the protocol owns the real stdout; anything a library prints goes to stderr with the progress
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(message: dict[str, Any]) -> None:
        protocol.write(json.dumps(message) + "\n")

    try:
        side = Side(args) if args.case == "long" else PipelineRounds(args)
    except Exception as error:  # the benchmark skips this engine and says why
        reply({"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"})
        return 1
    try:
        reply({"ready": True, "start_s": side.start_s, "parameters": side.parameters,
               "vllm_version": getattr(side.engine, "vllm_version", None)})
        for line in sys.stdin:
            message = json.loads(line)
            if message["op"] == "sample":
                reply(side.sample(int(message["seed"]), int(message["max_new_tokens"])))
            elif message["op"] == "update":
                reply(side.update())
            elif message["op"] == "round":
                reply(side.round())
            elif message["op"] == "memory":
                reply(memory(side.engine, getattr(side, "server", None)))
            elif message["op"] == "quit":
                break
    finally:
        side.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
