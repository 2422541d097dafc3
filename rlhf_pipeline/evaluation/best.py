"""Which evaluation summaries ``learner.keep_best`` may rank checkpoints by, checked at launch.

The best checkpoint itself is the checkpoint manager's business (``learn/checkpoint.py``: it reads the
evaluator's summaries and keeps the highest-scoring checkpoint); here only the names: a summary of
one of the run's evaluations in which higher is better, ``eval/<evaluation>/pass@1``,
``eval/<evaluation>/pass@<k>`` (k > 1 samples) or ``eval/<evaluation>/mean_score``.
Design: docs/evaluation.md#the-best-checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence

from rlhf_pipeline.evaluation.evaluator import evaluation_name
from rlhf_pipeline.evaluation.sets import EvalSet
from rlhf_pipeline.evaluation.settings import EvalSettings


def ranking_metrics(sets: Sequence[EvalSet], settings: EvalSettings) -> list[str]:
    """The summaries of the evaluations ``settings`` make of ``sets`` that a checkpoint can be ranked by."""
    k = settings.samples
    stats = ["pass@1", *([f"pass@{k}"] if k > 1 else []), "mean_score"]
    return [f"eval/{evaluation_name(s, settings)}/{stat}" for s in sets for stat in stats]


def check_keep_best(metric: str, sets: Sequence[EvalSet], settings: EvalSettings) -> None:
    """ValueError in one line when ``metric`` (``learner.keep_best``) names no summary the run's
    evaluation beside training gives (``sets``: the pipeline's, checked; empty when evaluation is off)."""
    if not settings.enabled:
        raise ValueError(f"setting 'learner.keep_best' ({metric}) ranks checkpoints by the evaluation beside "
                         f"training, which is off (eval.every_steps=0): add --set eval.every_steps=N, or leave "
                         f"learner.keep_best at none")
    choices = ranking_metrics(sets, settings)
    if metric not in choices:
        raise ValueError(f"setting 'learner.keep_best' must be one of {choices} (the summaries of this run's "
                         f"evaluations), got {metric!r}")
