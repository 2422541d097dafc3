"""The learner recipe, read top to bottom (torchtune-style): ``setup`` -> ``_setup_model`` /
``_setup_optimizer`` / ``_setup_data`` -> ``train`` -> ``save_checkpoint`` -> ``cleanup``.
:meth:`Learner.train` takes each draw from the prefetch thread (:class:`Prefetcher`, :func:`draw_readers`),
drops rows gone stale (:class:`DrawVersions`), runs the step (``learn/step.py``), publishes weights,
writes metrics (:func:`batch_charts`, :class:`TrainedRows`) and checkpoints; it publishes its intake in
``pacing.json`` and says what it waits for (:class:`WaitReport`). Data parallelism is a layer around it.
Why one file: this is the recipe; its setup, resume, prefetching and reporting change with the loop
they serve (what a checkpoint saves is what setup restores; what the prefetch thread hands over is what
the loop unpacks); the step, batch layout, loss, samplers, ranks and files live beside it.
Design: docs/learner.md#how-it-runs.
"""

from __future__ import annotations

import contextlib
import math
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from rlhf_pipeline.coordination.pacing import LearnerIntake, PacingPublisher
from rlhf_pipeline.coordination.branch_weights import HeldVersions, weights_for_branches
from rlhf_pipeline.coordination.weights import prune_versions
from rlhf_pipeline.files.run_paths import RunPaths
from rlhf_pipeline.learn.batch import PackedBatch, fresh_mask
from rlhf_pipeline.learn.checkpoint import Progress, buffer_rows, capture_rng_state, restore_rng_state, run_checkpoints
from rlhf_pipeline.learn.distributed import DataParallel
from rlhf_pipeline.learn.errors import NonFiniteStep
from rlhf_pipeline.learn.lora import LoraPolicy, check_resumable
from rlhf_pipeline.learn.metrics import MetricsWriter, ProgressDisplay, truncate_metrics
from rlhf_pipeline.learn.packed_attention import use_packed_attention
from rlhf_pipeline.learn.samplers import make_sampler
from rlhf_pipeline.learn.settings import LearnerSettings
from rlhf_pipeline.learn.shard_rows import next_rows, row_names
from rlhf_pipeline.learn.step import apply_settings, make_optimizer, mean_one, train_step
from rlhf_pipeline.learn.trajectories import (
    is_single_turn,
    joined_trajectory_draw,
    masked_by_reason,
    narrow_to_trajectory_ends,
    read_joined,
    read_trajectories,
    rows_are_single_turn,
    termination_codes,
    trajectory_draw,
    trajectory_ends,
)
from rlhf_pipeline.models.lora import base_model_of
from rlhf_pipeline.schema.ids import collector_index_of

STALENESS_BUCKETS = (0, 1, 2)  # fractions of rows exactly this stale, plus one for the rest


@dataclass(frozen=True)
class BufferSource:
    """The buffer a learner trains on when it is not its run's own ``buffer/`` (a replay's source)."""

    location: str
    """A path or URL ``open_buffer`` opens."""
    fed_by_collectors: bool = True
    """Collectors write it and pace themselves by this learner's ``pacing.json``. False (replay): no
    collector reads it, so it is not written; checkpoints keep the intake all the same."""
    checkpoint_saw_another: bool = False
    """The checkpoint resumed from saw another buffer than this one (a branch replayed over its
    parent's rows, ``runs/branch.py``): its rows are not checked against this buffer, and its
    sampler state (positions in the other buffer) is not loaded."""


