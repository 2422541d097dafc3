"""``learner.keep_best``: the rule by which the checkpoint manager keeps the best checkpoint by an
evaluation summary, read from the evaluator's files (``coordination/eval_pins.py``), and the best as
it names it (:class:`KeepBest`, :class:`BestCheckpoint`). How the best is chosen and why it survives
a crash: docs/evaluation.md#the-best-checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_pipeline.coordination.eval_pins import EvalPins, eval_scores
from rlhf_pipeline.files.atomic import json_object
from rlhf_pipeline.files.run_store import RunStore


@dataclass(frozen=True)
class BestCheckpoint:
    """The kept checkpoint whose policy version scores highest on ``learner.keep_best``'s metric."""

    step: int
    policy_version: int
    metric: str
    value: float
    location: Path | str

    def describe(self) -> str:
        return f"step {self.step} (policy version {self.policy_version}): {self.metric} {self.value:.4g}"

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "policy_version": self.policy_version, "metric": self.metric,
                "value": self.value, "location": str(self.location)}


class NoBestCheckpoint(LookupError):
    """A run that keeps no best checkpoint (yet); the message says why and what to do."""


@dataclass(frozen=True)
class EvalScores:
    """What the evaluator has said so far: ``settled_below`` (every version below it is scored or
    given up), read before ``scores`` (version -> its value of the metric): see ``eval_pins``."""

    scores: dict[int, float]
    settled_below: int


class KeepBest:
    """``learner.keep_best``: ``metric`` (``eval/<evaluation>/<summary>``), scored by the evaluator
    that ``pins`` describe, its summaries in the run's ``store``."""

    def __init__(self, metric: str, store: RunStore, pins: EvalPins) -> None:
        self.metric, self.store, self.pins = metric, store, pins

    def candidate(self, step: int) -> bool:
        """Whether ``step`` published a version the evaluator scores (its checkpoint may be the best)."""
        every = self.pins.publish_every
        return self.pins.every_steps > 0 and step > 0 and step % every == 0 and self.pins.wanted(step // every)

    def version_at(self, step: int) -> int:
        return step // self.pins.publish_every

    def look(self) -> EvalScores:
        settled = self.pins.pinned_from()  # first: a released version's score is logged already
        return EvalScores(eval_scores(self.store, self.metric), settled)


def recorded_keep_best(store: RunStore) -> KeepBest | None:
    """The ``learner.keep_best`` of the run at ``store``, from its ``settings.json`` and what its latest
    start changed (``settings_history.json``) (None: off, or no readable settings)."""
    from rlhf_pipeline.files.settings_history import NEWEST, settings_in_force
    from rlhf_pipeline.files.state_files import StateFileError

    settings = json_object(store.read("settings.json")) or {}
    try:
        settings = settings_in_force(store, settings, NEWEST)
    except StateFileError:  # a damaged history: settings.json's (inspect RUN says it is damaged)
        pass
    learner, evaluation = settings.get("learner") or {}, settings.get("eval") or {}
    metric = learner.get("keep_best") if isinstance(learner, dict) else None
    if not isinstance(metric, str) or not metric or not isinstance(evaluation, dict):
        return None
    try:
        pins = EvalPins(store, every_steps=int(evaluation.get("every_steps", 0)),
                        publish_every=max(1, int(learner.get("publish_every", 1))),
                        before_training=bool(evaluation.get("before_training", True)))
    except (TypeError, ValueError):
        return None
    return KeepBest(metric, store, pins)
