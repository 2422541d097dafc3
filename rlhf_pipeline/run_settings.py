"""The run's settings, which the framework owns: a pipeline's ``Settings`` subclasses :class:`RunSettings`.

A pipeline file declares its task (model, prompts or environment, rewards, warm start) and the few
settings of its own; what every run has -- steps, device, seed, threads, the GRPO group, pacing, the
buffer and its lock, retention, the learner, the engine, Ray -- is declared here once, with the
rules between them beside the fields (``__post_init__``) and the values derived from them
(:meth:`RunSettings.learner_settings`). The keys stay flat (``--set group_size=4``,
``--set learner.lr=1e-4``, ``--set generation.engine=vllm``). Importable without torch.
Design: docs/pipelines.md#settings-and-set.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal

from rlhf_pipeline.evaluation.settings import EvalSettings
from rlhf_pipeline.setting_checks import SEEDS, Bounds, check_fields
from rlhf_pipeline.generation.settings import GenerationSettings, check_generation
from rlhf_pipeline.learn.settings import LearnerSettings
from rlhf_pipeline.storage.retention import RetentionSettings

MIN_LOCK_LEASE_S = 3.0  # an object-store writer lock renews every third of its lease: a request a second at most


@dataclass
class RaySettings:
    """What each Ray actor of ``run --ray`` asks the cluster for. Resource requests change nothing in
    the data, so they may differ between starts of one run; without ``--ray`` they are not used."""

    collector_num_cpus: Annotated[float, Bounds(ge=0)] = 0.5
    """CPUs each collector actor reserves (fractions allowed: 1 learner + 2 collectors fit 2 CPUs)."""
    collector_num_gpus: Annotated[float, Bounds(ge=0)] = 0.0
    """GPUs each collector actor reserves (Ray sets CUDA_VISIBLE_DEVICES to them)."""
    learner_num_cpus: Annotated[float, Bounds(ge=0)] = 1.0
    """CPUs each learner actor (each data-parallel rank) reserves."""
    learner_num_gpus: Annotated[float, Bounds(ge=0)] = 0.0
    """GPUs each learner actor reserves; a CUDA learner rank needs 1."""
    max_restarts: Annotated[int, Bounds(ge=-1)] = 3
    """How often Ray restarts a collector or a learner actor whose process died; each restart
    resumes from the shard's saved position or the newest checkpoint (-1: without limit)."""

    def __post_init__(self) -> None:
        check_fields(self, "ray.")


def max_staleness(max_lag: int | None, learner: LearnerSettings) -> int | None:
    """The learner's bound on a row's age, from the run's ``max_lag`` plus the steps the sampler
    draws a row again after its first: ``uses_per_row - 1`` for ``exact``; for ``window`` and
    ``groups``, the steps a row stays in the window (``sample_window / new_rows_per_step``) less one;
    none for ``prioritized`` or a window that never waits for new rows, whose reuses ``max_lag``
    bounds itself. None (no bound) for an unpaced run and for an ``epoch`` replay of recorded rows."""
    if max_lag is None or learner.sampler == "epoch":
        return None
    if learner.sampler == "exact":
        return max_lag + learner.uses_per_row - 1
    if learner.sampler in ("window", "groups") and learner.new_rows_per_step:
        return max_lag + math.ceil(learner.sample_window / learner.new_rows_per_step) - 1
    return max_lag


