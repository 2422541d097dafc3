"""Default pipeline: GRPO on a toy addition task with a tiny model, on CPU, in minutes.

    rlhf-pipeline run pipelines/default.py                  # about 15 s on 2 idle CPU cores
    rlhf-pipeline run pipelines/default.py --steps 20 --set group_size=4
    rlhf-pipeline run pipelines/default.py --set generation.engine=vllm --set num_heads=2   # vLLM generates
    rlhf-pipeline run pipelines/default.py --set generation.url=http://127.0.0.1:8000 --set num_heads=2
                                                            # a vLLM server you started (docs/generation.md)

What it wires, top to bottom:

1. model   a tiny Qwen2 (or Llama) causal LM built from a config, with the offline
           character tokenizer; a short supervised warm start teaches it the answer
           format (digits then <|end|>), so sampled groups have reward variance;
2. task    ``a+b=`` prompts (a, b < max_operand) and a verifiable reward with partial
           credit for right digits (``rlhf_pipeline.collect.toy_task``);
3. buffer  a memmap (or Zarr) replay buffer per collector in ``<run>/buffer/shard-kkkk``; the write
           path computes the GRPO group advantage (normalized by the group's std) before
           rows land; the learner samples the union of the shards;
4. learner GRPO with the settings in ``learner`` (see ``--list-settings``);
5. engine  who samples: our loop in the collector's process, or vLLM in its own process
           (``generation.engine=vllm``; its CPU attention needs a head size of 32 or more, so
           ``num_heads=2`` with the default width), or a vLLM server you started
           (``generation.url``).

Copy this file to start a new pipeline; pipelines do not inherit from each other.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rlhf_pipeline.generation.settings import GenerationSettings, check_generation, check_rounds
from rlhf_pipeline.learn.settings import LearnerSettings
from rlhf_pipeline.pipeline import Pipeline, PipelineError, RunPaths, preflight_rewards
from rlhf_pipeline.storage.retention import RetentionSettings
from rlhf_pipeline.cluster.settings import RaySettings


@dataclass
class Settings:
    steps: int = 300
    """Learner steps (optimizer updates); --steps sets it."""
    device: str = "cpu"
    """Where models run: cpu or cuda; --device sets it."""
    seed: int = 0
    """Seed of the model init, warm start, prompt order, sampling and learner."""

    # ---- model
    arch: Literal["qwen2", "llama"] = "qwen2"
    """Architecture of the tiny model built from a config."""
    hidden_size: int = 64
    """Width of the tiny model."""
    num_layers: int = 2
    """Transformer layers of the tiny model."""
    num_heads: int = 4
    """Attention heads of the tiny model."""
    warm_start_steps: int = 200
    """Supervised steps on correct examples before RL (0 skips the warm start)."""
    warm_start_lr: float = 3e-3
    """Learning rate of the warm start."""

    # ---- task and collection
    num_prompts: int = 4096
    """Distinct training prompts (a+b=); the collector cycles over them, reshuffled per epoch."""
    max_operand: int = 20
    """Operands are drawn from [0, max_operand)."""
    prompts_per_round: int = 8
    """Prompts per collection round; a round writes prompts_per_round * group_size rows."""
    group_size: int = 8
    """Completions per prompt (GRPO's G)."""
    max_new_tokens: int = 6
    """Longest sampled answer, in characters (the tokenizer is character-level)."""
    temperature: float = 1.0
    """Sampling temperature; the learner recomputes log-probs at the same temperature."""
    rounds_per_version: int = 2
    """The collector writes at most this many rounds per policy version, then waits for new weights
    (rounds the learner's next batch needs are written whatever this says)."""
    rounds_ahead: int | None = 0
    """Pacing: the collector generates what the learner's next batch needs plus at most this many
    rounds, then waits for the learner to take them in (0: generation overlaps one learner step;
    none: unpaced)."""
    threads: int | None = 1
    """Torch threads per process (collector, learner, warm start): the two sides run at once, so
    torch's default of one thread per core would oversubscribe the CPU (none: torch's default)."""

    # ---- buffer and learner
    buffer_backend: Literal["memmap", "zarr"] = "memmap"
    """Store of each buffer shard: memmap files, or a Zarr store (compressed)."""
    segment_rows: int = 1024
    """Rows per segment of the replay buffer (the unit of sealing and eviction)."""
    buffer_url: str | None = None
    """The buffer on object storage: a URL prefix such as s3://bucket/run/buffer under which
    collector k writes shard-kkkk (needs buffer_backend=zarr and the s3 extra; endpoint and
    credentials from the AWS_* variables), or az://container/run/buffer on Azure Blob Storage (the
    azure extra; the account from AZURE_STORAGE_CONNECTION_STRING). None: <run>/buffer. Weights, checkpoints and metrics
    stay in the run directory."""
    buffer_lock_wait_s: float = 60.0
    """With buffer_url: how long a collector waits for its shard's writer lock while another writer
    holds it (one that died on another machine holds it until its lease runs out)."""
    buffer_lock_lease_s: float = 30.0
    """With buffer_url: the lease of a collector's writer lock (>= 3 s, renewed every third of it).
    Shorter: a dead or paused collector is fenced and replaced sooner, at one more PUT per renewal."""
    retention: RetentionSettings = field(default_factory=RetentionSettings)
    """How much of its shard each collector keeps on a long run (--set retention.max_rows=200000;
    also max_versions_behind, max_age_s): whole old segments go, never rows a kept checkpoint, a
    branch or the learner still needs (docs/retention.md). Unset: every row is kept."""
    learner: LearnerSettings = field(default_factory=lambda: LearnerSettings(
        batch_size=64, sampler="exact", uses_per_row=1, sample_window=128, new_rows_per_step=64,
        micro_batch_tokens=4096, lr=3e-4, warmup_steps=5, max_staleness=2, publish_every=1,
        checkpoint_every=50, log_every=20,
    ))
    """Learner settings (--set learner.lr=3e-4, --list-settings shows them all)."""
    generation: GenerationSettings = field(default_factory=GenerationSettings)
    """Who samples the completions: our loop (default) or vLLM (--set generation.engine=vllm; the
    learner then waits generation.start_timeout_s longer than learner.data_timeout_s for rows)."""
    ray: RaySettings = field(default_factory=RaySettings)
    """Resources of each actor under `run --ray` (--set ray.collector_num_gpus=1); ignored without --ray."""


def check(settings: Settings) -> LearnerSettings:
    """Settings checks that need no torch: ``run`` calls this before it starts any process."""
    if settings.group_size < 2:
        raise PipelineError("setting 'group_size' must be >= 2: GRPO compares completions within a group")
    if settings.max_operand < 1:
        raise PipelineError("setting 'max_operand' must be >= 1")
    if settings.buffer_url is not None and settings.buffer_backend != "zarr":
        raise PipelineError(f"setting 'buffer_url' ({settings.buffer_url}) needs buffer_backend=zarr: only a Zarr "
                            f"store lives at a URL; add --set buffer_backend=zarr, or drop buffer_url to keep the "
                            f"memmap buffer in the run directory")
    try:
        settings.retention.check(settings.segment_rows)
        check_rounds(settings.generation, multi_turn=False)
        check_generation(settings.generation, head_size=settings.hidden_size // settings.num_heads,
                         device=settings.device, head_hint=f" (hidden_size {settings.hidden_size} / num_heads "
                         f"{settings.num_heads}): add --set num_heads=2")
    except ValueError as exc:
        raise PipelineError(str(exc)) from None
    # the learner recomputes log-probs at the sampling temperature
    learner = dataclasses.replace(settings.learner, temperature=settings.temperature)
    if settings.generation.engine == "vllm":  # rows wait on the engine's start (or a restart): give up no sooner
        learner = dataclasses.replace(learner, data_timeout_s=learner.data_timeout_s + settings.generation.start_timeout_s)
    try:
        learner.check()
    except ValueError as exc:
        raise PipelineError(str(exc)) from None
    return learner


def build(settings: Settings, run: RunPaths) -> Pipeline:
    # imports here: loading the file for --list-settings or a bad --set stays fast. The write
    # path's (torchrl, ~1 s) are in the factories that use them: the learner, which builds this
    # too and warm-starts right after, never needs them
    import torch

    from rlhf_pipeline.collect.toy_task import toy_prompts, toy_reward, warm_start
    from rlhf_pipeline.models import char_tokenizer, tiny_causal_lm
    from rlhf_pipeline.schema import StoreSchema
    from rlhf_pipeline.storage import create_store

    # ---------------------------------------------------------------- checks first
    learner = check(settings)
    if settings.device == "cuda" and not torch.cuda.is_available():
        raise PipelineError("setting 'device' is 'cuda' but torch sees no GPU; use --device cpu")

    tokenizer = char_tokenizer()
    prompts = toy_prompts(settings.num_prompts, settings.seed, max_operand=settings.max_operand)
    rewards = {"toy": toy_reward}

    # ---------------------------------------------------------------- model
    def make_model():
        return tiny_causal_lm(
            len(tokenizer), arch=settings.arch, hidden_size=settings.hidden_size,
            num_layers=settings.num_layers, num_heads=settings.num_heads,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, seed=settings.seed,
        )

    def make_policy():
        model = make_model()
        if settings.warm_start_steps:
            result = warm_start(model, tokenizer, settings.warm_start_steps, lr=settings.warm_start_lr,
                                seed=settings.seed, max_operand=settings.max_operand)
            print(f"[run] warm start: {settings.warm_start_steps} steps, loss {result['loss']:.3f}, "
                  f"{result['seconds']:.1f}s", flush=True)
        return model

    # ---------------------------------------------------------------- buffer + write path
    def create_buffer(path: Path | str):  # a str: a shard under buffer_url
        return create_store(path, settings.buffer_backend, schema=StoreSchema(optional=("advantage",)),
                            segment_rows=settings.segment_rows)

    def make_write_path(store):
        from rlhf_pipeline.transforms.group_advantage import GroupAdvantage

        return [GroupAdvantage(settings.group_size)]

    def make_collector(model, store, collector_index: int = 0):
        from rlhf_pipeline.collect import Collector, CollectorConfig, PromptSource, SamplingConfig
        from rlhf_pipeline.generation.settings import make_collector_engine
        from rlhf_pipeline.storage import make_replay_buffer

        buffer = make_replay_buffer(store, batch_size=settings.learner.batch_size,
                                    transforms=make_write_path(store))
        config = CollectorConfig(
            prompts_per_batch=settings.prompts_per_round, num_generations=settings.group_size,
            sampling=SamplingConfig(max_new_tokens=settings.max_new_tokens, temperature=settings.temperature),
            seed=settings.seed, collector_index=collector_index, stream_groups=settings.generation.stream_groups,
            overlap_rounds=settings.generation.overlap_rounds,
        )
        # each collector (one buffer shard each) walks the prompts in its own order
        source = PromptSource(prompts, seed=settings.seed + 1_000_003 * collector_index, required_fields=("answer",))
        try:  # the loop samples with this model; a vLLM engine or a server at generation.url starts from its weights
            engine = make_collector_engine(settings.generation, model.to(settings.device), tokenizer, device=settings.device,
                                           seed=settings.seed, collector_index=collector_index)
        except ValueError as exc:  # one that cannot serve this run: one line, no rows
            raise PipelineError(str(exc)) from None
        return Collector(engine, tokenizer, source, rewards, sink=buffer.extend, config=config)

    return Pipeline(
        settings=settings,
        learner=learner,
        make_policy=make_policy,
        make_model=make_model,
        create_buffer=create_buffer,
        make_collector=make_collector,
        pad_token_id=tokenizer.pad_token_id,
        tokenizer=tokenizer,
        make_write_path=make_write_path,
        preflight=lambda: preflight_rewards(rewards, prompts[:1], settings.group_size),
        collect_rounds_per_version=settings.rounds_per_version,
        collect_rounds_ahead=settings.rounds_ahead,
        torch_threads=settings.threads,
        buffer_url=settings.buffer_url,
        buffer_lock_wait_s=settings.buffer_lock_wait_s,
        buffer_lock_lease_s=settings.buffer_lock_lease_s,
        retention=settings.retention,
    )
