"""The learner recipe: setup -> train -> save_checkpoint -> cleanup (torchtune-style).

One optimizer step:

1. take the next padded batch from the prefetch thread (sampled from the newest
   ``sample_window`` rows of the buffer once ``new_rows_per_step`` new rows arrived, see
   ``learn/prefetch.py``); drop rows sampled by a policy more than ``max_staleness``
   versions older than ours (counted as ``charts/rows_dropped_stale``);
2. cut it into micro-batches of at most ``micro_batch_tokens`` padded tokens
   (``learn/microbatch.py``) and accumulate gradients over them, each micro-batch's loss
   weighted by its share of the batch (its response tokens for token-mean aggregation,
   its rows otherwise), so the sum equals the loss of the whole batch;
3. clip the gradient norm, AdamW step, LR schedule step (linear warm-up, then constant or
   cosine decay);
4. every ``publish_every`` steps publish the weights as a new version (``weights.py``);
   write metrics; every ``checkpoint_every`` steps (and on stop) save a checkpoint.

With ``priority_feedback`` (prioritized sampling) the loss also gives one value per row, and
after the step the learner hands them to the sampler for the rows it trained on
(``PrioritizedRowSampler.feed_back``, ``charts/priority_feedback_*``).

After taking each batch the learner publishes what it has taken in from each shard
(``<run>/pacing.json``), so collectors generate no more than it will train on
(:mod:`rlhf_pipeline.coordination.pacing`); it counts the distinct rows it trained on against the rows
generated, and logs how stale they were (``learn/usage.py``).

On CUDA the forward runs under bf16 autocast, batches are pinned by the prefetch thread
and copied with ``non_blocking=True``. A resumed run loads model, optimizer, scheduler,
RNG and progress and continues exactly as an uninterrupted one would over the same data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from rlhf_pipeline.schema.ids import collector_index_of
from rlhf_pipeline.learn.checkpoint import (
    CheckpointManager,
    Progress,
    capture_rng_state,
    restore_rng_state,
)
from rlhf_pipeline.learn.distributed import DataParallel, MainStopped
from rlhf_pipeline.learn.loss import aggregates_by_token, grpo_step_loss
from rlhf_pipeline.learn.metrics import (
    MetricsWriter,
    ProgressDisplay,
    group_reward_stats,
    truncate_metrics,
)
from rlhf_pipeline.learn.microbatch import split_microbatches_with_rows, take_rows
from rlhf_pipeline.learn.prefetch import Prefetcher
from rlhf_pipeline.learn.samplers import make_sampler
from rlhf_pipeline.learn.settings import LearnerSettings
from rlhf_pipeline.learn.shard_rows import next_rows, row_names
from rlhf_pipeline.learn.usage import TrainedRows, staleness_metrics
from rlhf_pipeline.coordination.pacing import LearnerIntake, PacingPublisher
from rlhf_pipeline.files.run_paths import RunPaths


def lr_lambda(settings: LearnerSettings, total_steps: int) -> Callable[[int], float]:
    """LR multiplier of step ``s``: linear warm-up, then constant or cosine to ``min_lr_ratio``."""

    def factor(step: int) -> float:
        if step < settings.warmup_steps:
            return (step + 1) / settings.warmup_steps
        if settings.lr_schedule == "constant":
            return 1.0
        span = max(1, total_steps - settings.warmup_steps)
        progress = min(1.0, (step - settings.warmup_steps) / span)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return settings.min_lr_ratio + (1.0 - settings.min_lr_ratio) * cosine

    return factor


class Learner:
    """Trains the policy on batches sampled from a run's buffer; publishes weights."""

    def __init__(self, settings: LearnerSettings, paths: RunPaths, *, make_model: Callable[[], torch.nn.Module],
                 steps: int, seed: int = 0, device: str = "cpu", pad_token_id: int = 0,
                 stop_event: threading.Event | None = None, show_progress: bool = True,
                 buffer: str | None = None, batch_transform: Callable[[torch.Tensor, Any], Any] | None = None,
                 on_step: Callable[[int, Any, Any, dict[str, float]], None] | None = None,
                 data_parallel: DataParallel | None = None) -> None:
        """``buffer``: the store to read (a path or URL ``open_buffer`` opens) instead of the run's
        own ``buffer/`` (replay); ``batch_transform(positions, padded_batch) -> padded_batch`` runs on
        the prefetch thread after each read (replay's re-scoring); ``on_step(step, sampled, batch,
        metrics)`` runs after each step, before its metrics are written, and may add metrics.
        ``data_parallel``: this process's rank among data-parallel learners (``learn/distributed.py``;
        its process group already started); ``batch`` in ``batch_transform``/``on_step`` is then the
        rank's own slice."""
        settings.check()
        self.settings = settings
        self.paths = paths
        self.make_model = make_model
        self.total_steps = steps
        self.seed = seed
        self.data_parallel = data_parallel or DataParallel()
        self.data_parallel.parallelism = settings.parallelism  # ddp or fsdp, with several ranks
        if self.data_parallel.enabled and settings.priority_feedback != "none":
            # each rank holds only its own rows' feedback; the shared draw would need all of it
            raise ValueError("learner setting 'priority_feedback' is not supported with several data-parallel "
                             "ranks yet; use priority_feedback=none or run one learner rank")
        self.device = self.data_parallel.device_for(torch.device(device))
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for but torch sees no GPU; use --device cpu")
        self.pad_token_id = pad_token_id
        self.stop_event = stop_event or threading.Event()
        self.show_progress = show_progress
        self.buffer = str(buffer) if buffer is not None else paths.buffer_location
        self.batch_transform = batch_transform
        self.on_step = on_step
        self.checkpoints = CheckpointManager(paths.checkpoints, keep_last=settings.keep_checkpoints)
        self._prefetcher: Prefetcher | None = None
        self._ready = False
        self._store = None
        self._metrics: MetricsWriter | None = None
        self._display: ProgressDisplay | None = None
        self._pacing = PacingPublisher(paths.pacing)
        self._trained = TrainedRows()

    @classmethod
    def from_pipeline(cls, pipeline, paths: RunPaths, stop_event: threading.Event | None = None,
                      data_parallel: DataParallel | None = None) -> Learner:
        s = pipeline.settings
        return cls(pipeline.learner, paths, make_model=pipeline.make_model, steps=s.steps,
                   seed=getattr(s, "seed", 0), device=s.device, pad_token_id=pipeline.pad_token_id,
                   stop_event=stop_event, data_parallel=data_parallel)

    # ================================================================== setup
    def setup(self) -> None:
        torch.manual_seed(self.seed)
        checkpoint = self._load_checkpoint()
        self._setup_model(checkpoint)
        self._setup_optimizer(checkpoint)
        self._setup_data(checkpoint)
        if checkpoint is not None:
            restore_rng_state(checkpoint["rng"])
            if checkpoint.get("trained_rows") is not None:
                self._trained.load_state_dict(checkpoint["trained_rows"])
        # collectors wait on this: a resumed learner restarts from its checkpoint's intake
        saved = (checkpoint or {}).get("intake")
        intake = LearnerIntake.from_json(saved) if saved else LearnerIntake(self.progress.step, self.progress.draws,
                                                                            {}, self.settings.batch_size)
        intake.waiting_since = None  # a wait from before the stop is over
        intake.policy_version = self.progress.policy_version
        self._pacing.intake = intake
        if not self.data_parallel.is_main:  # only rank 0 writes files
            return
        self._pacing.publish(intake, new_draw=not saved)
        truncate_metrics(self.paths.metrics, self.progress.step)
        self._metrics = MetricsWriter(self.paths.metrics, self.paths.tensorboard)
        if self.show_progress:
            # epoch replays train on another run's rows: their staleness means nothing, the ratio does
            keys = ProgressDisplay.OFF_POLICY_KEYS if self.settings.sampler == "epoch" else ProgressDisplay.KEYS
            self._display = ProgressDisplay(self.total_steps, self.progress.step, self.settings.log_every, keys=keys)

    def _load_checkpoint(self) -> dict[str, Any] | None:
        if self.checkpoints.latest() is None:
            self.progress = Progress(seed=self.seed)
            return None
        self.progress, state = self.checkpoints.load()
        if self.progress.seed != self.seed:
            raise ValueError(f"checkpoint was made with seed {self.progress.seed}, this run has seed {self.seed}")
        print(f"[learner] resuming from {self.checkpoints.latest()} (step {self.progress.step})",
              file=sys.stderr, flush=True)
        return state

    def _setup_model(self, checkpoint: dict[str, Any] | None) -> None:
        from rlhf_pipeline.coordination.weights import load_weights

        self.model = self.make_model()
        if checkpoint is not None:
            self.model.load_state_dict(checkpoint["model"])
        else:
            state, version = load_weights(self.paths.root)  # the initial policy, version 0
            self.model.load_state_dict(state)
            self.progress.policy_version = version
        self.model.to(self.device).train()
        self.train_model = self.data_parallel.wrap(self.model, self.device)  # what forward/backward run through

    def _setup_optimizer(self, checkpoint: dict[str, Any] | None) -> None:
        s = self.settings
        # fused AdamW: one kernel over every tensor (CUDA, and CPU since torch 2.4) instead of a
        # Python loop per parameter: 0.4 ms against 2.5 ms a step for the default pipeline's model
        # on one CPU thread. FSDP's sharded DTensor parameters keep the default implementation
        fused = self.data_parallel.parallelism != "fsdp" or not self.data_parallel.enabled
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=s.lr, betas=s.adam_betas,
                                           weight_decay=s.weight_decay, fused=fused or None)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(s, self.total_steps))
        if checkpoint is not None:
            self.data_parallel.load_optimizer_state(self.model, self.optimizer, checkpoint["optimizer"])
            self.scheduler.load_state_dict(checkpoint["scheduler"])

    def _setup_data(self, checkpoint: dict[str, Any] | None) -> None:
        from rlhf_pipeline.schema.padding import PaddedCollator
        from rlhf_pipeline.storage import open_buffer

        # one store, or the union of the collectors' shards (new shards are picked up as they appear)
        self._store = open_buffer(self.buffer, mode="r")
        if checkpoint is not None:
            self._store.load_state_dict(checkpoint["buffer"])  # the rows it saw must still be there
        self.sampler = make_sampler(self.settings, self._store, seed=self.seed, stop=self.stop_event)
        # the state after the last draw a step used (draws run ahead on the prefetch thread)
        self._sampler_state = self.sampler.state_dict()
        if checkpoint is not None:
            # checkpoints from before learner samplers kept the window sampler's state in Progress
            self._sampler_state = checkpoint.get("sampler") or {"min_next_row": self.progress.min_next_row}
            try:
                self.sampler.load_state_dict(self._sampler_state)
            except KeyError:  # learner.* may change on resume, the sampler too: it starts afresh
                print(f"[learner] the checkpoint's sampler state is another sampler's; "
                      f"{self.settings.sampler!r} starts from the buffer as it is now", file=sys.stderr, flush=True)
                self._sampler_state = self.sampler.state_dict()
        self.sampler.current_version = self.progress.policy_version
        pin = self.device.type == "cuda"
        # int32 token and position ids: half their bytes, nothing widened (collate.py, "Index dtype")
        collator = PaddedCollator(pad_token_id=self.pad_token_id, pin_memory=pin and self.batch_transform is None,
                                  index_dtype=torch.int32)

        def read(positions: torch.Tensor, filler: bool):
            batch = collator.read(self._store, positions)
            if self.batch_transform is not None:
                batch = self.batch_transform(positions, batch)
                if pin and torch.cuda.is_available():
                    batch = batch.pin_memory()
            if self.data_parallel.enabled:
                batch = self.data_parallel.mark_filler(batch, filler)
            return batch

        def produce(draw: int):
            sampled = self.sampler.draw(draw)  # positions, read before the store refreshes again
            return sampled, read(*self.data_parallel.local_positions(sampled.positions))  # this rank's slice

        self._read_rows = read
        if self.data_parallel.is_main:  # the other ranks take rank 0's draws (_next_draw)
            self._prefetcher = Prefetcher(self._naming_rows(produce), self.progress.draws,
                                          depth=self.settings.prefetch_depth, stop=self.stop_event)
            if hasattr(self.sampler, "hurry"):  # it polls for rows fast only while a step waits for them
                self.sampler.hurry = self._prefetcher.consumer_waiting
        self._ready = True

    def _naming_rows(self, produce: Callable[[int], tuple[Any, Any]]) -> Callable[[int], tuple[Any, ...]]:
        """``produce`` plus what outlives the store's next refresh, taken on the prefetch thread
        right after the draw: each row's shard and global id, and the rows taken in per shard."""
        default_need = self.settings.new_rows_per_step or self.settings.batch_size

        def produce_named(draw: int):
            sampled, batch = produce(draw)
            consumed = sampled.consumed if sampled.consumed is not None else next_rows(self._store)
            need = default_need if sampled.next_draw_rows is None else sampled.next_draw_rows
            return sampled, batch, row_names(self._store, sampled.positions), LearnerIntake(consumed=consumed,
                                                                                            next_draw_rows=need)

        return produce_named

    # ================================================================== train
    def train(self, max_steps: int | None = None, *, checkpoint_when_paused: bool = True) -> bool:
        """Runs until ``steps``, a stop request, or ``max_steps`` more steps (then checkpoints,
        unless ``checkpoint_when_paused`` is False: a caller that trains a step at a time).

        Returns True when all ``steps`` were taken.
        """
        assert self._ready, "call setup() first"
        waited = 0.0
        until = self.total_steps if max_steps is None else min(self.total_steps, self.progress.step + max_steps)
        on_wait = self._pacing.waiting if self.data_parallel.is_main else None
        while self.progress.step < until and not self.data_parallel.any_rank(self.stop_event.is_set()):
            try:
                draw, (sampled, batch, names, intake), wait = self._next_draw(on_wait)
            except InterruptedError:
                break
            assert draw == self.progress.draws, (draw, self.progress.draws)
            waited += wait
            self.progress.draws += 1
            self.progress.buffer_next_row = sampled.buffer_next_row
            self._sampler_state = sampled.sampler_state
            if sampled.weights is not None:  # prioritized sampling: the loss weighs each row
                # torchrl's weights divide by the largest over the whole buffer, which a single
                # near-zero priority (a zero-advantage row) makes tiny: ~0.04 on average in a
                # default-pipeline run, a 25x smaller step. Their mean over the (global) batch is
                # 1 here, so only the relative correction acts and the learning rate keeps its meaning
                weights = sampled.weights.to(torch.float32)
                weights = weights / weights.mean().clamp_min(torch.finfo(torch.float32).tiny)
                batch["sample_weight"], _ = self.data_parallel.local_positions(weights)  # this rank's rows'
            intake.step, intake.draws = self.progress.step, self.progress.draws
            intake.policy_version = self.progress.policy_version  # what the rounds it allows use (pacing.py)
            if self.data_parallel.is_main:
                self._pacing.publish(intake)  # collectors may now generate the rows the next draw needs
            else:
                self._pacing.intake = intake  # (what rank 0 checkpoints; kept alike on every rank)
            kept = self._fresh_mask(batch)
            batch, stale_now, kept = self._drop_stale_on_every_rank(batch, kept)
            dropped = sampled.dropped_stale + stale_now
            self.progress.rows_dropped_stale += dropped
            if batch is None:  # every row went stale while it waited in the prefetch queue
                if self._feedback:
                    self.sampler.feed_back(draw, torch.zeros(0, dtype=torch.int64), torch.zeros(0))
                continue
            t0 = time.perf_counter()
            metrics, row_feedback = self._train_step(batch)
            if row_feedback is not None:  # the new priorities of the rows this step trained on
                self.sampler.feed_back(draw, sampled.positions[torch.from_numpy(kept)], row_feedback)
                metrics["charts/priority_feedback_mean"] = float(row_feedback.mean())
                metrics["charts/priority_feedback_max"] = float(row_feedback.max())
            self._trained.mark(names.select(kept).by_shard())
            self.progress.step += 1
            if self.progress.step % self.settings.publish_every == 0:
                self._publish()
            elapsed = time.perf_counter() - t0
            metrics.update({
                "charts/tokens_per_s": metrics.pop("_tokens") / max(elapsed + waited, 1e-9),
                "charts/data_wait_s": waited,
                "charts/rows_dropped_stale": float(dropped),
                "charts/rows_dropped_stale_total": float(self.progress.rows_dropped_stale),
                "charts/policy_version": float(self.progress.policy_version),
                "charts/buffer_rows": float(sampled.buffer_rows),
                # waste: rows ever written to the buffer over the distinct rows trained on so far
                "charts/rows_generated": float(sampled.buffer_next_row),
                "charts/rows_trained": float(self._trained.count),
                "charts/rows_generated_per_row_trained": sampled.buffer_next_row / max(self._trained.count, 1),
                "charts/step_time_s": elapsed,
                **sampled.metrics,
            })
            waited = 0.0
            if self.on_step is not None:
                self.on_step(self.progress.step, sampled, batch, metrics)
            if self._metrics is not None:  # rank 0
                self._metrics.log(self.progress.step, metrics)
            if self._display is not None:
                self._display.update(self.progress.step, metrics)
            if self.progress.step % self.settings.checkpoint_every == 0 or self.progress.step == self.total_steps:
                self.save_checkpoint()
        finished = self.progress.step >= self.total_steps
        if not finished and (checkpoint_when_paused or self.stop_event.is_set()):
            self.save_checkpoint()
            if self.data_parallel.is_main:
                print(f"[learner] stopped at step {self.progress.step}; checkpoint saved, run the same "
                      f"command again to resume", file=sys.stderr, flush=True)
        return finished

    def _next_draw(self, on_wait: Callable[[], None] | None):
        """``(draw, (sampled, batch, names, intake), seconds waited)`` from the prefetch thread. With
        several ranks only rank 0 draws (its sampler alone sees the buffer grow, decides staleness
        drops, epochs and pacing) and shares the draw; every other rank reads its own slice of the
        named rows from its view of the same buffer, refreshed until it holds them."""
        dp = self.data_parallel
        if not dp.enabled:
            return self._prefetcher.next(on_wait=on_wait)
        start = time.perf_counter()
        if dp.is_main:
            try:
                draw, (sampled, batch, names, intake), _ = self._prefetcher.next(on_wait=on_wait)
            except InterruptedError:
                dp.share_draw(MainStopped(interrupted=True))
                raise
            except Exception as exc:
                dp.share_draw(MainStopped(interrupted=False, message=f"{type(exc).__name__}: {exc}"))
                raise
            # the sampler state stays here: only rank 0 checkpoints it
            dp.share_draw((draw, dataclasses.replace(sampled, sampler_state={}), names, intake))
            return draw, (sampled, batch, names, intake), time.perf_counter() - start
        shared = dp.share_draw(None)
        if isinstance(shared, MainStopped):
            shared.raise_here()
        draw, sampled, names, intake = shared
        mine, filler = dp.local_names(names)
        positions = dp.positions_in_view(self._store, mine, stop=self.stop_event,
                                         timeout_s=self.settings.data_timeout_s)
        return draw, (sampled, self._read_rows(positions, filler), names, intake), time.perf_counter() - start

    def _fresh_mask(self, batch) -> np.ndarray:
        """Which rows of ``batch`` are within ``max_staleness`` versions of the learner now: the
        version may have moved since the batch was sampled."""
        bound = self.settings.max_staleness
        if bound is None:
            return np.ones(batch.batch_size[0], dtype=bool)
        return (batch["policy_version"] >= self.progress.policy_version - bound).numpy()

    @staticmethod
    def _drop_stale(batch, fresh: np.ndarray):
        """``batch`` without the rows ``fresh`` rejects (None when none is left), and their count."""
        if fresh.all():
            return batch, 0
        if not fresh.any():
            return None, int(fresh.size)
        return take_rows(batch, torch.from_numpy(np.flatnonzero(fresh))), int((~fresh).sum())

    @property
    def _feedback(self) -> bool:
        return self.settings.priority_feedback != "none"

    def _drop_stale_on_every_rank(self, batch, fresh: np.ndarray):
        """:meth:`_drop_stale` over all data-parallel ranks: stale rows counted globally, the step
        skipped only when no rank has a row left, a rank with none left trains on a filler. Also
        returns the freshness of every row of the global draw, in draw order."""
        dp = self.data_parallel
        if not dp.enabled:
            return (*self._drop_stale(batch, fresh), fresh)
        filler = dp.is_filler(batch)
        if filler:
            fresh = np.ones_like(fresh)  # a filler's row is never counted, stale or not
        kept, stale = self._drop_stale(batch, fresh)
        stale, left = dp.sum_counts(stale, 0 if kept is None or filler else kept.batch_size[0])
        fresh_everywhere = dp.gather_flags(fresh[:0] if filler else fresh)
        if left == 0:
            return None, int(stale), fresh_everywhere
        if kept is None:
            kept = dp.mark_filler(take_rows(batch, torch.arange(1)), True)
        return kept, int(stale), fresh_everywhere

    def _train_step(self, batch) -> tuple[dict[str, float], torch.Tensor | None]:
        """One optimizer step on ``batch``: its metrics, and each row's priority feedback (None when off)."""
        s = self.settings
        dp = self.data_parallel
        batch = batch.to(self.device, non_blocking=True)
        filler = dp.is_filler(batch)  # a rank with no rows of its own this step: weight 0
        response_mask = batch["masks", "response"]
        # the whole step's counts, over every data-parallel rank: weights are shares of the global batch
        total_tokens, total_rows, attention_tokens = (int(n) for n in dp.sum_counts(
            0 if filler else int(response_mask.sum()), 0 if filler else batch.batch_size[0],
            0 if filler else int(batch["masks", "all_attention_mask"].sum())))
        token_mean = aggregates_by_token(s.loss)
        loss_options = dataclasses.asdict(s.loss)
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        feedback_kind = s.priority_feedback if self._feedback else None
        row_feedback = torch.zeros(batch.batch_size[0]) if feedback_kind else None  # (B,) in batch order
        micro_batches = split_microbatches_with_rows(batch, s.micro_batch_tokens)
        count = dp.micro_batch_count(len(micro_batches))  # FSDP: as many on every rank
        for i in range(count):
            repeat = i >= len(micro_batches)  # only to take part in FSDP's gathers: weight 0
            rows, micro = micro_batches[min(i, len(micro_batches) - 1)]
            micro_tokens = int(micro["masks", "response"].sum())
            weight = micro_tokens / max(total_tokens, 1) if token_mean else micro.batch_size[0] / total_rows
            weight = 0.0 if filler or repeat else weight
            with dp.sync_unless(self.train_model, accumulating=i < count - 1), self._autocast():
                loss, stats = grpo_step_loss(self.train_model, micro, temperature=s.temperature,
                                             row_feedback=feedback_kind, **loss_options)
                (loss * (weight * dp.loss_scale)).backward()
            if row_feedback is not None and not repeat:
                row_feedback[rows] = stats.pop("row_feedback").float().cpu()
            for key, value in stats.items():
                sums[key] = sums.get(key, 0.0) + float(value) * weight
        sums = dp.sum_metrics(sums)
        clip = s.max_grad_norm if s.max_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor, the same on every rank
            grad_norm = grad_norm.full_tensor()
        lr_used = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.progress.rows_used += total_rows
        self.progress.tokens_seen += total_tokens

        cpu = dp.gather_rows(batch.to("cpu"))  # every rank's rows, for the batch charts
        staleness = (self.progress.policy_version - cpu["policy_version"]).float()
        row_versions = cpu["policy_version"]  # the versions that sampled the rows: how off-policy the batch is
        metrics = {f"losses/{k}": v for k, v in sums.items()}
        metrics["losses/grad_norm"] = float(grad_norm)
        metrics.update(group_reward_stats(cpu["next", "reward"].reshape(-1), cpu["group_id"]))
        if "sequence_advantage" in cpu.keys():
            adv = cpu["sequence_advantage"]
            metrics["charts/advantage_mean"] = float(adv.mean())
            metrics["charts/advantage_std"] = float(adv.std()) if adv.numel() > 1 else 0.0
        # ids carry their collector's index in the high bits: how many collectors fed this batch
        metrics["charts/collectors_in_batch"] = float(torch.unique(collector_index_of(cpu["group_id"])).numel())
        if "sample_weight" in cpu.keys():
            metrics["charts/importance_weight_mean"] = float(cpu["sample_weight"].mean())
            metrics["charts/importance_weight_min"] = float(cpu["sample_weight"].min())
        lengths = cpu["response_lengths"].float()
        metrics.update({
            "charts/response_length_mean": float(lengths.mean()),
            "charts/response_length_max": float(lengths.max()),
            "charts/staleness_mean": float(staleness.mean()),
            "charts/staleness_max": float(staleness.max()),
            "charts/row_version_min": float(row_versions.min()),
            "charts/row_version_max": float(row_versions.max()),
            "charts/row_version_spread": float(row_versions.max() - row_versions.min()),
            **staleness_metrics(staleness),  # mean and max again, median, p90, fraction 0 / 1 / 2 / 3+ stale
            "charts/learning_rate": lr_used,
            "charts/rows": float(total_rows),
            "_tokens": float(attention_tokens),
        })
        return metrics, row_feedback

    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _publish(self) -> None:
        from rlhf_pipeline.coordination.weights import latest_version, publish_weights

        # a crash after a publish but before its checkpoint leaves a newer file: never reuse its number
        dp = self.data_parallel
        published = latest_version(self.paths.root) if dp.is_main else None
        version = dp.from_main(max(self.progress.policy_version, published if published is not None else -1) + 1)
        state = dp.model_state(self.model)  # whole, on rank 0 (FSDP gathers it from every rank)
        if dp.is_main:  # rank 0 writes the weights
            publish_weights(self.paths.root, state, version)
        self.progress.policy_version = version
        self.sampler.current_version = version

    # ================================================================== checkpoint
    def save_checkpoint(self) -> None:
        # whole model and optimizer states, so a checkpoint resumes with any ranks and parallelism
        # (under FSDP every rank takes part in gathering them to rank 0)
        model_state = self.data_parallel.model_state(self.model)
        optimizer_state = self.data_parallel.optimizer_state(self.model, self.optimizer)
        if not self.data_parallel.is_main:  # one checkpoint per run, written by rank 0
            return
        state = {
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": self.scheduler.state_dict(),
            "rng": capture_rng_state(),
            "buffer": self._store.state_dict() if self._store is not None else None,
            # with priority feedback: plus the feedback given since that draw (not in its state yet)
            "sampler": self.sampler.with_feedback(self._sampler_state) if self._feedback else self._sampler_state,
            "trained_rows": self._trained.state_dict(),
            "intake": self._pacing.intake.to_json(),
        }
        self.checkpoints.save(self.progress, state)

    # ================================================================== cleanup
    def cleanup(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None
        if self._display is not None:
            self._display.close()
        if self._metrics is not None:
            self._metrics.close()
        if self._store is not None:
            self._store.close()
            self._store = None
