"""A learner's checkpoints: what one saves, and a learner resumed from one.

A resumed run loads model, optimizer, scheduler, RNG and progress and continues exactly as an
uninterrupted one would over the same data; the versions a killed learner published past that
checkpoint are taken back and published again under the same numbers (``coordination/weights.py``).
Checkpoints hold whole model and optimizer states, so a run resumes with any number of ranks and
either parallelism. Without a checkpoint the learner starts from the initial policy, weights
version 0 (kept until the first checkpoint holds the model). The files themselves (``Progress``,
the checkpoint manager) are :mod:`rlhf_pipeline.learn.checkpoint`'s.
"""

from __future__ import annotations

import sys
from typing import Any

from rlhf_pipeline.learn.checkpoint import Progress, buffer_rows, capture_rng_state
from rlhf_pipeline.learn.optimizer import apply_settings, make_optimizer
from rlhf_pipeline.learn.packed_attention import use_packed_attention


class LearnerCheckpoints:
    """Saving and resuming for :class:`~rlhf_pipeline.learn.learner.Learner`, which holds what they
    save and restore (model, optimizer, progress, sampler state, intake)."""

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