class Learner:
    """Trains the policy on batches sampled from a run's buffer; publishes weights."""

    def __init__(self, settings: LearnerSettings, paths: RunPaths, *, make_model: Callable[[], torch.nn.Module],
                 steps: int, seed: int = 0, device: str = "cpu", pad_token_id: int = 0,
                 stop_event: threading.Event | None = None, show_progress: bool = True,
                 source: BufferSource | None = None, batch_transform: Callable[[torch.Tensor, Any], Any] | None = None,
                 on_step: Callable[[int, Any, Any, dict[str, float]], None] | None = None,
                 before_checkpoint: Callable[[], None] | None = None,
                 data_parallel: DataParallel | None = None, initial_policy: torch.nn.Module | None = None) -> None:
        """``source``: the buffer to train on instead of the run's own (:class:`BufferSource`);
        ``batch_transform(positions, padded_batch) -> padded_batch`` runs on the prefetch thread
        after each read (replay's re-scoring); ``on_step(step, sampled, batch, metrics)`` runs after
        each step, before its metrics are written, and may add metrics; ``before_checkpoint()`` runs
        on rank 0 before each checkpoint is saved (replay uploads its batch log there: a resume redoes
        no step the checkpoint covers, so its lines must be kept). ``data_parallel``: this process's
        rank among data-parallel learners (``learn/distributed.py``; its process group already
        started); ``batch`` in ``batch_transform``/``on_step`` is then the rank's own slice.
        ``initial_policy``: the model this process just built and published as weights version 0
        (``make_policy()``); a learner without a checkpoint trains it as it is instead of building
        ``make_model()`` and reading version 0 back (a second full model load), a resumed one
        ignores it and loads its checkpoint."""
        self.settings = settings
        self.paths = paths
        self.make_model = make_model
        self.keep_versions_for: Callable[[int], Sequence[int]] = lambda version: ()
        """Versions up to the one being published that are kept past the newest few (the evaluator's,
        ``coordination/eval_pins.py``)."""
        self._initial_policy = initial_policy
        self.source = source or BufferSource(paths.buffer_location)
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
        self._pacing = PacingPublisher(pacing, store=store, write=self.source.fed_by_collectors)
        self._draws_on_record: list[tuple[int, dict[str, int]]] = []  # past the checkpoint, taken again as recorded
        self._trained = TrainedRows()
        self._draw_versions = DrawVersions(self.stop_event)  # what each draw's staleness is checked against
        self._masked_codes = termination_codes(settings.mask_termination_reasons)  # (k,) int32
        self._lora: LoraPolicy | None = None  # learner.lora.rank > 0: the adapter trained on version 0
        self._publication: tuple[int, Any] | None = None  # (version, the adapter) rank 0 published last
        self._weights_listing: list[str] | None = None  # weights/ as rank 0's publishes left it (listed once)
        # rank 0 of a learner fed by collectors: what their branches need (weights_for_branches)
        self._held_versions = HeldVersions()
        self._rewind_records: list[dict[str, Any]] = []  # the kept checkpoints', oldest first

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
        self._lora = self._lora_policy()
        if checkpoint is not None:  # full weights, an adapter: as the checkpoint was made, or refused by name
            check_resumable(checkpoint, self.settings.lora, self.progress.step,
                            self._lora.base_digest if self._lora is not None else None)
        if self.data_parallel.is_main:
            self._retract_versions_past_checkpoint(checkpoint)
            self._read_rewind_records()
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
        intake.next_version = max(intake.next_version, intake.policy_version)  # a new learner's first draw: its own
        intake.taken_since_checkpoint = self._draws_on_record  # on record until taken in again (a second kill)
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

    def _retract_versions_past_checkpoint(self, checkpoint: dict[str, Any] | None) -> None:
        """Takes back what a learner killed without a checkpoint published after the one this learner
        resumes from (or after the initial policy): it retrains those steps and publishes them again
        under the uninterrupted run's numbers, which rows in the buffer carry. Numbered past them, those
        rows looked that much staler and collectors pinned rounds to versions never had here."""
        from rlhf_pipeline.coordination.weights import published_versions, retract_versions_after

        if checkpoint is None and 0 not in published_versions(self.paths.store):
            return  # an older run pruned its initial policy: it starts from the newest (_setup_model)
        retracted = retract_versions_after(self.paths.store, self.progress.policy_version)
        if retracted:
            where = f"the checkpoint of step {self.progress.step}" if checkpoint is not None else "the initial policy"
            print(f"[learner] weights versions {retracted[0]}-{retracted[-1]} were published after {where} by a "
                  f"learner stopped before its next checkpoint; taken back, this learner publishes them again as it "
                  f"retrains those steps", file=sys.stderr, flush=True)

    def _setup_model(self, checkpoint: dict[str, Any] | None) -> None:
        from rlhf_pipeline.coordination.weights import load_weights

        initial, self._initial_policy = self._initial_policy, None  # held no longer than setup
        if self._lora is not None:
            self._setup_lora_model(checkpoint, initial)
        elif checkpoint is None and initial is not None:
            # built and published as version 0 by this process: those weights, without a second load
            self.model = initial
            self.model.zero_grad(set_to_none=True)  # a warm start's last gradients
            self.progress.policy_version = 0
        else:
            self.model = self.make_model()
            if checkpoint is not None:
                self.model.load_state_dict(checkpoint["model"])
            else:
                try:  # the initial policy: version 0 (kept until the first checkpoint, _publish)
                    state, version = load_weights(self.paths.store, 0)
                except FileNotFoundError:  # pruned by an older version of this library
                    state, version = load_weights(self.paths.store)
                    if version > 0:
                        print(f"[learner] the initial policy (weights version 0) is gone; starting from version "
                              f"{version}, so this run does not train as an uninterrupted one would",
                              file=sys.stderr, flush=True)
                self.model.load_state_dict(state)
                self.progress.policy_version = version
        if self.settings.packing:  # attention that keeps each packed row to itself (learn/packed_attention.py)
            use_packed_attention(self.model if self._lora is None else base_model_of(self.model))
        self.model.to(self.device).train()
        self.train_model = self.data_parallel.wrap(self.model, self.device)  # what forward/backward run through

    def _lora_policy(self) -> LoraPolicy | None:
        """A LoRA run's adapter policy on its base, weights version 0 (learn/lora.py); None: full fine-tuning."""
        if not self.settings.lora.enabled:
            return None
        from rlhf_pipeline.coordination.weights import load_published

        try:
            base, _ = load_published(self.paths.store, 0)
        except FileNotFoundError:
            raise ValueError(f"learner.lora.rank={self.settings.lora.rank} trains an adapter on the run's weights "
                             f"version 0, which is not published under {self.paths.store.describe('weights')}") from None
        return LoraPolicy(self.settings.lora, base)

    def _setup_lora_model(self, checkpoint: dict[str, Any] | None, initial: torch.nn.Module | None) -> None:
        """The base (the initial policy this process built, else version 0) with the adapter: a fresh one,
        or the checkpoint's."""
        from rlhf_pipeline.coordination.weights import load_published, publish_weights, published_versions

        if checkpoint is None and initial is not None:
            model = initial
            model.zero_grad(set_to_none=True)
        else:
            model = self.make_model()
            model.load_state_dict(load_published(self.paths.store, 0)[0])
        self.model = self._lora.wrap(model)
        if checkpoint is None:
            self.progress.policy_version = 0
            return
        self._lora.load(self.model, checkpoint)
        version = self.progress.policy_version
        if version > 0 and version not in published_versions(self.paths.store) and self.data_parallel.is_main:
            # a branch of a step whose version its parent pruned (runs/branch.py copies only what is
            # published): the adapter, with this learner's canary, from the checkpoint that holds it
            publish_weights(self.paths.store, self._lora.publication(self.model, version), version,
                            keep_versions=self._versions_kept(version))

    def _setup_optimizer(self, checkpoint: dict[str, Any] | None) -> None:
        # FSDP's sharded DTensor parameters keep AdamW's default implementation, not the fused one
        fused = self.data_parallel.parallelism != "fsdp" or not self.data_parallel.enabled
        self.optimizer, self.scheduler = make_optimizer(self.model, self.settings, self.total_steps, fused=fused)
        if checkpoint is not None:
            self.data_parallel.load_optimizer_state(self.model, self.optimizer, checkpoint["optimizer"])
            self.scheduler.load_state_dict(checkpoint["scheduler"])
            (scheduled,), (base,) = self.scheduler.get_last_lr(), self.scheduler.base_lrs
            apply_settings(self.optimizer, self.scheduler, self.settings, self.total_steps)  # a changed lr applies
            (now,) = self.scheduler.get_last_lr()
            if (self.settings.lr_schedule == "cosine" and base == self.settings.lr and not math.isclose(now, scheduled)
                    and self.data_parallel.is_main):  # the cosine's span moved with --steps, not with learner.lr
                print(f"[learner] note: learner.lr_schedule=cosine decays to the run's last step, now "
                      f"{self.total_steps}: the learning rate of step {self.progress.step + 1} is {now:.3g} where the "
                      f"checkpoint's schedule had {scheduled:.3g}", file=sys.stderr, flush=True)


    def _setup_data(self, checkpoint: dict[str, Any] | None) -> None:
        # one store, or the union of the collectors' shards (new shards are picked up as they appear);
        # the rows the checkpoint saw must still be there. Several ranks over a buffer at a URL: rank 0
        # alone lists it and reads the records, the others open their readers from those
        saw = None if checkpoint is None or self.source.checkpoint_saw_another else checkpoint["buffer"]
        self._store = self.data_parallel.open_buffer(str(self.source.location), saw)
        self.sampler = make_sampler(self.settings, self._store, seed=self.seed, stop=self.stop_event)
        # the state after the last draw a step used (draws run ahead on the prefetch thread)
        self._sampler_state = self.sampler.state_dict()
        if checkpoint is not None and not self.source.checkpoint_saw_another:  # (positions in another buffer)
            # checkpoints from before learner samplers kept the window sampler's state in Progress
            self._sampler_state = checkpoint.get("sampler") or {"min_next_row": self.progress.min_next_row}
            try:
                self.sampler.load_state_dict(self._sampler_state)
            except KeyError:  # learner.* may change on resume, the sampler too: it starts afresh
                print(f"[learner] the checkpoint's sampler state is another sampler's; "
                      f"{self.settings.sampler!r} starts from the buffer as it is now", file=sys.stderr, flush=True)
                self._sampler_state = self.sampler.state_dict()
            else:
                self._retake_draws_past_checkpoint()
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

    def _retake_draws_past_checkpoint(self) -> None:
        """Has the sampler take in the draws again that the learner before this one (killed) took in past
        this checkpoint, as ``pacing.json`` records them: a sampler whose draws depend on what the shards
        held as it drew (``exact``, beside several collectors) takes the same rows again, so the versions
        published past the checkpoint are published again with the same weights. Only a record that goes
        on from this checkpoint's last draw: one of a later checkpoint (this one older) leaves draws out."""
        retake = getattr(self.sampler, "retake", None)
        if retake is None or not self.data_parallel.is_main or not self.source.fed_by_collectors:
            return
        before = self._pacing.published()
        taken = [(d, c) for d, c in (before.taken_since_checkpoint if before else []) if d > self.progress.draws]
        if [d for d, _ in taken] != list(range(self.progress.draws + 1, self.progress.draws + 1 + len(taken))):
            return
        retake({draws - 1: consumed for draws, consumed in taken})  # (by draw index: draws counts them)
        self._draws_on_record = taken

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
                              lacking=lacking, why_rows_held_wait=getattr(self.sampler, "why_rows_held_wait", None))
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
            # rows that went stale in the prefetch queue: dropped before the step (batch.drop_stale);
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
            if self.progress.step % self.settings.checkpoint_every == 0 or self.progress.step == self.total_steps \
                    or self.checkpoints.saves_at(self.progress.step):  # rewind points, keep_best's candidates
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
        intake.next_version = self._next_draw_version(trains)  # what max_lag=0 samples the next rows with
        if self.data_parallel.is_main:
            self._pacing.publish(intake)
        else:
            self._pacing.intake = intake  # (what rank 0 checkpoints; kept alike on every rank)

    def _expect_next_draw(self, trains: bool) -> None:
        """Tells the prefetch thread the version the next draw trains with."""
        self._draw_versions.expect(self.progress.draws, self._next_draw_version(trains))

    def _next_draw_version(self, trains: bool) -> int:
        """The version the draw after this one trains with: this one's, plus the version this step
        publishes if it ``trains``."""
        publishes = trains and (self.progress.step + 1) % self.settings.publish_every == 0
        return self.progress.policy_version + int(publishes)

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
        rows = (on_host.columns if isinstance(on_host, PackedBatch) else on_host.to("cpu")).copy()
        for column, values in zip(LOGPROB_DIFF_COLUMNS, outcome.row_logprob_diff.unbind(-1)):
            rows.set(column, values)
        metrics.update(batch_charts(dp.gather_rows(rows), self.progress.policy_version))
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
        from rlhf_pipeline.coordination.weights import WEIGHTS, publish_weights

        # the uninterrupted run's number: what a killed learner published past its checkpoint was
        # taken back at setup (_retract_versions_past_checkpoint)
        dp = self.data_parallel
        version = self.progress.policy_version + 1
        if self._lora is not None:  # the adapter alone, with this learner's canary under it; its base stays
            # (alike on every rank under DDP: rank 0's alone is written, its canary's forward run there only)
            state = self._lora.publication(self.model, version) if dp.is_main else None
            self._publication = (version, state)
        else:
            state = dp.model_state(self.model)  # whole, on rank 0 (FSDP gathers it from every rank)
            # what publication() hands on at this step: the live weights, or under FSDP the copy just
            # gathered, since publication() is asked on rank 0 alone and a gather needs every rank
            self._publication = (version, state if dp.sharded else None)
        if dp.is_main:  # rank 0 writes the weights
            if self._weights_listing is None:  # after setup's retraction: this learner alone changes it from here
                self._weights_listing = self.paths.store.list(WEIGHTS)
            publish_weights(self.paths.store, state, version, keep_versions=self._versions_kept(version),
                            listing=self._weights_listing)
        self.progress.policy_version = version

    def _versions_kept(self, newest: int) -> list[int]:
        """The versions up to ``newest`` kept beside the newest few: the base (an adapter run's for ever, else
        until a checkpoint holds the model: a restart starts from it), the evaluator's and what branches need."""
        base_kept = self._lora is not None or not self._saved_a_checkpoint
        return [*((0,) if base_kept else ()), *self.keep_versions_for(newest),
                *weights_for_branches(self._rewind_records, self._collectors_held(), newest)]

    def publication(self) -> dict[str, torch.Tensor]:
        """What rank 0 published as the current version, asked on rank 0 alone right after the step
        that published it (cluster/actors.py hands it to collectors): the live whole weights (copy them
        to keep them; under FSDP the copy gathered to publish them), or a LoRA run's adapter with its
        canary. A version published before this learner started is read from its file: a learner
        resumed from a checkpoint past that version's step (publish_every > 1) holds weights that
        trained on after it."""
        version = self.progress.policy_version
        if self._publication is None or self._publication[0] != version:
            from rlhf_pipeline.coordination.weights import load_published

            self._publication = (version, load_published(self.paths.store, version)[0])
        published = self._publication[1]
        return self.data_parallel.model_state(self.model) if published is None else published

    # ================================================================== checkpoint
    def save_checkpoint(self) -> None:
        # whole model and optimizer states, so a checkpoint resumes with any ranks and parallelism
        # (under FSDP every rank takes part in gathering them to rank 0)
        # a LoRA run's: the adapter and what it was made with (learn/lora.py); its base is version 0
        model_state = (self._lora.checkpoint_state(self.model) if self._lora is not None
                       else {"model": self.data_parallel.model_state(self.model)})
        optimizer_state = self.data_parallel.optimizer_state(self.model, self.optimizer)
        if not self.data_parallel.is_main:  # one checkpoint per run, written by rank 0
            return
        held = self._collectors_held()  # before the buffer's state: a refresh in between only moves that on
        self._pacing.intake.taken_since_checkpoint = []  # a learner resumed from this one draws on from it
        state = {
            **model_state,
            "optimizer": optimizer_state,
            "scheduler": self.scheduler.state_dict(),
            "rng": capture_rng_state(),
            "buffer": self._store.state_dict() if self._store is not None else None,
            # with priority feedback: plus the feedback given since that draw (not in its state yet)
            "sampler": self.sampler.with_feedback(self._sampler_state) if self._feedback else self._sampler_state,
            "trained_rows": self._trained.state_dict(),
            "intake": self._pacing.intake.to_json(),
        }
        if self._metrics is not None:  # a resumed run redoes no step before this one: its lines must be kept
            self._metrics.flush()
        if self.before_checkpoint is not None:
            self.before_checkpoint()
        # where the buffer stood, readable without torch: what `inspect` lists and `branch` limits a view to
        record = {"buffer_rows": buffer_rows(state["buffer"]), "consumed": dict(self._pacing.intake.consumed)}
        if self._lora is not None:  # a branch of this step needs version 0 too: the adapter's base
            record["lora_rank"] = self.settings.lora.rank
        if held:
            record["held_versions"] = {name: version for name, (_, version) in held.items()}
        self.checkpoints.save(self.progress, state, record=record)
        self._saved_a_checkpoint = True
        self._keep_rewind_record({**record, "step": self.progress.step, "policy_version": self.progress.policy_version})

    # ================================================================== the weights a branch needs
    def _collectors_held(self) -> dict[str, tuple[int, int]]:
        if not self.source.fed_by_collectors or self._store is None:
            return {}  # a replay's buffer holds another run's versions
        return self._held_versions(self._store)

    def _read_rewind_records(self) -> None:
        if self.source.fed_by_collectors:
            self._rewind_records = self.checkpoints.rewind_points()

    def _keep_rewind_record(self, record: dict[str, Any]) -> None:
        """After a checkpoint was saved with ``record`` (and older ones pruned): the versions only the
        checkpoints pruned kept go now, not at the next publish (a run's last checkpoint is followed by none)."""
        if not self.source.fed_by_collectors:
            return
        kept = self.checkpoints.steps()
        released = any(r["step"] not in kept for r in self._rewind_records)
        self._rewind_records = [r for r in self._rewind_records if r["step"] in kept and r["step"] != record["step"]]
        self._rewind_records.append(record)
        if released:
            prune_versions(self.paths.store, keep_versions=self._versions_kept(self.progress.policy_version),
                           listing=self._weights_listing)

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


