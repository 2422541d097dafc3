"""The synchronous baseline of ``bench e2e``: generate a round, train on it, repeat, in one process.

Built from the pipeline's own parts (settings, ``prepare_run``, collector, write path,
:class:`~rlhf_pipeline.learn.learner.Learner`) so that only the orchestration differs from ``run``.
Run as ``python -m rlhf_pipeline.bench.sync_loop PIPELINE.py --home DIR --run-name NAME --steps N
[--threads N] [--set key=value ...]``; it writes the run directory as ``run`` does.
Design: docs/benchmarks.md#end-to-end-rlhf-pipeline-bench-e2e.
"""

from __future__ import annotations

import argparse
import sys
import time


def run_synchronous(pipeline_path: str, *, steps: int, home: str, run_name: str, overrides: list[str],
                    threads: int | None = None) -> int:
    import torch

    from rlhf_pipeline.learn.learner import Learner
    from rlhf_pipeline.learn.metrics import MetricsWriter
    from rlhf_pipeline.coordination.pacing import CollectorPacer, shard_key
    from rlhf_pipeline.files.run_paths import run_dir
    from rlhf_pipeline.pipeline import RunPaths, load_pipeline_module, make_settings
    from rlhf_pipeline.runs.processes import build_pipeline
    from rlhf_pipeline.runs.run_directory import prepare_run
    from rlhf_pipeline.storage import open_store
    from rlhf_pipeline.coordination.weights import load_weights

    module = load_pipeline_module(pipeline_path)
    settings = make_settings(module, [*overrides, f"steps={steps}"])
    paths = RunPaths(run_dir(run_name, home).resolve())
    pipeline = build_pipeline(module, settings, paths)
    threads = threads if threads is not None else pipeline.settings.threads
    if threads is not None:
        torch.set_num_threads(threads)
    prepare_run(pipeline, paths, shards=(0,))

    store = open_store(str(paths.shard(0)), mode="a")
    model = pipeline.make_model()
    state, version = load_weights(paths.root)
    model.load_state_dict(state)
    collector = pipeline.make_collector(model, store, collector_index=0)
    collector.set_policy_state(state, version)
    learner = Learner.from_pipeline(pipeline, paths)
    rounds = MetricsWriter(paths.collector_metrics(0))
    needs = CollectorPacer(paths.pacing, shard_key(paths.shard(0), paths.buffer), max_lag=0,
                           round_rows=collector.round_rows)
    try:
        learner.setup()
        while learner.progress.step < steps:
            while needs.may_collect(store.next_row):  # the rows the learner's next batch needs
                before = store.next_row
                collector.collect()
                rounds.log(collector.batches_emitted, {**collector.last_metrics,
                                                       "rows_written": float(store.next_row - before)})
            learner.train(max_steps=1, checkpoint_when_paused=False)
            collector.set_policy_state(learner.model.state_dict(), learner.progress.policy_version)
        learner.save_checkpoint()
    finally:
        learner.cleanup()
        rounds.close()
        store.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlhf_pipeline.bench.sync_loop", description=__doc__)
    parser.add_argument("pipeline")
    parser.add_argument("--home", required=True)
    parser.add_argument("--run-name", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    started = time.time()
    code = run_synchronous(args.pipeline, steps=args.steps, home=args.home, run_name=args.run_name,
                           overrides=args.overrides, threads=args.threads)
    print(f"[sync] {args.steps} steps in {time.time() - started:.1f}s", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