@dataclass
class RunSettings:
    """Every run's settings. A pipeline's ``Settings`` subclasses it, adds its task's own fields (and
    may give these other defaults by declaring them again), and puts its own rules in :meth:`validate`."""

    RENAMED: ClassVar[dict[str, str]] = {"rounds_ahead": "max_lag", "rounds_per_version": "max_lag"}
    """Pacing settings that became one (issue 42): ``--set`` with an old name is refused, naming the
    new one (``pipeline.py``). ``rounds_ahead=0`` with ``rounds_per_version=2`` was ``max_lag=1``."""

    steps: Annotated[int, Bounds(ge=1)] = 300
    """Learner steps (optimizer updates); --steps sets it."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where models run; --device sets it."""
    seed: Annotated[int, SEEDS] = 0
    """Seed of the model init, warm start, prompt order, sampling and learner."""
    threads: Annotated[int | None, Bounds(ge=1)] = 1
    """Torch threads per process (collector, learner, warm start): the two sides run at once, so
    torch's default of one thread per core would oversubscribe a small CPU (none: torch's default)."""

    # ---- collection
    group_size: Annotated[int, Bounds(ge=2, why=": GRPO compares completions within a group")] = 8
    """Completions per prompt (GRPO's G): advantages compare the completions of one group."""
    temperature: Annotated[float, Bounds(gt=0)] = 1.0
    """Sampling temperature; the learner recomputes log-probs at the same temperature."""
    max_lag: Annotated[int | None, Bounds(ge=0)] = 1
    """How many policy versions the weights a row is sampled with may be behind the weights of the
    learner step that trains it. 0: on-policy, as TRL: step k trains rows sampled with the version
    step k-1 published, so the collector waits for each step and the learner for each round; 1: the
    collector samples the next batch while the learner trains this one (one step of overlap); N:
    up to N steps' rows ahead. The learner trains no row older than that (learner.max_staleness is
    derived from it). none: unpaced, the newest weights, no bound (a collector recording a buffer).
    docs/architecture.md#pacing says which to pick when."""

    # ---- buffer
    buffer_backend: Literal["memmap", "zarr"] = "memmap"
    """Store of each buffer shard: memmap files, or a Zarr store (compressed). A buffer at a URL (a run
    at a URL, or buffer_url) is Zarr unless this is given: only Zarr lives there."""
    segment_rows: Annotated[int, Bounds(ge=1)] = 1024
    """Rows per segment of the replay buffer (the unit of sealing and eviction)."""
    buffer_url: str | None = None
    """The buffer on object storage: a URL prefix such as s3://bucket/run/buffer under which
    collector k writes shard-kkkk (a Zarr store, and the s3 extra; endpoint and
    credentials from the AWS_* variables), or az://container/run/buffer on Azure Blob Storage (the
    azure extra; the account from AZURE_STORAGE_CONNECTION_STRING). None: <run>/buffer. Weights,
    checkpoints and metrics stay in the run directory."""
    buffer_lock_wait_s: Annotated[float, Bounds(ge=0, why=" seconds")] = 60.0
    """With buffer_url: how long a collector waits for its shard's writer lock while another writer
    holds it (one that died on another machine holds it until its lease runs out)."""
    buffer_lock_lease_s: Annotated[float, Bounds(ge=MIN_LOCK_LEASE_S, why=" seconds (renewed every third of it)")] = 30.0
    """With buffer_url: the lease of a collector's writer lock (>= 3 s, renewed every third of it).
    Shorter: a dead or paused collector is fenced and replaced sooner, at one more PUT per renewal."""
    retention: RetentionSettings = field(default_factory=RetentionSettings)
    """How much of its shard each collector keeps on a long run (--set retention.max_rows=200000;
    also max_versions_behind, max_age_s): whole old segments go, never rows a kept checkpoint, a
    branch or the learner still needs (docs/retention.md). Unset: every row is kept."""

    # ---- learner, engine, cluster
    learner: LearnerSettings = field(default_factory=LearnerSettings)
    """Learner settings (--set learner.lr=3e-4; --list-settings shows them all)."""
    generation: GenerationSettings = field(default_factory=GenerationSettings)
    """Who samples the completions: our loop (default) or vLLM (--set generation.engine=vllm; the
    learner then waits generation.start_timeout_s longer than learner.data_timeout_s for rows)."""
    ray: RaySettings = field(default_factory=RaySettings)
    """Resources of each actor under `run --ray` (--set ray.collector_num_gpus=1); ignored without --ray."""
    eval: EvalSettings = field(default_factory=EvalSettings)
    """Evaluation of published versions on the pipeline's held-out sets, beside training
    (--set eval.every_steps=50; docs/evaluation.md). Off by default."""

    def __post_init__(self) -> None:
        check_fields(self)  # every choice, number and bound, the task's fields' too
        if self.buffer_url is not None:
            if "://" not in self.buffer_url:
                raise ValueError(f"setting 'buffer_url' must be a URL such as s3://bucket/run/buffer, got "
                                 f"{self.buffer_url!r}; leave it unset to keep the buffer in the run directory")
            if self.buffer_backend != "zarr":
                raise ValueError(f"setting 'buffer_url' ({self.buffer_url}) needs buffer_backend=zarr: only a Zarr "
                                 f"store lives at a URL; leave buffer_backend unset (Zarr is the default with a "
                                 f"buffer_url), or drop buffer_url to keep the memmap buffer in the run directory")
        if self.retention.max_rows is not None and self.retention.max_rows < self.segment_rows:
            raise ValueError(f"setting 'retention.max_rows' ({self.retention.max_rows}) must be >= segment_rows "
                             f"({self.segment_rows}): rows are dropped a whole sealed segment at a time; raise it, "
                             f"or lower segment_rows")
        if self.learner.lora.enabled and self.generation.chosen_engine != "loop":
            from rlhf_pipeline.generation.vllm_adapters import served_rank

            served_rank(self.learner.lora.rank)  # vLLM's largest --max-lora-rank
            if self.generation.weight_transfer == "nccl":
                raise ValueError(f"setting 'generation.weight_transfer=nccl' with learner.lora.rank="
                                 f"{self.learner.lora.rank}: vLLM loads an adapter from a directory, not a "
                                 f"broadcast (docs/lora.md); use generation.weight_transfer=files")
        self.validate()

    def validate(self) -> None:
        """The pipeline's own rules over its own settings: raise ValueError naming the setting."""

    def model_head_size(self) -> tuple[int, str] | None:
        """The policy's attention head size, when the task knows it without building the model, and
        what changes it (vLLM's CPU attention takes only some); None: unknown."""
        return None

    def learner_settings(self) -> LearnerSettings:
        """What the learner trains with: ``learner`` and the values the run derives for it, here only.
        Log-probs are recomputed at the sampling temperature; rows wait on a vLLM engine's start (or a
        restart), so the learner gives up no sooner than that allowance past ``data_timeout_s``; no
        row trains more than ``max_lag`` versions behind (:func:`max_staleness`)."""
        timeout = self.learner.data_timeout_s
        if self.generation.engine == "vllm":
            timeout += self.generation.start_timeout_s
        return dataclasses.replace(self.learner, temperature=self.temperature, data_timeout_s=timeout,
                                   max_staleness=max_staleness(self.max_lag, self.learner))

    def check_machine(self) -> None:
        """What the settings ask of this machine, which building them cannot check (the engine's
        Python, vLLM's CPU attention against the model's head size): ValueError naming the setting.
        The launcher calls it before any process starts."""
        head = self.model_head_size()
        check_generation(self.generation, head_size=head[0] if head else None, device=self.device,
                         head_hint=head[1] if head else "")