# ====================================================================== the prefetch thread
def draw_readers(store, sampler, settings: LearnerSettings, data_parallel: DataParallel, *, device: torch.device,
                 pad_token_id: int, batch_transform: Callable[[torch.Tensor, Any], Any] | None,
                 masked_codes: torch.Tensor, draw_versions: DrawVersions
                 ) -> tuple[Callable[[int], tuple[Any, ...]], Callable[..., Any]]:
    """``(produce, read_slice)`` for ``DataParallel.draw_producer``: ``produce(draw)`` draws from
    ``sampler`` and reads the batch, returning ``(sampled, batch, row names, intake)``;
    ``read_slice(sampled, positions, filler)`` reads one rank's slice of a shared draw.
    ``masked_codes``: the termination reasons left out of the step (their reasons are read only then);
    ``draw_versions``: the version each draw's staleness is checked against (:class:`DrawVersions`)."""
    from rlhf_pipeline.schema.padding import PaddedCollator

    pin = device.type == "cuda"
    # int32 token and position ids: half their bytes, nothing widened (collate.py, "Index dtype")
    collator = PaddedCollator(pad_token_id=pad_token_id, pin_memory=pin and batch_transform is None,
                              index_dtype=torch.int32)
    packing = settings.packing
    # with packing the prefetch thread reads rows ragged and packs them (batch.PackedBatch); a
    # batch_transform edits padded batches, so then it reads padded, transforms, and packs after
    ragged = packing and batch_transform is None
    budget = settings.micro_batch_tokens
    pin_packed = pin and torch.cuda.is_available()

    def transformed(positions: torch.Tensor, batch):
        batch = batch_transform(positions, batch)
        if packing:  # the packed micro-batches are pinned, not the padded batch
            return PackedBatch.from_padded(batch, budget, pin=pin_packed)
        return batch.pin_memory() if pin and torch.cuda.is_available() else batch

    # single-turn rows carry no termination reason in the padded batch: read it only when asked to mask
    read_reasons = masked_codes.numel() > 0 and "termination_reason" in store.schema.field_names

    def finish(positions: torch.Tensor, batch, filler: bool = False):
        """A read batch as it trains: re-scored (named by ``positions``), marked filler or not."""
        if batch_transform is not None:
            batch = transformed(positions, batch)
        if data_parallel.enabled:
            batch = data_parallel.mark_filler(batch, filler)
        return batch

    def reasons(positions: torch.Tensor) -> torch.Tensor | None:
        if not read_reasons:
            return None
        return store.read(positions, fields=("termination_reason",))["termination_reason"]

    def with_reasons(positions: torch.Tensor, batch):
        if read_reasons:
            batch["termination_reason"] = reasons(positions)
        return batch

    def packed_rows(positions: torch.Tensor, stored=None) -> PackedBatch:
        """Single-turn rows at ``positions`` (``stored``: already read ragged), planned and packed."""
        stored = store.read_ragged(positions) if stored is None else stored
        return PackedBatch.from_stored(stored, budget, termination_reason=reasons(positions), pin=pin_packed)

    def read_slice(sampled, positions: torch.Tensor, filler: bool):
        """This rank's slice of a draw (``positions``): the rows as drawn, or, when rank 0
        narrowed the draw to trajectory ends, the slice's trajectories read whole (None when
        the draw ended none: every rank skips it)."""
        if sampled.trajectory_steps is None:
            if ragged:
                return finish(positions, packed_rows(positions), filler)
            return finish(positions, with_reasons(positions, collator.read(store, positions)), filler)
        if sampled.positions.numel() == 0:
            return None
        steps, _ = data_parallel.local_positions(sampled.trajectory_steps, sampled.rank_rows)
        if ragged:
            joined = read_joined(store, positions, steps, turn_advantage=settings.turn_advantage,
                                 turn_advantage_weight=settings.turn_advantage_weight)
            return finish(positions, PackedBatch.from_joined(joined, budget, pin=pin_packed), filler)
        joined = read_trajectories(store, positions, steps, pad_token_id=pad_token_id,
                                   turn_advantage=settings.turn_advantage,
                                   turn_advantage_weight=settings.turn_advantage_weight)
        if pin and batch_transform is None and torch.cuda.is_available():
            joined = joined.pin_memory()
        return finish(positions, joined, filler)

    def narrow_whole_draw(sampled):
        """Rank 0 alone sees the whole draw: from its rows' ``done`` and ``step`` it decides, as one
        rank would from the rows it read, whether they are multi-turn and which of them end a whole
        trajectory; every rank then trains its slice of those trajectories."""
        flags = store.read(sampled.positions, fields=("done", "step"))
        if rows_are_single_turn(flags["done"], flags["step"]):  # as drawn
            return sampled
        return narrow_to_trajectory_ends(sampled, trajectory_ends(store, sampled.positions,
                                                                  flags["done"], flags["step"]))

    def produce(draw: int):
        sampled = sampler.draw(draw)  # positions, read before the store refreshes again
        if data_parallel.enabled:
            sampled = data_parallel.order_by_rank(narrow_whole_draw(sampled), store)  # shard affinity
            positions, filler = data_parallel.local_positions(sampled.positions, sampled.rank_rows)
            return sampled, read_slice(sampled, positions, filler)
        if ragged:
            return produce_packed(sampled)
        batch = collator.read(store, sampled.positions)  # re-scored below, once it is known what trains
        if not is_single_turn(batch):  # multi-turn rows: the whole trajectories they end
            sampled, joined = trajectory_draw(store, sampled, batch, pad_token_id=pad_token_id,
                                              turn_advantage=settings.turn_advantage,
                                              turn_advantage_weight=settings.turn_advantage_weight,
                                              pin=pin and batch_transform is None)
            return sampled, None if joined is None else finish(sampled.positions, joined)  # named by last rows
        return sampled, finish(sampled.positions, with_reasons(sampled.positions, batch))

    def produce_packed(sampled):
        """One rank's draw with packing: read ragged, trajectories joined ragged, planned, packed."""
        stored = store.read_ragged(sampled.positions)
        if not rows_are_single_turn(stored["done"], stored["step"]):  # the whole trajectories they end
            sampled, joined = joined_trajectory_draw(store, sampled, stored["done"], stored["step"],
                                                     turn_advantage=settings.turn_advantage,
                                                     turn_advantage_weight=settings.turn_advantage_weight)
            if joined is None:
                return sampled, None
            return sampled, finish(sampled.positions, PackedBatch.from_joined(joined, budget, pin=pin_packed))
        return sampled, finish(sampled.positions, packed_rows(sampled.positions, stored))

    # what outlives the store's next refresh, taken right after the draw: each row's shard and
    # global id, and the rows taken in per shard
    default_need = settings.new_rows_per_step or settings.batch_size
    checks_staleness = getattr(sampler, "max_staleness", None) is not None

    def produce_named(draw: int):
        # the version this draw trains with, not the one held right now (DrawVersions)
        versions = draw_versions
        sampler.current_version = versions.wait(draw) if checks_staleness else versions.latest()
        sampled, batch = produce(draw)
        consumed = sampled.consumed if sampled.consumed is not None else next_rows(store)
        need = default_need if sampled.next_draw_rows is None else sampled.next_draw_rows
        return sampled, batch, row_names(store, sampled.positions), LearnerIntake(consumed=consumed,
                                                                                  next_draw_rows=need)

    return produce_named, read_slice


