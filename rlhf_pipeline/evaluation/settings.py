"""How a run evaluates its policy on held-out sets while it trains: ``--set eval.every_steps=50``.

Importable without torch: ``RunSettings`` holds these as its ``eval`` group.
Design: docs/evaluation.md#settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from rlhf_pipeline.setting_checks import Bounds, check_fields


@dataclass
class EvalSettings:
    """Evaluation of published policy versions on the pipeline's held-out sets (docs/evaluation.md)."""

    every_steps: Annotated[int, Bounds(ge=0, why=" (0: off)")] = 0
    """Evaluate the policy version published at every this many learner steps, in a process of its
    own beside training (0: no evaluation during training; ``rlhf-pipeline eval RUN`` still can)."""
    before_training: bool = True
    """With every_steps > 0, evaluate the starting policy too (version 0, step 0)."""
    samples: Annotated[int, Bounds(ge=1)] = 1
    """Completions per held-out prompt (k): pass@1 and mean_score average over them, pass@k is the
    unbiased estimate that one of k passes. More than 1 needs temperature > 0."""
    temperature: Annotated[float, Bounds(ge=0, why=" (0: greedy)")] = 0.0
    """Sampling temperature of the evaluation (0: greedy, one completion per prompt)."""
    max_prompts: Annotated[int | None, Bounds(ge=1, why=" (all)")] = None
    """Prompts (or tasks) of each held-out set evaluated at most, its first ones (none: all)."""

    def __post_init__(self) -> None:
        check_fields(self, "eval.")
        if self.temperature == 0 and self.samples > 1:
            raise ValueError(f"setting 'eval.samples' is {self.samples}, but greedy decoding (eval.temperature=0) "
                             f"gives one completion per prompt: add --set eval.temperature=1.0, or set "
                             f"eval.samples=1")

    def suffix(self, set_size: int) -> str:
        """What an evaluation's name adds to the name of its set of ``set_size`` prompts (``held_out-k4-t1``):
        evaluations sampled otherwise than greedy on every prompt are other evaluations, kept in a store of
        their own. A ``max_prompts`` the set does not exceed scores every prompt, so it names nothing."""
        max_prompts = self.max_prompts if self.max_prompts is not None and self.max_prompts < set_size else None
        if self.samples == 1 and self.temperature == 0 and max_prompts is None:
            return ""
        return f"-k{self.samples}-t{self.temperature:g}" + (f"-n{max_prompts}" if max_prompts else "")

    @property
    def enabled(self) -> bool:
        """Evaluation runs beside training."""
        return self.every_steps > 0
