"""What a pipeline declares to be evaluated: named held-out sets (:class:`EvalSet`), each with its scorer.

A single-turn set holds prompts (``PromptRecord``: the chat or text, and the fields its scorer
reads, e.g. ``answer``); an agent set holds tasks and the environment an episode runs in. The scorer
is the task's own reward or a stricter verifier the training reward never sees; a completion (an
episode) *passes* when its score reaches ``pass_score``. The sets are drawn apart from the training
prompts (``pipelines/default.py``, ``pipelines/tool_use.py``). Design: docs/evaluation.md#held-out-sets.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
"""A set's name names its store (``<run>/eval/<name>``) and its metrics (``eval/<name>/pass@1``)."""

Scorer = Callable[..., Sequence[float]]
"""``scorer(prompts, completions, **fields) -> one score per completion``: a reward function's form
(``collect/rewards.py``); ``fields`` are the records' (each a list, one value per completion)."""


@dataclass(frozen=True)
class EvalSet:
    """One held-out set: ``prompts`` (single-turn) or ``tasks`` with ``make_env`` (agents), and its scorer."""

    name: str
    """Its name, in the store's location and the metric keys: letters, digits, ``_ . -``."""
    prompts: Sequence[Any] = ()
    """Single-turn: ``PromptRecord`` s (``render(tokenizer)``, ``fields``, ``display_text``)."""
    score: Scorer | None = None
    """Single-turn: the scorer (required). Agents: scores the episode's last model turn's text with
    the task's fields as the scorer's fields (None: the episode's return, its environment's rewards)."""
    max_new_tokens: int = 16
    """Single-turn: the longest completion."""
    tasks: Sequence[Mapping[str, Any]] = ()
    """Agents: the tasks (what the environment's ``reset`` reads)."""
    make_env: Callable[[], Any] | None = None
    """Agents: one episode's environment (``agents/environment.py``)."""
    limits: Any = None
    """Agents: ``agents.episode.EpisodeLimits`` (turns, tokens per turn, context)."""
    parser: Callable[[str], Any] | None = None
    """Agents: the tool-call parser of the model's turns (``agents.tools.parse_hermes``)."""
    pass_score: float = 1.0
    """A completion (episode) passes when its score is at least this."""

    def __post_init__(self) -> None:
        if not SET_NAME.match(self.name):
            raise ValueError(f"eval set name {self.name!r} must be letters, digits, '_', '.' or '-' (it names a "
                             f"directory and a metric), e.g. 'held_out'")
        if bool(self.prompts) == bool(self.tasks):
            raise ValueError(f"eval set {self.name!r} needs either prompts (single-turn) or tasks with make_env "
                             f"(agents), not {'both' if self.prompts else 'neither'}")
        if self.prompts and self.score is None:
            raise ValueError(f"eval set {self.name!r} has prompts but no score: give score=, e.g. the task's reward")
        if self.tasks and (self.make_env is None or self.limits is None):
            raise ValueError(f"eval set {self.name!r} has tasks: give make_env= (an episode's environment) and "
                             f"limits= (agents.episode.EpisodeLimits)")
        if self.max_new_tokens < 1:
            raise ValueError(f"eval set {self.name!r}: max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def agents(self) -> bool:
        """Its items are agent episodes (tasks), not single completions."""
        return bool(self.tasks)

    def items(self, max_prompts: int | None) -> Sequence[Any]:
        """Its prompts or tasks, the first ``max_prompts`` (None: all)."""
        items = self.tasks if self.agents else self.prompts
        return items if max_prompts is None else items[:max_prompts]


def check_sets(sets: Sequence[EvalSet] | None, otherwise: str = "") -> list[EvalSet]:
    """``sets`` (what the pipeline's ``eval_sets()`` returned; None: it declares none) as a list, refused
    (ValueError naming it) when there are none, two share a name or one is not an EvalSet. ``otherwise``:
    the caller's other way out of a pipeline that declares none (", or leave eval.every_steps at 0")."""
    if sets is None:
        raise ValueError("the pipeline declares no held-out sets to evaluate: give its Pipeline eval_sets= "
                         "(a function returning rlhf_pipeline.evaluation.sets.EvalSet objects; "
                         f"docs/evaluation.md){otherwise}")
    if not sets:
        raise ValueError("the pipeline's eval_sets() returned no held-out set with these settings, so there is "
                         "nothing to evaluate (its settings' documentation may say which hold none out)")
    seen: set[str] = set()
    for s in sets:
        if not isinstance(s, EvalSet):
            raise ValueError(f"Pipeline.eval_sets() must return EvalSet objects "
                             f"(rlhf_pipeline.evaluation.sets.EvalSet), got {type(s).__name__}")
        if s.name in seen:
            raise ValueError(f"two eval sets are named {s.name!r}; each set needs its own name")
        seen.add(s.name)
    return list(sets)