class DrawVersions:
    """The policy version each draw is trained with: set by the training thread (:meth:`expect`)
    when it has taken in the draw before, read by the prefetch thread before it draws (:meth:`wait`).

    Why: the sampler checks staleness as it makes the draw, on the prefetch thread, while the
    training thread publishes. The version the learner happened to hold at that moment depended on
    whether the rows came before or after the publish, so a resumed run (its collector had already
    written them) and a run under another load passed over other rows. A sampler that checks
    staleness makes draw ``d`` only once told (one draw of overlap with the step in progress)."""

    def __init__(self, stop: threading.Event, *, poll_s: float = 0.05) -> None:
        self._stop = stop
        self._poll_s = poll_s
        self._changed = threading.Condition()
        self._draw, self._version = -1, 0

    def expect(self, draw: int, version: int) -> None:
        """Draw ``draw`` trains with ``version`` (the draws before it are taken in)."""
        with self._changed:
            self._draw, self._version = draw, version
            self._changed.notify_all()

    def latest(self) -> int:
        """The version of the newest draw told, without waiting (a sampler that rejects no rows)."""
        with self._changed:
            return self._version

    def wait(self, draw: int) -> int:
        """The version draw ``draw`` trains with, once told; InterruptedError when stopped first."""
        with self._changed:
            while self._draw < draw:
                if self._stop.is_set():
                    raise InterruptedError("sampling stopped")
                self._changed.wait(self._poll_s)
            return self._version


