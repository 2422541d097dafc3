"""The learner recipe: setup -> train -> save_checkpoint -> cleanup (torchtune-style).

This module is the recipe read top to bottom: setup, the training loop, publishing weights and
cleanup. What a checkpoint saves and how a learner resumes from one is in ``learn/resume.py``
(the class takes it from there); how a draw becomes a batch on the prefetch thread in
``learn/draw_reading.py``; the step, samplers, prefetch, staleness, trajectories and metrics are
modules of their own.

One learner step, as :meth:`Learner.train` runs it:

1. take the next draw: the positions the sampler chose (``learn/samplers/``) read on the prefetch
   thread (``learn/prefetch.py``), packed into micro-batches with ``packing`` (the default), else
   padded (``learn/draw_reading.py``); drop rows that went stale while they waited, more than
   ``max_staleness`` versions older than ours (``learn/stale_rows.py``, counted as
   ``charts/rows_dropped_stale``);
2. the optimizer step, top to bottom in ``learn/step.py``: micro-batches of at most
   ``micro_batch_tokens`` tokens (packed sequences of whole rows with ``packing``:
   ``learn/packed.py``; else padded), each loss weighted by its share of the batch,
   gradients accumulated, clipped, AdamW, LR schedule (linear warm-up, then constant or cosine
   decay); a step whose loss, gradients or new weights are not finite is refused
   (:class:`~rlhf_pipeline.learn.errors.NonFiniteStep`): the learner stops there, its newest
   checkpoint and published weights as they were;
3. every ``publish_every`` steps publish the weights as a new version
   (``coordination/weights.py``); write metrics (``learn/batch_charts.py``); every
   ``checkpoint_every`` steps (and on stop) save a checkpoint.

Data parallelism is a layer around this (``learn/distributed.py``, ``DataParallel``): it shares
rank 0's draw with every rank's prefetch thread, which reads its slice (``draw_producer``),
drops stale rows over all ranks (``drop_stale``) and plans the
step over the global batch (``plan_step``). With one rank each of those is the single-rank
function.

With ``priority_feedback`` (prioritized sampling) the loss also gives one value per row, and
after the step the learner hands them to the sampler for the rows it trained on
(``PrioritizedRowSampler.feed_back``, ``charts/priority_feedback_*``).

Multi-turn rows train as whole trajectories, one sequence each (``learn/trajectories.py``, read
as ``learn/draw_reading.py`` says); a draw that ends none trains no step. Rows (or
trajectories) that ended for one of ``mask_termination_reasons`` are left out of the step like
stale ones (``charts/trajectories_masked``).

After taking each batch the learner publishes what it has taken in from each shard
(``<run>/pacing.json``), so collectors generate no more than it will train on
(:mod:`rlhf_pipeline.coordination.pacing`; a replay, which has no collectors, writes none); it counts the distinct rows it trained on against the rows
generated, and logs how stale they were (``learn/usage.py``).

On CUDA the forward runs under bf16 autocast, batches (with packing: the packed micro-batches)
are pinned by the prefetch thread and copied with ``non_blocking=True``. A resumed run continues
exactly as an uninterrupted one would over the same data (``learn/resume.py``).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from rlhf_pipeline.learn.checkpoint import restore_rng_state, run_checkpoints
from rlhf_pipeline.learn.distributed import DataParallel
from rlhf_pipeline.learn.draw_reading import draw_readers
from rlhf_pipeline.learn.errors import NonFiniteStep
from rlhf_pipeline.learn.batch_charts import batch_charts, run_charts
from rlhf_pipeline.learn.metrics import MetricsWriter, ProgressDisplay, truncate_metrics
from rlhf_pipeline.learn.prefetch import Prefetcher
from rlhf_pipeline.learn.resume import LearnerCheckpoints
from rlhf_pipeline.learn.samplers import make_sampler
from rlhf_pipeline.learn.settings import LearnerSettings
from rlhf_pipeline.learn.shard_rows import next_rows
from rlhf_pipeline.learn.stale_rows import DrawVersions, fresh_mask
from rlhf_pipeline.learn.step import mean_one, train_step
from rlhf_pipeline.learn.trajectories import masked_by_reason, termination_codes
from rlhf_pipeline.learn.usage import TrainedRows
from rlhf_pipeline.learn.waiting import WaitReport
from rlhf_pipeline.coordination.pacing import LearnerIntake, PacingPublisher
from rlhf_pipeline.files.run_paths import RunPaths


class Learner(LearnerCheckpoints):
    """Trains the policy on batches sampled from a run's buffer; publishes weights."""

    def __init__(self, settings: LearnerSettings, paths: RunPaths, *, make_model: Callable[[], torch.nn.Module],
                 steps: int, seed: int = 0, device: str = "cpu", pad_token_id: int = 0,
                 stop_event: threading.Event | None = None, show_progress: bool = True,
                 buffer: str | None = None, batch_transform: Callable[[torch.Tensor, Any], Any] | None = None,
                 on_step: Callable[[int, Any, Any, dict[str, float]], None] | None = None,
                 before_checkpoint: Callable[[], None] | None = None,
                 data_parallel: DataParallel | None = None,
                 initial_policy: torch.nn.Module | None = None, publish_pacing: bool = True,
                 checkpoint_of_another_buffer: bool = False) -> None:
        """``buffer``: the store to read (a path or URL ``open_buffer`` opens) instead of the run's
        own ``buffer/`` (replay); ``batch_transform(positions, padded_batch) -> padded_batch`` runs on
        the prefetch thread after each read (replay's re-scoring); ``on_step(step, sampled, batch,
        metrics)`` runs after each step, before its metrics are written, and may add metrics;
        ``before_checkpoint()`` runs on rank 0 before each checkpoint is saved (replay uploads its
        batch log there: a resume redoes no step the checkpoint covers, so its lines must be kept).
        ``data_parallel``: this process's rank among data-parallel learners (``learn/distributed.py``;
        its process group already started); ``batch`` in ``batch_transform``/``on_step`` is then the
        rank's own slice. ``initial_policy``: the model this process just built and published as
        weights version 0 (``make_policy()``); a learner without a checkpoint trains it as it is
        instead of building ``make_model()`` and reading version 0 back (a second full model load),
        a resumed one ignores it and loads its checkpoint. ``publish_pacing=False``: no collector
        feeds ``buffer`` (replay), so ``pacing.json`` is not written; checkpoints keep the intake.
        ``checkpoint_of_another_buffer``: the checkpoint resumed from saw another buffer than ``buffer``
        (a branch replayed over its parent's rows, ``runs/branch.py``), so its rows are not checked
        against ``buffer``."""
        self.settings = settings
        self.paths = paths
        self.make_model = make_model
        self._initial_policy = initial_policy
        self._checkpoint_of_another_buffer = checkpoint_of_another_buffer
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
        self.before_checkpoint = before_checkpoint
        self.checkpoints = run_checkpoints(paths, keep_last=settings.keep_checkpoints,
                                           keep_every=settings.checkpoint_keep_every)
        self._prefetcher: Prefetcher | None = None
        self._ready = False
        self._saved_a_checkpoint = False  # a checkpoint holds the model: until one does, version 0 is kept
        self._store = None
        self._metrics: MetricsWriter | None = None
        self._display: ProgressDisplay | None = None
        pacing, store = paths.state_object(paths.pacing)
        self._pacing = PacingPublisher(pacing, store=store, write=publish_pacing)
        self._trained = TrainedRows()
        self._draw_versions = DrawVersions(self.stop_event)  # what each draw's staleness is checked against
        self._masked_codes = termination_codes(settings.mask_termination_reasons)  # (k,) int32

    @classmethod
    def from_pipeline(cls, pipeline, paths: RunPaths, stop_event: threading.Event | None = None,
                      data_parallel: DataParallel | None = None,
                      initial_policy: torch.nn.Module | None = None) -> Learner:
        s = pipeline.settings
        return cls(pipeline.learner, paths, make_model=pipeline.make_model, steps=s.steps,
                   seed=getattr(s, "seed", 0), device=s.device, pad_token_id=pipeline.pad_token_id,
                   stop_event=stop_event, data_parallel=data_parallel, initial_policy=initial_policy)

    # ================================================================== setup
    def setup(self) -> None:
        torch.manual_seed(self.seed)
        checkpoint = self._load_checkpoint()
        self._saved_a_checkpoint = checkpoint is not None
        if self.data_parallel.is_main:
            self._retract_versions_past_checkpoint(checkpoint)
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
        intake.waiting_since = intake.waiting_seen = intake.lacking = None  # a wait from before the stop is over
        intake.last_step = self.progress.step >= self.total_steps  # resumed with more --steps: it draws on
        intake.policy_version = self.progress.policy_version
        self._pacing.intake = intake
        if not self.data_parallel.is_main:  # only rank 0 writes files
            return
        self._pacing.publish(intake, new_draw=not saved)
        metrics, store = self.paths.state_object(self.paths.metrics)
        truncate_metrics(metrics, self.progress.step, store=store)
        self._metrics = MetricsWriter(metrics, self.paths.tensorboard, store=store,
                                      resumed_after=self.progress.step if checkpoint is not None else None)
        if self.show_progress:
            # epoch replays train on another run's rows: their staleness means nothing, the ratio does
            keys = ProgressDisplay.OFF_POLICY_KEYS if self.settings.sampler == "epoch" else ProgressDisplay.KEYS
            self._display = ProgressDisplay(self.total_steps, self.progress.step, self.settings.log_every, keys=keys)

    def _setup_data(self, checkpoint: dict[str, Any] | None) -> None:
        # one store, or the union of the collectors' shards (new shards are picked up as they appear);
        # the rows the checkpoint saw must still be there. Several ranks over a buffer at a URL: rank 0
        # alone lists it and reads the records, the others open their readers from those
        saw = None if checkpoint is None or self._checkpoint_of_another_buffer else checkpoint["buffer"]
        self._store = self.data_parallel.open_buffer(self.buffer, saw)
        self.sampler = make_sampler(self.settings, self._store, seed=self.seed, stop=self.stop_event)
        # the state after the last draw a step used (draws run ahead on the prefetch thread)
        self._sampler_state = self.sampler.state_dict()
        if checkpoint is not None and not self._checkpoint_of_another_buffer:  # (positions in another buffer)
            # checkpoints from before learner samplers kept the window sampler's state in Progress
            self._sampler_state = checkpoint.get("sampler") or {"min_next_row": self.progress.min_next_row}
            try:
                self.sampler.load_state_dict(self._sampler_state)
            except KeyError:  # learner.* may change on resume, the sampler too: it starts afresh
                print(f"[learner] the checkpoint's sampler state is another sampler's; "
                      f"{self.settings.sampler!r} starts from the buffer as it is now", file=sys.stderr, flush=True)
                self._sampler_state = self.sampler.state_dict()
        self._draw_versions.expect(self.progress.draws, self.progress.policy_version)
        produce, read_slice = draw_readers(self._store, self.sampler, self.settings, self.data_parallel,
                                           device=self.device, pad_token_id=self.pad_token_id,
                                           batch_transform=self.batch_transform, masked_codes=self._masked_codes,
                                           draw_versions=self._draw_versions)
        # every rank prefetches: rank 0 draws and shares each draw, the others read their slice of it
        # (learn/distributed.py, DataParallel.draw_producer); with one rank produce is as named
        self.data_parallel.open_draw_channel()
        produce_draw, on_exit = self.data_parallel.draw_producer(
            produce, read_slice=read_slice, store=self._store, stop=self.stop_event,
            timeout_s=self.settings.data_timeout_s)
        self._prefetcher = Prefetcher(produce_draw, self.progress.draws, depth=self.settings.prefetch_depth,
                                      stop=self.stop_event, on_exit=on_exit,
                                      keep_every_item=self.data_parallel.enabled)
        if self.data_parallel.is_main and hasattr(self.sampler, "hurry"):  # it polls for rows fast only while a step waits
            self.sampler.hurry = self._prefetcher.consumer_waiting
        self._ready = True

    # ================================================================== train
    def train(self, max_steps: int | None = None, *, checkpoint_when_paused: bool = True) -> bool:
        """Runs until ``steps``, a stop request, or ``max_steps`` more steps (then checkpoints,
        unless ``checkpoint_when_paused`` is False: a caller that trains a step at a time).

        Returns True when all ``steps`` were taken.
        """
        assert self._ready, "call setup() first"
        waited = 0.0
        until = self.total_steps if max_steps is None else min(self.total_steps, self.progress.step + max_steps)
        # rank 0 tells collectors it waits (pacing.json) and, past wait_report_s, says what for
        # a sampler that says what its draw lacks (exact.py) has the collectors write it, with no stall rule
        lacking = (lambda: self.sampler.lacking) if hasattr(self.sampler, "lacking") else None
        on_wait = (WaitReport(self._pacing, lambda: next_rows(self._store), self.settings.wait_report_s,
                              lacking=lacking)
                   if self.data_parallel.is_main else None)
        while self.progress.step < until and not self.data_parallel.any_rank(self.stop_event.is_set()):
            try:
                draw, (sampled, batch, names, intake), wait = self._prefetcher.next(on_wait=on_wait)
            except InterruptedError:
                break
            assert draw == self.progress.draws, (draw, self.progress.draws)
            waited += wait
            self.progress.draws += 1
            self.progress.buffer_next_row = sampled.buffer_next_row
            self._sampler_state = sampled.sampler_state
            if sampled.weights is not None:  # prioritized sampling: the loss weighs each row
                weights = mean_one(sampled.weights)  # over the global batch; this rank takes its rows'
                batch["sample_weight"], _ = self.data_parallel.local_positions(weights, sampled.rank_rows)
            intake.step, intake.draws = self.progress.step, self.progress.draws
            intake.policy_version = self.progress.policy_version  # what the rounds it allows use (pacing.py)
            if batch is None:  # multi-turn: no drawn row ended a trajectory (learn/trajectories.py)
                self._take_in(intake, trains=False)
                self._expect_next_draw(trains=False)
                if self._feedback:
                    self.sampler.feed_back(draw, torch.zeros(0, dtype=torch.int64), torch.zeros(0))
                continue
            # rows that went stale in the prefetch queue: dropped before the step (learn/stale_rows.py);
            # so are those whose trajectory ended for a masked reason: kept in the batch with a zero loss
            # mask they would still count in sequence_mean's and constant's number of rows
            fresh = fresh_mask(batch, self.progress.policy_version, self.settings.max_staleness)
            masked = masked_by_reason(batch, self._masked_codes).numpy() & fresh
            batch, stale_now, kept = self.data_parallel.drop_stale(batch, fresh & ~masked)
            masked_now = 0
            if self._masked_codes.numel():
                masked_now = int(self.data_parallel.sum_counts(int(masked.sum()))[0])
                stale_now -= masked_now
                self.progress.trajectories_masked += masked_now
            dropped = sampled.dropped_stale + stale_now
            self.progress.rows_dropped_stale += dropped
            self._take_in(intake, trains=batch is not None)
            self._expect_next_draw(trains=batch is not None)
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
            trained = names.select(kept)
            if sampled.trajectory_steps is not None:  # trajectories, named by their last rows: every turn trained
                # (the draw's steps, not the batch's: under data parallelism the batch is this rank's slice)
                trained = trained.with_earlier_turns(sampled.trajectory_steps.numpy()[kept])
            self._trained.mark(trained.by_shard())
            self.progress.step += 1
            if self.progress.step % self.settings.publish_every == 0:
                self._publish()
            elapsed = time.perf_counter() - t0
            metrics.update(run_charts(metrics.pop("_tokens"), elapsed, waited, dropped, sampled, self.progress,
                                      rows_trained=self._trained.count))
            waited = 0.0
            if self._masked_codes.numel():
                metrics["charts/trajectories_masked"] = float(masked_now)
                metrics["charts/trajectories_masked_total"] = float(self.progress.trajectories_masked)
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

    def _take_in(self, intake: LearnerIntake, trains: bool) -> None:
        """Publishes what this draw took in: collectors may now generate the rows the next draw
        needs. Only a draw that ``trains`` can be the run's last step (``last_step``: collectors
        then write no more rounds); one that does not is followed by another draw."""
        intake.last_step = trains and self.progress.step + 1 >= self.total_steps
        if self.data_parallel.is_main:
            self._pacing.publish(intake)
        else:
            self._pacing.intake = intake  # (what rank 0 checkpoints; kept alike on every rank)

    def _expect_next_draw(self, trains: bool) -> None:
        """Tells the prefetch thread the version the next draw trains with: this one's, plus the
        version this step publishes if it ``trains``."""
        publishes = trains and (self.progress.step + 1) % self.settings.publish_every == 0
        self._draw_versions.expect(self.progress.draws, self.progress.policy_version + int(publishes))

    @property
    def _feedback(self) -> bool:
        return self.settings.priority_feedback != "none"

    def _train_step(self, batch) -> tuple[dict[str, float], torch.Tensor | None]:
        """One optimizer step on ``batch`` (learn/step.py): its metrics, and each row's priority
        feedback (None when off). Under data parallelism ``batch`` is this rank's slice and the
        plan, the metrics and the charts are the whole step's."""
        dp = self.data_parallel
        on_host = batch  # (its per-row columns feed the charts: no copy back from the device)
        batch = batch.to(self.device, non_blocking=True)
        plan = dp.plan_step(batch, self.settings, self.train_model)
        try:
            outcome = train_step(self.model, self.optimizer, self.scheduler, plan, self.settings,
                                 forward_model=self.train_model, autocast=self._autocast)
        except NonFiniteStep as refused:  # raised before this step publishes or checkpoints anything
            raise refused.at(self.progress.step + 1, self.checkpoints.latest_step()) from None
        self.progress.rows_used += plan.rows
        self.progress.tokens_seen += plan.response_tokens
        metrics = {f"losses/{key}": value for key, value in outcome.losses.items()}
        metrics["losses/grad_norm"] = outcome.grad_norm
        metrics.update(batch_charts(dp.gather_rows(on_host.to("cpu")), self.progress.policy_version))
        metrics.update({
            "charts/learning_rate": outcome.learning_rate,
            "charts/rows": float(plan.rows),
            "_tokens": float(plan.attention_tokens),
        })
        return metrics, outcome.row_feedback

    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _publish(self) -> None:
        from rlhf_pipeline.coordination.weights import publish_weights

        # the uninterrupted run's number: what a killed learner published past its checkpoint was
        # taken back at setup (_retract_versions_past_checkpoint)
        dp = self.data_parallel
        version = self.progress.policy_version + 1
        state = dp.model_state(self.model)  # whole, on rank 0 (FSDP gathers it from every rank)
        if dp.is_main:  # rank 0 writes the weights
            # until a checkpoint holds the model, a restart starts again from the initial policy
            publish_weights(self.paths.store, state, version, keep_versions=() if self._saved_a_checkpoint else (0,))
        self.progress.policy_version = version

    # ================================================================== cleanup
    def cleanup(self) -> None:
        if self._prefetcher is not None:
            self.data_parallel.close_draws(self._prefetcher)
            self._prefetcher = None
        if self._display is not None:
            self._display.close()
        if self._metrics is not None:
            self._metrics.close()
        if self._store is not None:
            self._store.close()
            self._store = None
