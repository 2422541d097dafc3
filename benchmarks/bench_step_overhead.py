"""What a learner step and a collection round pay besides training and generating: each piece as
it is now beside what it replaced, timed in one process.

* TensorBoard: one event holding a step's ~45 scalars (``MetricsWriter``) against one
  ``add_scalar`` call per scalar;
* weights: publishing (safetensors, fsync'd) and loading the default pipeline's policy against
  ``torch.save``/``torch.load(weights_only=True)`` of the same state dict;
* a learner's poll for new rows: refreshing a 1-shard union with the cached shard listing
  against listing the buffer directory on every refresh.

Each piece runs ``--repeat`` rounds of ``--calls`` calls; the table gives the median time per
call over the rounds, the range, and the ratio old / new of the medians::

    python benchmarks/bench_step_overhead.py --repeat 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path


def per_call_ms(fn, calls: int, repeat: int) -> list[float]:
    rounds = []
    for _ in range(repeat):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - started) / calls * 1e3)
    return rounds


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args(argv)

    import torch
    from torch.utils.tensorboard import SummaryWriter

    from rlhf_pipeline.files.atomic import save_torch_atomic
    from rlhf_pipeline.learn.metrics import MetricsWriter
    from rlhf_pipeline.schema import StoreSchema
    from rlhf_pipeline.storage import create_store, open_buffer
    from rlhf_pipeline.storage.sharded import shard_path
    from rlhf_pipeline.schema.synthetic import synthetic_batch
    from rlhf_pipeline.coordination.weights import load_weights, publish_weights

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines"))
    import default as default_pipeline

    settings = default_pipeline.Settings()
    model = default_pipeline.build(settings, None).make_model()  # the run directory is not used to build
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    metrics = {f"charts/metric_{i}": 0.5 for i in range(45)}
    rows: list[tuple[str, list[float], list[float]]] = []

    with tempfile.TemporaryDirectory(prefix="bench-step-overhead-") as tmp:
        root = Path(tmp)
        writer = MetricsWriter(root / "metrics.jsonl", root / "tb-new")
        steps = iter(range(10**9))
        new = per_call_ms(lambda: writer._log_tensorboard(next(steps), metrics), args.calls, args.repeat)
        writer.close()
        old_writer = SummaryWriter(str(root / "tb-old"))

        def add_each():
            step = next(steps)
            for key, value in metrics.items():
                old_writer.add_scalar(key, value, step)

        old = per_call_ms(add_each, args.calls, args.repeat)
        old_writer.close()
        rows.append(("TensorBoard, a step's 45 scalars", old, new))

        versions = iter(range(10**9))
        new = per_call_ms(lambda: publish_weights(root / "run", state, next(versions)), args.calls, args.repeat)
        old = per_call_ms(lambda: save_torch_atomic({"version": 0, "state_dict": state}, root / "old.pt"),
                          args.calls, args.repeat)
        rows.append(("publish the policy (fsync'd)", old, new))
        new = per_call_ms(lambda: load_weights(root / "run"), args.calls, args.repeat)
        old = per_call_ms(lambda: torch.load(root / "old.pt", map_location="cpu", weights_only=True),
                          args.calls, args.repeat)
        rows.append(("load the policy", old, new))

        buffer = root / "buffer"
        store = create_store(shard_path(buffer, 0), "memmap", schema=StoreSchema())
        store.append(synthetic_batch(64, seed=0))
        store.close()
        union = open_buffer(buffer, mode="r")
        new = per_call_ms(lambda: len(union), args.calls * 10, args.repeat)

        def refresh_listing():
            union._listing = None  # what every refresh did before the listing was cached
            len(union)

        old = per_call_ms(refresh_listing, args.calls * 10, args.repeat)
        union.close()
        rows.append(("a learner's poll for rows (1 shard)", old, new))

    print(f"{'piece':40s} {'before (ms)':>22s} {'now (ms)':>22s} {'before/now':>10s}")
    for name, old, new in rows:
        def cell(values):
            return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"

        print(f"{name:40s} {cell(old):>22s} {cell(new):>22s} {statistics.median(old) / statistics.median(new):9.1f}x")
    return 0


if __name__ == "__main__":
    from rlhf_pipeline.bench.page import script_main

    sys.exit(script_main(__file__, main, sys.argv[1:]))