class Prefetcher:
    """Runs ``produce(i)`` for ``i = start, start+1, ...`` in a thread, ``depth`` items ahead: the
    learner's draws (a sampler's draw + the read, :func:`draw_readers`), so the model does not wait
    on disk reads, padding or packing."""

    def __init__(self, produce: Callable[[int], Any], start_step: int, *, depth: int = 2,
                 stop: threading.Event | None = None, on_exit: Callable[[], None] | None = None,
                 keep_every_item: bool = False) -> None:
        self._produce = produce
        # run by the thread as it ends, however it ends (a data-parallel rank's last word to the
        # others, learn/distributed.py DataParallel.draw_producer)
        self._on_exit = on_exit
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = stop or threading.Event()
        # keep_every_item: a stop request neither ends the thread nor drops what it made; only close()
        # does. Data-parallel ranks: a draw rank 0 shared is trained by every rank or by none, so
        # whether a step happens is decided by what produce() gives (MainStopped), on every rank alike
        self._keep_every_item = keep_every_item
        self._closing = threading.Event() if keep_every_item else self._stop
        # set while the consumer waits for an item: a producer that polls for its input (a sampler
        # waiting for rows, rlhf_pipeline/coordination/polling.py) polls fast only then
        self.consumer_waiting = threading.Event()
        self._thread = threading.Thread(target=self._work, args=(start_step,), daemon=True,
                                        name="learner-prefetch")
        self._thread.start()

    def _work(self, step: int) -> None:
        try:
            self._loop(step)
        finally:
            if self._on_exit is not None:
                self._on_exit()

    def _loop(self, step: int) -> None:
        while not self._closing.is_set():
            try:
                item = (step, self._produce(step), None)
            except BaseException as exc:  # handed to the consumer, which re-raises it
                item = (step, None, exc)
            while not self._closing.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return
            step += 1

    def next(self, on_wait: Callable[[], None] | None = None) -> tuple[int, Any, float]:
        """``(i, item, seconds the caller waited for it)``; re-raises the producer's error.

        ``on_wait()`` is called every 0.1 s while nothing has come (the learner then tells
        collectors it is waiting, and renews that while it still is,
        ``rlhf_pipeline/coordination/pacing.py``). Raises InterruptedError once
        the stop event is set while nothing is queued: the producer drops what it was making
        when stopped, so waiting on could never end.
        """
        start = time.perf_counter()
        try:
            step, item, exc = self._queue.get_nowait()
        except queue.Empty:
            self.consumer_waiting.set()
            try:
                step, item, exc = self._wait(on_wait)
            finally:
                self.consumer_waiting.clear()
        waited = time.perf_counter() - start
        if exc is not None:
            raise exc
        return step, item, waited

    def _wait(self, on_wait: Callable[[], None] | None) -> tuple[int, Any, BaseException | None]:
        while True:
            try:
                return self._queue.get(timeout=0.1)
            except queue.Empty:
                if (self._stop.is_set() and not self._keep_every_item) or not self._thread.is_alive():
                    raise InterruptedError("prefetching stopped") from None
                if on_wait is not None:
                    on_wait()

    def close(self, timeout_s: float | None = None) -> None:
        """Stops the thread and waits for it to end; ``timeout_s``: at most that long (a thread still
        in a data-parallel broadcast whose other side failed is woken by destroying the process group)."""
        self._stop.set()
        self._closing.set()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        # drain so a producer blocked on a full queue sees the stop flag
        while self._thread.is_alive() and (deadline is None or time.monotonic() < deadline):
            try:
                self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.1)


