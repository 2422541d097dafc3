"""Which published weights the learner keeps for the evaluator beside training.

The learner keeps its newest few versions and prunes the rest (``weights.publish_weights``); with
``eval.every_steps`` on it also keeps every version the evaluator wants (:func:`wanted_version`) from
the oldest it has not finished (:class:`EvalPins`), so a slow evaluator loses no version. The
evaluator's summaries are what ``learner.keep_best`` ranks checkpoints by (:func:`eval_scores`).
Design: docs/evaluation.md#evaluating-beside-training; the best: docs/evaluation.md#the-best-checkpoint.
"""

from __future__ import annotations

import json

from rlhf_pipeline.files.run_store import RunStore

PINNED_FROM = "eval/pinned_from.json"
EVAL_METRICS = "eval/metrics.jsonl"
"""The evaluator's summary lines, in the run's store (``evaluation.evaluator.eval_metrics_path``)."""


def wanted_version(version: int, *, every_steps: int, publish_every: int, before_training: bool) -> bool:
    """Whether the run evaluates ``version``, published at learner step ``version * publish_every``:
    the first version published at or after each multiple of ``every_steps`` (version 0, step 0,
    with ``before_training``)."""
    if version == 0:
        return before_training
    step, previous = version * publish_every, (version - 1) * publish_every
    return step // every_steps > previous // every_steps


class EvalPins:
    """The evaluator's claim on published versions, in the run's store (``eval/pinned_from.json``).

    The learner keeps every wanted version from :meth:`pinned_from` on (:meth:`keep`); the evaluator
    moves it up (:meth:`release_below`) as it finishes versions in order, and until it first does,
    every wanted version is kept: nothing it wants is pruned before it is done, whatever the two
    processes' speeds, and an evaluator that is not running keeps them for a later
    ``rlhf-pipeline eval RUN``. The evaluator logs a version's summary line before it releases the
    version, so a reader that looks at :meth:`pinned_from` first and the scores (:func:`eval_scores`)
    second never takes a released version for one still to be scored."""

    def __init__(self, store: RunStore, *, every_steps: int, publish_every: int, before_training: bool) -> None:
        self.store = store
        self.every_steps, self.publish_every, self.before_training = every_steps, publish_every, before_training

    def wanted(self, version: int) -> bool:
        return wanted_version(version, every_steps=self.every_steps, publish_every=self.publish_every,
                              before_training=self.before_training)

    def pinned_from(self) -> int:
        """The oldest version the evaluator may still need (0 until it has finished one)."""
        data = self.store.read(PINNED_FROM)
        try:
            return int(json.loads(data)["from"]) if data is not None else 0
        except (ValueError, KeyError, TypeError):  # damaged: keep everything it might want
            return 0

    def keep(self, newest: int) -> list[int]:
        """Learner side: the versions up to ``newest`` to keep for the evaluator."""
        start = self.pinned_from()
        return [v for v in range(start, newest + 1) if self.wanted(v)]

    def release_below(self, version: int) -> None:
        """Evaluator side: every wanted version below ``version`` is evaluated (or given up)."""
        self.store.write(PINNED_FROM, json.dumps({"from": int(version)}).encode())


def eval_scores(store: RunStore, metric: str) -> dict[int, float]:
    """Policy version -> its value of ``metric`` (``eval/<evaluation>/pass@1``) in the evaluator's
    summary lines of the run at ``store``: the file, or at a URL its numbered parts
    (``files/log_parts.py``). A line a kill cut short is skipped; a line logged twice (a kill between
    the line and the evaluator's publish) holds the same summary."""
    import math

    from rlhf_pipeline.files.log_parts import read_log_lines

    scores: dict[int, float] = {}
    for line in read_log_lines(store, EVAL_METRICS):
        try:
            record = json.loads(line)
            version, value = int(record["eval/policy_version"]), float(record[metric])
        except (ValueError, KeyError, TypeError):
            continue
        if math.isfinite(value):
            scores[version] = value
    return scores
