"""One data-parallel learner rank, run by ``torchrun`` from ``test_distributed.py``.

``python -m torch.distributed.run --nproc-per-node N tests/learn/data_parallel_worker.py JOBS.json``
runs the jobs of JOBS.json in order, one process group for them all (starting N ranks costs more
than the steps they train, so the tests give one set of ranks every run it can train). A job,
``{"root": RUN_DIR, "steps": STEPS, "mode": MODE, "buffer": URL or null}``, trains the run in
RUN_DIR (a buffer and version-0 weights made by :func:`make_run`) to STEPS steps, the way
``rlhf-pipeline learn`` does under torchrun: ranks from the torchrun environment, the process
group started before the learner and stopped after it. Modes (``""``: :data:`SETTINGS`). ``live``:
:data:`LIVE_SETTINGS`, for a buffer that another process keeps appending to; every rank then
writes the rows of each step to ``RUN_DIR/rows-rank<R>.jsonl`` (rank 0 also the step's draw).
``fsdp``: :data:`SETTINGS` with ``parallelism="fsdp"`` (FSDP2 instead of DDP). ``turns`` and
``turns-fsdp``: :data:`MULTI_TURN_SETTINGS` (a buffer of multi-turn trajectories), with DDP or FSDP2.
``stop``: :data:`SETTINGS`, rank 0's stop event set after step :data:`STOP_AT_STEP` (a stop request
that reaches rank 0 alone).
``shards``: :data:`SHARDED_SETTINGS` over a buffer of :data:`SHARDS` shards (:func:`make_sharded_run`),
each rank writing its rows as ``live`` does; ``shards-of-3``: :data:`THREE_SHARDS_SETTINGS` over 3 shards.
``s3-shards``: the same over the job's buffer, at an
S3 URL (the server and credentials in the environment); each rank signs its requests with its own
access key id (``rank<R>``), so the server can tell which rank sent what.
``lora``: :data:`SETTINGS` training a LoRA adapter (:data:`LORA`) on the frozen version 0.
``blow-up`` and ``blow-up-fsdp``: :data:`SETTINGS` at a learning rate of 1e30 (DDP or FSDP2), whose
first step leaves weights that are not finite: each rank writes the refusal it raised to
``RUN_DIR/refused-rank<R>.txt`` and goes on to the next job.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

from rlhf_pipeline.learn.distributed import DataParallel
from rlhf_pipeline.learn.errors import NonFiniteStep
from rlhf_pipeline.learn.learner import BufferSource, Learner
from rlhf_pipeline.learn.settings import GRPOLossConfig, LearnerSettings, LoraSettings
from rlhf_pipeline.models import char_tokenizer, tiny_causal_lm
from rlhf_pipeline.pipeline import RunPaths
from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage import create_store
from rlhf_pipeline.schema.synthetic import synthetic_batch
from rlhf_pipeline.coordination.weights import publish_weights

TOKENIZER = char_tokenizer()
ROWS = 33  # batches of 16, 16, 1 per epoch: the third leaves rank 1 of 2 without a row (a filler)
SEED = 1
# small micro-batches: ranks accumulate different numbers of them before DDP's all-reduce.
# old_policy="current": ratios of 1, so no row's gradient is clipped away (the synthetic rows'
# log-probs are random) and every row, the filler step's included, moves the weights
SETTINGS = LearnerSettings(batch_size=16, sampler="epoch", epoch_order="shuffle", shuffle_window_rows=0,
                           micro_batch_tokens=48, lr=1e-3, warmup_steps=1, max_staleness=None,
                           checkpoint_every=2, log_every=1, loss=GRPOLossConfig(old_policy="current"))


# a sampler that waits for new rows and draws from the newest ones: over a growing buffer, what
# it draws depends on when it looks
LIVE_SETTINGS = LearnerSettings(batch_size=16, sampler="window", sample_window=24, new_rows_per_step=8,
                                micro_batch_tokens=48, lr=1e-3, warmup_steps=1, max_staleness=None,
                                checkpoint_every=2, log_every=1, data_timeout_s=60,
                                loss=GRPOLossConfig(old_policy="current"))

# a buffer of multi-turn trajectories read in the order written (test_distributed.py builds it so that
# draws end several trajectories, one, or none); trajectories that hit the turn limit are left out
MULTI_TURN_SETTINGS = LearnerSettings(batch_size=8, sampler="epoch", epoch_order="sequential", micro_batch_tokens=48,
                                      lr=1e-3, warmup_steps=1, max_staleness=None, checkpoint_every=2, log_every=1,
                                      mask_termination_reasons=("max_turns",),
                                      loss=GRPOLossConfig(old_policy="current"))


# the exact sampler over several shards: each draw takes an even share of every shard, oldest first
SHARDS, ROWS_PER_SHARD = 4, 20
SHARDED_SETTINGS = LearnerSettings(batch_size=16, sampler="exact", micro_batch_tokens=48, lr=1e-3, warmup_steps=1,
                                   max_staleness=None, checkpoint_every=2, log_every=1,
                                   loss=GRPOLossConfig(old_policy="current"))
# ``shards-of-3``: the same over 3 shards (:func:`make_sharded_run` with ``shards=3``), 4 rows of each a draw
THREE_SHARDS_SETTINGS = dataclasses.replace(SHARDED_SETTINGS, batch_size=12)


# ``lora``: SETTINGS, an adapter on the frozen base (tests/learn/test_lora_data_parallel.py)
LORA = LoraSettings(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "up_proj"))

# ``stop``: SETTINGS, and rank 0 alone is asked to stop after this step, with draws prefetched ahead
STOP_AT_STEP = 1


def make_model() -> torch.nn.Module:
    return tiny_causal_lm(len(TOKENIZER), hidden_size=32, num_layers=1, num_heads=2, seed=0)


def rows(count: int):
    """``count`` synthetic rows whose trajectory ids are 0, 1, ...: in a store they fill from
    empty (and never evicts), a row's id is its position."""
    return synthetic_batch(count, group_size=3, prompt_len=(3, 8), response_len=(1, 7), seed=5,
                           optional_fields=("advantage",), vocab_size=len(TOKENIZER))