# ====================================================================== what a step reports
def group_reward_stats(rewards: torch.Tensor, group_ids: torch.Tensor) -> dict[str, float]:
    """Mean/std of rewards and the fraction of groups whose rewards have zero spread."""
    rewards = rewards.float()
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    if n_groups:
        hi = torch.full((n_groups,), -torch.inf).scatter_reduce(0, inverse, rewards, "amax")
        lo = torch.full((n_groups,), torch.inf).scatter_reduce(0, inverse, rewards, "amin")
        counts = torch.bincount(inverse, minlength=n_groups)
        # a group seen through a single sampled row tells nothing about its spread
        multi = counts > 1
        zero = ((hi - lo).abs() < 1e-8) & multi
        frac_zero = float(zero.sum()) / max(int(multi.sum()), 1)
    else:
        frac_zero = 0.0
    return {
        "charts/reward_mean": float(rewards.mean()) if rewards.numel() else 0.0,
        "charts/reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "charts/frac_reward_zero_std": frac_zero,
    }


LOGPROB_DIFF_COLUMNS = ("_logprob_diff_sum", "_logprob_diff_max", "_logprob_diff_tokens")
"""Each trained row's ``row_logprob_diff`` (learn/loss.py), as columns gathered with the rows' others."""


def batch_charts(rows: TensorDict, policy_version: int) -> dict[str, float]:
    """``rows``: one value a row (every rank's rows under data parallelism, on the CPU), with the
    step's :data:`LOGPROB_DIFF_COLUMNS`; ``policy_version``: the learner's version when it trained on them."""
    staleness = (policy_version - rows["policy_version"]).float()
    row_versions = rows["policy_version"]  # the versions that sampled the rows: how off-policy the batch is
    charts = group_reward_stats(rows["next", "reward"].reshape(-1), rows["group_id"])
    if "sequence_advantage" in rows.keys():
        advantage = rows["sequence_advantage"]
        charts["charts/advantage_mean"] = float(advantage.mean())
        charts["charts/advantage_std"] = float(advantage.std()) if advantage.numel() > 1 else 0.0
    # ids carry their collector's index in the high bits: how many collectors fed this batch
    charts["charts/collectors_in_batch"] = float(torch.unique(collector_index_of(rows["group_id"])).numel())
    if "sample_weight" in rows.keys():
        charts["charts/importance_weight_mean"] = float(rows["sample_weight"].mean())
        charts["charts/importance_weight_min"] = float(rows["sample_weight"].min())
    lengths = rows["response_lengths"].float()
    charts.update({
        "charts/response_length_mean": float(lengths.mean()),
        "charts/response_length_max": float(lengths.max()),
        "charts/staleness_mean": float(staleness.mean()),
        "charts/staleness_max": float(staleness.max()),
        "charts/row_version_min": float(row_versions.min()),
        "charts/row_version_max": float(row_versions.max()),
        "charts/row_version_spread": float(row_versions.max() - row_versions.min()),
        **staleness_metrics(staleness),  # mean and max again, median, p90, fraction 0 / 1 / 2 / 3+ stale
    })
    if LOGPROB_DIFF_COLUMNS[0] in rows.keys():  # the step's own rows (a test's batch may have none)
        per_row = torch.stack([rows[column].float() for column in LOGPROB_DIFF_COLUMNS], dim=-1)
        charts.update(logprob_diff_by_staleness(staleness.reshape(-1), per_row))
    return charts


