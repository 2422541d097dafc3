"""The learner recipe: setup -> train -> save_checkpoint -> cleanup (torchtune-style).

Why one file: the recipe is one class read top to bottom, as torchtune's are; setup, the training
loop and checkpointing share its state (progress, sampler state, intake), and the pieces that
stand alone (the step, samplers, prefetch, staleness, trajectories, metrics) are modules already.

One learner step, as :meth:`Learner.train` runs it:

1. take the next draw: the positions the sampler chose (``learn/samplers/``) read on the prefetch
   thread (``learn/prefetch.py``): with ``packing`` (the default) read ragged and packed there into
   the step's micro-batches (``learn/packed_batch.py``: no padded batch at all), else read into a
   padded batch; drop rows that went stale while they waited, more than ``max_staleness``
   versions older than ours (``learn/stale_rows.py``, counted as ``charts/rows_dropped_stale``);
2. the optimizer step, top to bottom in ``learn/step.py``: micro-batches of at most
   ``micro_batch_tokens`` tokens (packed sequences of whole rows with ``packing``:
   ``learn/packed.py``; else padded), each loss weighted by its share of the batch,
   gradients accumulated, clipped, AdamW, LR schedule (linear warm-up, then constant or cosine
   decay);
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

Multi-turn rows train as whole trajectories, one sequence each (``learn/trajectories.py``): a
draw's rows that end a trajectory are read with their earlier turns on the prefetch thread and
joined (ragged, with packing), the loss mask 0 on the environment's tokens; a drawn row that
does not end its trajectory waits for the draw of its trajectory's last row. Single-turn draws are untouched. With several
data-parallel ranks rank 0 narrows the whole draw to the rows that end a trajectory, and each rank
reads its slice of those trajectories whole (``learn/distributed.py``). Rows (or
trajectories) that ended for one of ``mask_termination_reasons`` are left out of the step like
stale ones (``charts/trajectories_masked``).

After taking each batch the learner publishes what it has taken in from each shard
(``<run>/pacing.json``), so collectors generate no more than it will train on
(:mod:`rlhf_pipeline.coordination.pacing`; a replay, which has no collectors, writes none); it counts the distinct rows it trained on against the rows
generated, and logs how stale they were (``learn/usage.py``).

On CUDA the forward runs under bf16 autocast, batches (with packing: the packed micro-batches)
are pinned by the prefetch thread and copied with ``non_blocking=True``. A resumed run loads
model, optimizer, scheduler, RNG and progress and continues exactly as an uninterrupted one
would over the same data; the versions a killed learner published past that checkpoint are
taken back and published again under the same numbers (``coordination/weights.py``).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from rlhf_pipeline.learn.checkpoint import (
    Progress,
    buffer_rows,
    capture_rng_state,
    restore_rng_state,
    run_checkpoints,
)
from rlhf_pipeline.learn.distributed import DataParallel
from rlhf_pipeline.learn.batch_charts import batch_charts, run_charts
from rlhf_pipeline.learn.metrics import MetricsWriter, ProgressDisplay, truncate_metrics
from rlhf_pipeline.learn.prefetch import Prefetcher
from rlhf_pipeline.learn.samplers import make_sampler
from rlhf_pipeline.learn.settings import LearnerSettings
from rlhf_pipeline.learn.shard_rows import next_rows, row_names
from rlhf_pipeline.learn.optimizer import apply_settings, make_optimizer
from rlhf_pipeline.learn.packed_batch import PackedBatch
from rlhf_pipeline.learn.packed_attention import use_packed_attention
from rlhf_pipeline.learn.stale_rows import DrawVersions, fresh_mask
from rlhf_pipeline.learn.step import mean_one, train_step
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
from rlhf_pipeline.learn.usage import TrainedRows
from rlhf_pipeline.learn.waiting import WaitReport
from rlhf_pipeline.coordination.pacing import LearnerIntake, PacingPublisher
from rlhf_pipeline.files.run_paths import RunPaths


class Learner:
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
        settings.check()
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
        intake.waiting_since = intake.waiting_seen = None  # a wait from before the stop is over
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
        if checkpoint is None and initial is not None:
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
            use_packed_attention(self.model)
        self.model.to(self.device).train()
        self.train_model = self.data_parallel.wrap(self.model, self.device)  # what forward/backward run through

    def _setup_optimizer(self, checkpoint: dict[str, Any] | None) -> None:
        # FSDP's sharded DTensor parameters keep AdamW's default implementation, not the fused one
        fused = self.data_parallel.parallelism != "fsdp" or not self.data_parallel.enabled
        self.optimizer, self.scheduler = make_optimizer(self.model, self.settings, self.total_steps, fused=fused)
        if checkpoint is not None:
            self.data_parallel.load_optimizer_state(self.model, self.optimizer, checkpoint["optimizer"])
            self.scheduler.load_state_dict(checkpoint["scheduler"])
            apply_settings(self.optimizer, self.scheduler, self.settings, self.total_steps)  # a changed lr applies

    def _setup_data(self, checkpoint: dict[str, Any] | None) -> None:
        from rlhf_pipeline.schema.padding import PaddedCollator

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
        pin = self.device.type == "cuda"
        # int32 token and position ids: half their bytes, nothing widened (collate.py, "Index dtype")
        collator = PaddedCollator(pad_token_id=self.pad_token_id, pin_memory=pin and self.batch_transform is None,
                                  index_dtype=torch.int32)
        packing = self.settings.packing
        # with packing the prefetch thread reads rows ragged and packs them (learn/packed_batch.py); a
        # batch_transform edits padded batches, so then it reads padded, transforms, and packs after
        ragged = packing and self.batch_transform is None
        budget = self.settings.micro_batch_tokens
        pin_packed = pin and torch.cuda.is_available()

        def transformed(positions: torch.Tensor, batch):
            batch = self.batch_transform(positions, batch)
            if packing:  # the packed micro-batches are pinned, not the padded batch
                return PackedBatch.from_padded(batch, budget, pin=pin_packed)
            return batch.pin_memory() if pin and torch.cuda.is_available() else batch

        # single-turn rows carry no termination reason in the padded batch: read it only when asked to mask
        read_reasons = self._masked_codes.numel() > 0 and "termination_reason" in self._store.schema.field_names

        def finish(positions: torch.Tensor, batch, filler: bool = False):
            """A read batch as it trains: re-scored (named by ``positions``), marked filler or not."""
            if self.batch_transform is not None:
                batch = transformed(positions, batch)
            if self.data_parallel.enabled:
                batch = self.data_parallel.mark_filler(batch, filler)
            return batch

        def reasons(positions: torch.Tensor) -> torch.Tensor | None:
            if not read_reasons:
                return None
            return self._store.read(positions, fields=("termination_reason",))["termination_reason"]

        def with_reasons(positions: torch.Tensor, batch):
            if read_reasons:
                batch["termination_reason"] = reasons(positions)
            return batch

        def packed_rows(positions: torch.Tensor, stored=None) -> PackedBatch:
            """Single-turn rows at ``positions`` (``stored``: already read ragged), planned and packed."""
            stored = self._store.read_ragged(positions) if stored is None else stored
            return PackedBatch.from_stored(stored, budget, termination_reason=reasons(positions), pin=pin_packed)

        def read_slice(sampled, positions: torch.Tensor, filler: bool):
            """This rank's slice of a draw (``positions``): the rows as drawn, or, when rank 0
            narrowed the draw to trajectory ends, the slice's trajectories read whole (None when
            the draw ended none: every rank skips it)."""
            if sampled.trajectory_steps is None:
                if ragged:
                    return finish(positions, packed_rows(positions), filler)
                return finish(positions, with_reasons(positions, collator.read(self._store, positions)), filler)
            if sampled.positions.numel() == 0:
                return None
            steps, _ = self.data_parallel.local_positions(sampled.trajectory_steps, sampled.rank_rows)
            if ragged:
                joined = read_joined(self._store, positions, steps, turn_advantage=self.settings.turn_advantage,
                                     turn_advantage_weight=self.settings.turn_advantage_weight)
                return finish(positions, PackedBatch.from_joined(joined, budget, pin=pin_packed), filler)
            joined = read_trajectories(self._store, positions, steps, pad_token_id=self.pad_token_id,
                                       turn_advantage=self.settings.turn_advantage,
                                       turn_advantage_weight=self.settings.turn_advantage_weight)
            if pin and self.batch_transform is None and torch.cuda.is_available():
                joined = joined.pin_memory()
            return finish(positions, joined, filler)

        def narrow_whole_draw(sampled):
            """Rank 0 alone sees the whole draw: from its rows' ``done`` and ``step`` it decides, as one
            rank would from the rows it read, whether they are multi-turn and which of them end a whole
            trajectory; every rank then trains its slice of those trajectories."""
            flags = self._store.read(sampled.positions, fields=("done", "step"))
            if rows_are_single_turn(flags["done"], flags["step"]):  # as drawn
                return sampled
            return narrow_to_trajectory_ends(sampled, trajectory_ends(self._store, sampled.positions,
                                                                      flags["done"], flags["step"]))

        def produce(draw: int):
            sampled = self.sampler.draw(draw)  # positions, read before the store refreshes again
            if self.data_parallel.enabled:
                sampled = self.data_parallel.order_by_rank(narrow_whole_draw(sampled), self._store)  # shard affinity
                positions, filler = self.data_parallel.local_positions(sampled.positions, sampled.rank_rows)
                return sampled, read_slice(sampled, positions, filler)
            if ragged:
                return produce_packed(sampled)
            batch = collator.read(self._store, sampled.positions)  # re-scored below, once it is known what trains
            if not is_single_turn(batch):  # multi-turn rows: the whole trajectories they end
                sampled, joined = trajectory_draw(self._store, sampled, batch, pad_token_id=self.pad_token_id,
                                                  turn_advantage=self.settings.turn_advantage,
                                                  turn_advantage_weight=self.settings.turn_advantage_weight,
                                                  pin=pin and self.batch_transform is None)
                return sampled, None if joined is None else finish(sampled.positions, joined)  # named by last rows
            return sampled, finish(sampled.positions, with_reasons(sampled.positions, batch))

        def produce_packed(sampled):
            """One rank's draw with packing: read ragged, trajectories joined ragged, planned, packed."""
            stored = self._store.read_ragged(sampled.positions)
            if not rows_are_single_turn(stored["done"], stored["step"]):  # the whole trajectories they end
                sampled, joined = joined_trajectory_draw(self._store, sampled, stored["done"], stored["step"],
                                                         turn_advantage=self.settings.turn_advantage,
                                                         turn_advantage_weight=self.settings.turn_advantage_weight)
                if joined is None:
                    return sampled, None
                return sampled, finish(sampled.positions, PackedBatch.from_joined(joined, budget, pin=pin_packed))
            return sampled, finish(sampled.positions, packed_rows(sampled.positions, stored))

        # every rank prefetches: rank 0 draws and shares each draw, the others read their slice of it
        # (learn/distributed.py, DataParallel.draw_producer); with one rank produce is as named
        self.data_parallel.open_draw_channel()
        produce_draw, on_exit = self.data_parallel.draw_producer(
            self._naming_rows(produce), read_slice=read_slice, store=self._store, stop=self.stop_event,
            timeout_s=self.settings.data_timeout_s)
        self._prefetcher = Prefetcher(produce_draw, self.progress.draws, depth=self.settings.prefetch_depth,
                                      stop=self.stop_event, on_exit=on_exit,
                                      keep_every_item=self.data_parallel.enabled)
        if self.data_parallel.is_main and hasattr(self.sampler, "hurry"):  # it polls for rows fast only while a step waits
            self.sampler.hurry = self._prefetcher.consumer_waiting
        self._ready = True

    def _naming_rows(self, produce: Callable[[int], tuple[Any, Any]]) -> Callable[[int], tuple[Any, ...]]:
        """``produce`` plus what outlives the store's next refresh, taken on the prefetch thread
        right after the draw: each row's shard and global id, and the rows taken in per shard."""
        default_need = self.settings.new_rows_per_step or self.settings.batch_size
        checks_staleness = getattr(self.sampler, "max_staleness", None) is not None

        def produce_named(draw: int):
            # the version this draw trains with, not the one held right now (learn/stale_rows.py)
            versions = self._draw_versions
            self.sampler.current_version = versions.wait(draw) if checks_staleness else versions.latest()
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
        # rank 0 tells collectors it waits (pacing.json) and, past wait_report_s, says what for
        on_wait = (WaitReport(self._pacing, lambda: next_rows(self._store), self.settings.wait_report_s)
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
            if self.data_parallel.is_main:
                self._pacing.publish(intake)  # collectors may now generate the rows the next draw needs
            else:
                self._pacing.intake = intake  # (what rank 0 checkpoints; kept alike on every rank)
            if batch is None:  # multi-turn: no drawn row ended a trajectory (learn/trajectories.py)
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
        outcome = train_step(self.model, self.optimizer, self.scheduler, plan, self.settings,
                             forward_model=self.train_model, autocast=self._autocast)
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
        if self._metrics is not None:  # a resumed run redoes no step before this one: its lines must be kept
            self._metrics.flush()
        if self.before_checkpoint is not None:
            self.before_checkpoint()
        # where the buffer stood, readable without torch: what `inspect` lists and `branch` limits a view to
        record = {"buffer_rows": buffer_rows(state["buffer"]), "consumed": dict(self._pacing.intake.consumed)}
        self.checkpoints.save(self.progress, state, record=record)
        self._saved_a_checkpoint = True

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