def make_run(root: Path) -> RunPaths:
    """A run directory holding a recorded buffer and the initial weights: nothing to collect."""
    paths = RunPaths(root)
    store = create_store(paths.buffer, "memmap", schema=StoreSchema(optional=("advantage",)), segment_rows=8)
    store.append(rows(ROWS))
    store.close()
    publish_weights(paths.root, make_model().state_dict(), 0)
    return paths


def make_sharded_run(root: Path, shards: int = SHARDS) -> RunPaths:
    """A run whose buffer is ``shards`` shards of :data:`ROWS_PER_SHARD` rows: shard ``k`` holds the
    rows with trajectory ids ``[k * ROWS_PER_SHARD, (k + 1) * ROWS_PER_SHARD)``."""
    paths = RunPaths(root)
    source = rows(shards * ROWS_PER_SHARD)
    for k in range(shards):
        store = create_store(paths.buffer / f"shard-{k:04d}", "memmap", schema=StoreSchema(optional=("advantage",)),
                             segment_rows=8)
        store.append(source.select(slice(k * ROWS_PER_SHARD, (k + 1) * ROWS_PER_SHARD)))
        store.close()
    publish_weights(paths.root, make_model().state_dict(), 0)
    return paths


def record_rows(root: Path, rank: int):
    """An ``on_step`` that appends the step's rows (trajectory ids of this rank's slice; on rank 0
    also the draw's positions) to ``root/rows-rank<rank>.jsonl``."""
    def on_step(step, sampled, batch, metrics) -> None:
        mine = [] if DataParallel.is_filler(batch) else batch["trajectory_id"].tolist()
        line = {"step": step, "rows": mine, **({"draw": sampled.positions.tolist()} if rank == 0 else {})}
        with open(root / f"rows-rank{rank}.jsonl", "a") as out:
            out.write(json.dumps(line) + "\n")

    return on_step


def train(root: Path, steps: int, data_parallel: DataParallel | None = None, mode: str = "",
          buffer: str | None = None) -> Learner:
    data_parallel = data_parallel or DataParallel()
    live = mode in ("live", "shards", "shards-of-3", "s3-shards")
    settings = {"live": LIVE_SETTINGS, "shards": SHARDED_SETTINGS, "shards-of-3": THREE_SHARDS_SETTINGS,
                "s3-shards": SHARDED_SETTINGS, "fsdp": dataclasses.replace(SETTINGS, parallelism="fsdp"),
                "turns": MULTI_TURN_SETTINGS,
                "turns-fsdp": dataclasses.replace(MULTI_TURN_SETTINGS, parallelism="fsdp"),
                "lora": dataclasses.replace(SETTINGS, lora=LORA),
                "blow-up": dataclasses.replace(SETTINGS, lr=1e30),
                "blow-up-fsdp": dataclasses.replace(SETTINGS, lr=1e30, parallelism="fsdp")}.get(mode, SETTINGS)
    on_step = record_rows(root, data_parallel.rank) if live else None
    if mode == "stop" and data_parallel.is_main:
        def stop_rank_zero(step, sampled, batch, metrics) -> None:  # rank 0 alone is asked to stop
            if step == STOP_AT_STEP:
                learner.stop_event.set()

        on_step = stop_rank_zero
    learner = Learner(settings, RunPaths(root), make_model=make_model, steps=steps,
                      source=None if buffer is None else BufferSource(buffer),
                      seed=SEED, show_progress=False, data_parallel=data_parallel, on_step=on_step)
    try:
        learner.setup()
        if data_parallel.sharded:  # FSDP2 really shards the model (its parameters are DTensors)
            from torch.distributed.fsdp import FSDPModule

            assert isinstance(learner.model, FSDPModule) and isinstance(learner.model.model.layers[0], FSDPModule)
        learner.train()
    finally:
        learner.cleanup()
    return learner


def main() -> None:
    torch.set_num_threads(1)
    DataParallel.from_torchrun_env().start(torch.device("cpu"))
    try:
        for job in json.loads(Path(sys.argv[1]).read_text()):
            run_job(Path(job["root"]), job["steps"], job["mode"], job["buffer"])
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_job(root: Path, steps: int, mode: str, buffer: str | None) -> None:
    # a DataParallel of its own per job (what it learned of one buffer is no other's); the process
    # group is main's, so its start() joins that group and its stop() leaves it alone
    data_parallel = DataParallel.from_torchrun_env()
    data_parallel.start(torch.device("cpu"))
    if mode == "s3-shards":
        import os

        from rlhf_pipeline.storage.zarr import object_store

        os.environ["AWS_ACCESS_KEY_ID"] = f"rank{data_parallel.rank}"
        # every refresh asked for is sent (not once a second): a rank that refreshed would show on the server
        object_store.DEFAULT_REFRESH_INTERVAL_S = 0.0
    try:
        train(root, steps, data_parallel, mode=mode, buffer=buffer)
    except NonFiniteStep as refused:
        (root / f"refused-rank{data_parallel.rank}.txt").write_text(str(refused))


if __name__ == "__main__":
    main()
