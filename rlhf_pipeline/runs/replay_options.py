"""What ``rlhf-pipeline replay`` takes besides the pipeline's own settings, and those options given
back as its flags: to the ranks a replay starts, and in the command ``branch`` prints.
Design: docs/replay.md#the-command.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from rlhf_pipeline.pipeline import PipelineError
from rlhf_pipeline.setting_checks import SEEDS


# options that mean something only with a --ref-model: the KL it recomputes
REFERENCE_ONLY = ("kl_estimator", "kl_coef")


@dataclasses.dataclass(frozen=True)
class ReplayOptions:
    """``replay``'s own flags, one field each (``--shuffle-window``: ``shuffle_window_rows``)."""

    buffer: str
    epochs: int | None = None
    steps: int | None = None
    order: str = "shuffle"
    seed: int | None = None
    init_from: str | None = None
    shuffle_window_rows: int | None = None
    ref_model: str | None = None
    kl_estimator: str = "k1"
    kl_coef: float = 0.05
    advantage_std: bool | None = None
    advantage_baseline: str | None = None

    @property
    def recompute_advantages(self) -> bool:
        return self.advantage_std is not None or self.advantage_baseline is not None

    def check(self) -> None:
        if self.epochs is not None and self.steps is not None:
            raise PipelineError("give --epochs or --steps, not both")
        if self.epochs is not None and self.epochs < 1:
            raise PipelineError(f"--epochs must be >= 1, got {self.epochs}")
        if self.steps is not None and self.steps < 1:
            raise PipelineError(f"--steps must be >= 1, got {self.steps}")
        if self.seed is not None and not SEEDS.allows(self.seed):
            raise PipelineError(f"--seed must be {SEEDS}, got {self.seed}")
        if not (math.isfinite(self.kl_coef) and self.kl_coef >= 0):
            raise PipelineError(f"--kl-coef must be a finite number >= 0, got {self.kl_coef}")
        if self.advantage_baseline not in (None, "mean", "leave-one-out"):
            raise PipelineError(f"--advantage-baseline must be mean or leave-one-out, got {self.advantage_baseline!r}")

    @classmethod
    def recorded(cls, record: dict[str, Any]) -> ReplayOptions:
        """The options of the ``replay`` record a replay keeps in ``settings.json`` (whose ``steps`` is
        the count ``--epochs`` made, when it was given)."""
        given = {"buffer": "", **{f.name: record[f.name] for f in dataclasses.fields(cls) if f.name in record}}
        return cls(**{**given, "steps": None} if given.get("epochs") is not None else given)

    def flags(self) -> list[str]:
        """These options as ``replay``'s flags, but ``--buffer``: each option set, defaults too (a
        resumed replay is refused where one differs), in the order of the fields; the KL's two only with
        the ``--ref-model`` they score with (``replay`` refuses them alone)."""
        words: list[str] = []
        for name, value in dataclasses.asdict(self).items():
            if name in REFERENCE_ONLY and self.ref_model is None:
                continue
            if name != "buffer" and value is not None:
                words += ["--shuffle-window" if name == "shuffle_window_rows" else "--" + name.replace("_", "-"),
                          ("on" if value else "off") if isinstance(value, bool) else str(value)]
        return words
