"""What a data-parallel rank other than 0 pays per learner step outside the model: 2 gloo CPU ranks.

Each repeat trains a recorded buffer of longer rows (prompts 32-128, responses 64-512 tokens) with
packing on, 2 ranks under ``torch.distributed.run``. Rank 1 records, for each step after the first
two, the time its training thread spent getting the step's batch (``charts/data_wait_s``: the draw,
and with the read on the training thread the read and packing of its slice) and the time from one
step's end to the next's start outside ``_train_step`` (the draw plus staleness checks, charts and
collectives), the time in ``_train_step`` and the whole step. The table gives each one's median
over the repeats' medians and the range::

    python benchmarks/bench_rank_prefetch.py --repeat 3

To compare with another checkout, run the same file with ``PYTHONPATH`` set to that checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEPS, WARMUP_STEPS, ROWS = 14, 2, 640
MEASURES = ("waiting for the batch", "outside the model, in all", "in the model (_train_step)", "whole step")


def worker(root: Path) -> None:
    import torch

    from rlhf_pipeline.learn.distributed import DataParallel
    from rlhf_pipeline.learn.learner import Learner
    from rlhf_pipeline.learn.settings import GRPOLossConfig, LearnerSettings
    from rlhf_pipeline.models import char_tokenizer
    from rlhf_pipeline.pipeline import RunPaths

    torch.set_num_threads(1)
    tokenizer = char_tokenizer()
    settings = LearnerSettings(batch_size=32, sampler="epoch", epoch_order="shuffle", shuffle_window_rows=0,
                               micro_batch_tokens=4096, lr=1e-4, warmup_steps=1, max_staleness=None,
                               checkpoint_every=1000, log_every=1, loss=GRPOLossConfig(old_policy="current"))
    data_parallel = DataParallel.from_torchrun_env()
    data_parallel.start(torch.device("cpu"))
    samples: list[tuple[float, float, float, float]] = []
    in_model = [0.0]
    last_end = [None]

    def on_step(step, sampled, batch, metrics) -> None:
        now = time.perf_counter()
        if last_end[0] is not None and step > WARMUP_STEPS:
            whole = now - last_end[0]
            samples.append((metrics["charts/data_wait_s"] * 1e3, (whole - in_model[0]) * 1e3, in_model[0] * 1e3,
                            whole * 1e3))
        last_end[0] = now

    learner = Learner(settings, RunPaths(root), make_model=lambda: make_model(tokenizer), steps=STEPS, seed=1,
        show_progress=False, data_parallel=data_parallel, on_step=on_step)
    try:
        learner.setup()
        train_step = learner._train_step

        def timed_train_step(batch):  # the model's share of the step, left out of what is measured
            started = time.perf_counter()
            try:
                return train_step(batch)
            finally:
                in_model[0] = time.perf_counter() - started

        learner._train_step = timed_train_step
        learner.train()
    finally:
        learner.cleanup()
        data_parallel.stop()
    if data_parallel.rank == 1:
        (root / "rank1.json").write_text(json.dumps(samples))


def make_model(tokenizer):
    from rlhf_pipeline.models import tiny_causal_lm

    return tiny_causal_lm(len(tokenizer), hidden_size=64, num_layers=2, num_heads=2, seed=0)


def make_run(root: Path) -> None:
    """A recorded buffer of :data:`ROWS` length-skewed rows and the version-0 weights."""
    from rlhf_pipeline.coordination.weights import publish_weights
    from rlhf_pipeline.models import char_tokenizer
    from rlhf_pipeline.pipeline import RunPaths
    from rlhf_pipeline.schema import StoreSchema
    from rlhf_pipeline.schema.synthetic import synthetic_batch
    from rlhf_pipeline.storage import create_store

    store = create_store(RunPaths(root).buffer, "memmap", schema=StoreSchema(optional=("advantage",)),
                         segment_rows=64)
    store.append(synthetic_batch(ROWS, group_size=4, prompt_len=(32, 128), response_len=(64, 512), seed=5,
                                 optional_fields=("advantage",), vocab_size=len(char_tokenizer())))
    store.close()
    publish_weights(root, make_model(char_tokenizer()).state_dict(), 0)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="each repeat's medians, as JSON")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.worker)
        return 0
    import rlhf_pipeline

    print(f"rlhf_pipeline from {Path(rlhf_pipeline.__file__).parent}")
    per_repeat: list[list[float]] = []  # each repeat's median of each measure
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            make_run(root)
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                            "--master-port", str(29500 + os.getpid() % 1000), __file__, "--worker", str(root)],
                           check=True, stdout=subprocess.DEVNULL)
            samples = json.loads((root / "rank1.json").read_text())
            per_repeat.append([statistics.median(s[i] for s in samples) for i in range(len(MEASURES))])
    if args.json:
        print(json.dumps(per_repeat))
        return 0
    print(f"rank 1 of 2 (gloo, CPU), {STEPS - WARMUP_STEPS - 1} steps x {args.repeat} repeats; ms per step")
    print(f"{'':34} {'median':>8} {'range':>17}")
    for i, name in enumerate(MEASURES):
        values = [r[i] for r in per_repeat]
        print(f"{name:34} {statistics.median(values):8.2f} {min(values):8.2f}-{max(values):8.2f}")
    return 0


if __name__ == "__main__":
    from rlhf_pipeline.bench.page import script_main

    sys.exit(script_main(__file__, main, sys.argv[1:]))