def run_charts(tokens: float, elapsed_s: float, waited_s: float, dropped: int, sampled, progress, *,
               rows_trained: int) -> dict[str, float]:
    """``tokens``: the step's prompt + response tokens; ``sampled``: its draw (``SampledRows``);
    ``progress``: the learner's ``Progress`` after the step; ``rows_trained``: distinct rows so far."""
    return {
        "charts/tokens_per_s": tokens / max(elapsed_s + waited_s, 1e-9),
        "charts/data_wait_s": waited_s,
        "charts/rows_dropped_stale": float(dropped),
        "charts/rows_dropped_stale_total": float(progress.rows_dropped_stale),
        "charts/policy_version": float(progress.policy_version),
        "charts/buffer_rows": float(sampled.buffer_rows),
        # waste: rows ever written to the buffer over the distinct rows trained on so far
        "charts/rows_generated": float(sampled.buffer_next_row),
        "charts/rows_trained": float(rows_trained),
        "charts/rows_generated_per_row_trained": sampled.buffer_next_row / max(rows_trained, 1),
        "charts/step_time_s": elapsed_s,
        **sampled.metrics,
    }


class TrainedRows:
    """Which stored rows have gone into a loss: a bitmap per shard over its global row ids.

    The waste a user paying for generation wants to see, ``charts/rows_generated_per_row_trained``:
    rows ever written over distinct rows trained (a row drawn twice counts once). One bit per stored
    row (by global id, ``learn/shard_rows.py``): exact, 1 MB per 8 million rows; checkpointed."""

    def __init__(self) -> None:
        self._bits: dict[str, np.ndarray] = {}  # shard key -> packed bits (uint8), bit i = global row i
        self.count = 0

    def mark(self, rows: dict[str, np.ndarray]) -> int:
        """Marks ``rows`` (shard key -> global ids) as trained on; returns how many were new."""
        new = 0
        for key, ids in rows.items():
            ids = np.unique(np.asarray(ids, dtype=np.int64))
            if not len(ids):
                continue
            bits = self._bits.get(key, np.zeros(0, dtype=np.uint8))
            needed = int(ids[-1]) // 8 + 1
            if needed > len(bits):
                grown = np.zeros(max(needed, 2 * len(bits)), dtype=np.uint8)
                grown[: len(bits)] = bits
                bits = grown
            byte, mask = ids // 8, (1 << (ids % 8)).astype(np.uint8)
            fresh = (bits[byte] & mask) == 0
            new += int(fresh.sum())
            np.bitwise_or.at(bits, byte, mask)
            self._bits[key] = bits
        self.count += new
        return new

    def state_dict(self) -> dict[str, Any]:
        # tensors, not arrays: checkpoints load with weights_only=True (state_files.py)
        return {"count": self.count, "bits": {key: torch.from_numpy(bits.copy()) for key, bits in self._bits.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = int(state["count"])
        self._bits = {str(key): np.array(bits, dtype=np.uint8) for key, bits in state["bits"].items()}


def staleness_metrics(staleness: torch.Tensor) -> dict[str, float]:
    """Distribution of per-row staleness (versions) in one step's batch."""
    values = staleness.to(torch.float32).reshape(-1)
    if not values.numel():
        return {}
    out = {
        "charts/staleness_mean": float(values.mean()),
        "charts/staleness_p50": float(values.quantile(0.5)),
        "charts/staleness_p90": float(values.quantile(0.9)),
        "charts/staleness_max": float(values.max()),
    }
    for name, in_bucket in staleness_buckets(values).items():
        out[f"charts/staleness_frac_{name}"] = float(in_bucket.float().mean())
    return out


def staleness_buckets(staleness: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{"0": mask, "1": mask, "2": mask, "3plus": mask}``: which rows are exactly that many versions
    behind the learner, and which more (:data:`STALENESS_BUCKETS`)."""
    buckets = {str(bucket): staleness == bucket for bucket in STALENESS_BUCKETS}
    buckets[f"{STALENESS_BUCKETS[-1] + 1}plus"] = staleness > STALENESS_BUCKETS[-1]
    return buckets


def logprob_diff_by_staleness(staleness: torch.Tensor, per_row: torch.Tensor) -> dict[str, float]:
    """``losses/sampler_logprob_diff_mean/staleness_<K>`` and ``_max/staleness_<K>``: the learner's
    recomputed log-probs against the stored ones over the tokens of the rows K versions behind it, for
    each bucket of :func:`staleness_buckets` that has tokens. ``staleness`` (B,); ``per_row`` (B, 3): the
    rows' ``row_logprob_diff`` (sum, max, tokens). Rows of staleness 0 show the engine's mismatch alone
    (what the served-policy canary bounds); older rows add the policy's drift since. Keyed by staleness,
    not by version, so that a run has at most eight of these series however long it trains."""
    charts = {}
    for name, in_bucket in staleness_buckets(staleness).items():
        rows = per_row[in_bucket]
        tokens = float(rows[:, 2].sum())
        if tokens:
            charts[f"losses/sampler_logprob_diff_mean/staleness_{name}"] = float(rows[:, 0].sum()) / tokens
            charts[f"losses/sampler_logprob_diff_max/staleness_{name}"] = float(rows[:, 1].max())
    return charts


class WaitReport:
    """The learner's ``on_wait`` (called every 0.1 s while it waits for a batch): renews the wait
    in ``pacing.json`` (``PacingPublisher.waiting``) and says what it waits for once it is long.

    A wait of up to ``data_timeout_s`` with nothing said looks like a hang, so past ``wait_report_s``
    it says in one line what the next draw needs and why it cannot have it yet (no row written at
    all: the collectors are starting; none since the wait began; or they write too slowly), then
    again each time the wait doubles.

    ``shard_rows()`` gives the rows each shard has published, as the learner's store last saw them;
    ``lacking()`` what the draw it waits for still lacks, from a sampler that says it
    (``LearnerIntake.lacking``; None: the collectors go by the stall rule); ``why_rows_held_wait()`` why
    rows held past the last draw's do not make it (stale ones passed over), from a sampler that says it."""

    def __init__(self, pacing: PacingPublisher, shard_rows: Callable[[], dict[str, int]], after_s: float,
                 say: Callable[[str], None] | None = None,
                 lacking: Callable[[], tuple[int, int, dict[str, int]]] | None = None,
                 why_rows_held_wait: Callable[[], str | None] | None = None) -> None:
        self.pacing = pacing
        self.shard_rows = shard_rows
        self.lacking = lacking
        self.why_rows_held_wait = why_rows_held_wait or (lambda: None)
        self.after_s = after_s
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self._wait: float | None = None  # waiting_since of the wait being reported
        self._next_at = 0.0
        self._rows_at_start: int | None = None

    def __call__(self) -> None:
        self.pacing.waiting(None if self.lacking is None else self.lacking())
        intake = self.pacing.intake
        since = intake.waiting_since
        if since is None:
            return
        if since != self._wait:  # a new wait
            self._wait, self._next_at = since, self.after_s
            self._rows_at_start = self._total_rows()
        waited = time.time() - since
        if waited >= self._next_at:
            self.say(self.line(waited))
            self._next_at = 2 * max(waited, self.after_s)

    def line(self, waited: float) -> str:
        intake = self.pacing.intake
        rows = self._rows() or {}
        held = {key: rows.get(key, 0) - intake.consumed.get(key, 0) for key in sorted(set(rows) | set(intake.consumed))}
        shards = ", ".join(f"{key}: {n}" for key, n in held.items()) or "no shard yet"
        if passed_over := self.why_rows_held_wait():  # e.g. a buffer recorded long before, or a learner far behind
            shards += f"; {passed_over}"
        total = sum(rows.values()) if rows else None
        if not total:  # nothing written at all: collectors still starting, not (yet) a collector that is gone
            why = ("no collector has written a row yet: they are starting (one with a generation engine of its own, "
                   "such as vLLM, writes its first round once the engine is up, tens of seconds; its log says when)")
        elif self._rows_at_start is None:
            why = "the collectors have not written them yet"
        elif total == self._rows_at_start:
            why = ("no collector has written a row since the wait began: is one running? its log says "
                   "what it waits for")
        else:
            why = f"collectors wrote {total - self._rows_at_start} rows since it began, too few so far"
        return (f"[learner] waiting {waited:.1f} s for the batch of step {intake.step + 1}: its next draw needs "
                f"{intake.next_draw_rows} new rows; the buffer holds {sum(held.values())} past the rows taken in "
                f"({shards}); {why} (it stops after learner.data_timeout_s)")

    def _rows(self) -> dict[str, int] | None:
        try:
            return self.shard_rows()
        except RuntimeError:  # the prefetch thread refreshed the shard list meanwhile: next call
            return None

    def _total_rows(self) -> int | None:
        rows = self._rows()
        return None if rows is None else sum(rows.values())
