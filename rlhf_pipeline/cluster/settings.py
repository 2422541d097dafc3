"""What each Ray actor of ``run --ray`` asks the cluster for: a pipeline's ``ray`` settings.

Kept apart from the Ray code so that a pipeline file can declare them without Ray installed.
Resource requests change nothing in the data, so they may differ between starts of one run.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RaySettings:
    collector_num_cpus: float = 0.5
    """CPUs each collector actor reserves (fractions allowed: 1 learner + 2 collectors fit 2 CPUs)."""
    collector_num_gpus: float = 0.0
    """GPUs each collector actor reserves (Ray sets CUDA_VISIBLE_DEVICES to them)."""
    learner_num_cpus: float = 1.0
    """CPUs each learner actor (each data-parallel rank) reserves."""
    learner_num_gpus: float = 0.0
    """GPUs each learner actor reserves; a CUDA learner rank needs 1."""
    max_restarts: int = 3
    """How often Ray restarts a collector or a learner actor whose process died; each restart
    resumes from the shard's saved position or the newest checkpoint (-1: without limit)."""

    def check(self) -> None:
        for name in ("collector_num_cpus", "collector_num_gpus", "learner_num_cpus", "learner_num_gpus"):
            if getattr(self, name) < 0:
                raise ValueError(f"setting 'ray.{name}' must be >= 0 (got {getattr(self, name)})")
        if self.max_restarts < -1:
            raise ValueError(f"setting 'ray.max_restarts' must be >= -1 (got {self.max_restarts})")
