"""Agents' turns, lockstep against per-episode: ``python benchmarks/bench_agent_turns.py [--engines vllm loop vllm-server] [--rounds 3] [--json [PATH]]``.

A tool-use round whose environments answer at uneven speeds: each environment step sleeps
``--fast-s`` (0.01 s) and, with probability ``--slow-share`` (0.2), ``--slow-s`` (0.3 s) instead, as a
tool call that sometimes waits on a slow service. Tasks ask for 1 to ``--max-turns`` turns. Per
engine, rounds alternate ``turns=lockstep`` (every active episode's turn in one engine call: each turn
waits for the slowest environment of the round) and ``turns=per_episode`` (each episode's next turn
sent as soon as its environment answered, ``collect/agent_turns.py``) on the same engine and tasks; the
first round of each is a warm-up and not counted. Printed per engine and mode, median and range:

* ``round_s``: the round, first reset to the last row written;
* ``engine_idle_share``: the share of the round in which the engine had no turn to sample (lockstep:
  outside its calls; per-episode: no request in flight), i.e. waiting for environments or the write;
* ``generate_s`` and ``generation_batches`` (engine calls; per-episode: one per turn).

The model is the tool-use pipeline's shape with two heads (hidden 64, 2 layers, head size 32, which
vLLM's CPU attention takes) over its character tokenizer, untrained. The load average before and after is printed.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_stream_groups import engine_for, spread, write_report  # noqa: E402  (the same engines and report)

METRICS = ("round_s", "engine_idle_share", "generate_s", "generation_batches", "rows")


class UnevenEnv:
    """``task["turns"]`` model turns; each step sleeps ``fast_s``, or ``slow_s`` with probability ``slow_share``."""

    def __init__(self, delays: random.Random, lock: threading.Lock, args) -> None:
        self.delays, self.lock, self.args = delays, lock, args

    def reset(self, task):
        self.turns = int(task["turns"])
        return [{"role": "user", "content": task["question"]}]

    def step(self, turn):
        from rlhf_pipeline.agents.environment import StepResult

        with self.lock:
            slow = self.delays.random() < self.args.slow_share
        time.sleep(self.args.slow_s if slow else self.args.fast_s)
        reward = float(len(turn.text) % 3)
        if turn.index + 1 >= self.turns:
            return StepResult(reward=reward, done=True)
        return StepResult([{"role": "user", "content": f"Go on ({turn.index})."}], reward=reward)


def bench_engine(name: str, model, tok, args, where: Path) -> dict:
    from rlhf_pipeline.agents.episode import EpisodeLimits
    from rlhf_pipeline.collect import AgentCollector, AgentCollectorConfig, SamplingConfig, TaskSource

    started = time.perf_counter()
    engine, server = engine_for(name, model, tok, where)
    start_s = time.perf_counter() - started
    results = {mode: {k: [] for k in METRICS} for mode in ("lockstep", "per_episode")}
    tasks = [{"question": f"Say something, {k}.", "turns": 1 + k % args.max_turns} for k in range(64)]
    delays, lock = random.Random(args.seed), threading.Lock()
    try:
        collectors = {}
        for mode in results:
            config = AgentCollectorConfig(tasks_per_round=args.tasks, group_size=args.group_size, seed=args.seed,
                                          limits=EpisodeLimits(max_turns=args.max_turns, max_new_tokens=args.max_new_tokens,
                                                               context_length=512, end_on_cut_turn=False),
                                          sampling=SamplingConfig(temperature=1.0), turns=mode, check_drift=False,
                                          max_workers=args.tasks * args.group_size, row_fields=())
            collectors[mode] = AgentCollector(engine, tok, TaskSource(tasks, seed=args.seed),
                                              lambda: UnevenEnv(delays, lock, args), None, config)
        for round_index in range(args.rounds + 1):  # round 0 warms each up
            for mode, collector in collectors.items():
                collector.collect()
                if round_index:
                    for key in METRICS:
                        results[mode][key].append(collector.last_metrics[key])
    finally:
        engine.close()
        if server is not None:
            server.stop()
    summary = {mode: {key: spread(values) for key, values in per_mode.items()} for mode, per_mode in results.items()}
    summary["engine_start_s"] = start_s
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", nargs="+", choices=["loop", "vllm", "vllm-server"], default=["vllm"])
    parser.add_argument("--rounds", type=int, default=3, help="rounds counted per engine and mode (default 3)")
    parser.add_argument("--tasks", type=int, default=8, help="tasks (groups) per round (default 8)")
    parser.add_argument("--group-size", type=int, default=4, help="episodes per task (default 4)")
    parser.add_argument("--max-turns", type=int, default=4, help="tasks ask for 1 to this many turns (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="tokens per turn at most (default 16)")
    parser.add_argument("--fast-s", type=float, default=0.01, help="an environment step's usual time (default 0.01)")
    parser.add_argument("--slow-s", type=float, default=0.3, help="a slow step's time (default 0.3)")
    parser.add_argument("--slow-share", type=float, default=0.2, help="share of slow steps (default 0.2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                        help="write the results as JSON (to PATH, or stdout)")
    args = parser.parse_args(argv)
    import torch

    from rlhf_pipeline.models import char_tool_tokenizer, tiny_causal_lm

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    load_before = os.getloadavg()
    tok = char_tool_tokenizer()
    model = tiny_causal_lm(len(tok), hidden_size=64, num_layers=2, num_heads=2, max_position_embeddings=512,
                           pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, seed=args.seed)
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-agent-turns-") as where:
        for name in args.engines:
            results[name] = bench_engine(name, model, tok, args, Path(where))
    report = {"load_before": load_before, "load_after": os.getloadavg(), "settings": vars(args), "engines": results}
    for name, summary in results.items():
        print(f"{name}: engine start {summary['engine_start_s']:.1f} s")
        for mode in ("lockstep", "per_episode"):
            print(f"  {mode}:")
            for key in METRICS:
                s = summary[mode][key]
                print(f"    {key:>18}: median {s['median']:.3f}  range {s['min']:.3f}-{s['max']:.3f}  (n={s['n']})")
    print(f"load average before {load_before[0]:.2f}, after {report['load_after'][0]:.2f}")
    write_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
