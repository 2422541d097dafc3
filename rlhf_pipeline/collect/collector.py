"""The collector: prompts in, scored ``TrajectoryBatch`` rows out to a sink.

One ``collect()`` call takes ``prompts_per_batch`` prompts from the source, asks its generation
engine for ``num_generations`` completions of each (``generation/engine.py``: our sampling loop by
default, vLLM with ``generation.engine=vllm``; the collector does not know which), scores them, and
hands one ``TrajectoryBatch`` holding whole groups to ``sink`` (typically ``ReplayBuffer.extend``
with the write-path transforms attached). Each row's ``policy_version`` is the version the engine
held when it sampled the row's group.

Ids. ``group_id`` and ``trajectory_id`` are ``(collector_index << 40) | counter`` with
counters that live in :meth:`Collector.state_dict`, so ids stay unique across
collector processes (different indices) and restarts (counters resume). Every row
is a single-turn trajectory: ``step`` 0, ``done`` True, ``terminated`` when the
completion ended on EOS, ``truncated`` when it hit ``max_new_tokens``.

Resume. ``state_dict()`` holds the prompt position, the id counters, the policy
version and the sampling RNG. Save it after ``collect()`` returns (the batch is then
in the sink): a collector restored from it continues with the next prompt and the
same random stream, so nothing is skipped or repeated. A crash between the sink's
write and that save is covered by ``collect(before_write=...)`` and
:class:`~rlhf_pipeline.collect.position.CollectorPosition`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from rlhf_pipeline.collect.prompts import PromptSource
from rlhf_pipeline.collect.rewards import RewardFn, WeightedReward, as_rewards, score
from rlhf_pipeline.generation.engine import GenerationEngine, SampleRequest
from rlhf_pipeline.generation.loop import LoopEngine, load_state_into
from rlhf_pipeline.generation.sampling import SamplingConfig
from rlhf_pipeline.schema.ids import MAX_COLLECTORS, id_base
from rlhf_pipeline.schema import TrajectoryBatch
from rlhf_pipeline.schema.ragged import RaggedTensor


@dataclass
class CollectorConfig:
    """Settings of one collector process."""

    prompts_per_batch: int = 8
    """Prompts per ``collect()`` call; the batch has ``prompts_per_batch * num_generations`` rows."""
    num_generations: int = 8
    """Completions per prompt (the GRPO group size G)."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Temperature / top-k / top-p / max_new_tokens; the stored log-probs follow them."""
    collector_index: int = 0
    """This collector's index among collectors writing one run; goes in the ids' high bits."""
    seed: int = 0
    """Seed of the sampling RNG (mixed with ``collector_index`` so collectors differ)."""

    def __post_init__(self) -> None:
        if self.prompts_per_batch < 1 or self.num_generations < 1:
            raise ValueError("CollectorConfig: prompts_per_batch and num_generations must be >= 1")
        if not 0 <= self.collector_index < MAX_COLLECTORS:
            raise ValueError(f"CollectorConfig.collector_index must be in [0, {MAX_COLLECTORS}), got {self.collector_index}")


MetricsHook = Callable[[dict[str, float]], None]


class Collector:
    """Generates, scores and emits groups of completions; resumable; takes new weights.

    ``model``: the policy to sample with in this process (our sampling loop, ``LoopEngine``), or a
    :class:`~rlhf_pipeline.generation.engine.GenerationEngine` (a vLLM engine...), which the
    collector then owns: :meth:`close` closes it."""

    def __init__(
        self,
        model: Any,
        tokenizer,
        prompts: PromptSource,
        rewards: RewardFn | Mapping[str, RewardFn | tuple[RewardFn, float]] | Sequence[WeightedReward],
        sink: Callable[[TrajectoryBatch], Any] | None,
        config: CollectorConfig | None = None,
        *,
        policy_version: int = 0,
        hooks: Sequence[MetricsHook] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.prompts = prompts
        self.rewards = as_rewards(rewards)
        self.sink = sink
        self.config = config or CollectorConfig()
        self.hooks = list(hooks)
        if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
            raise ValueError("Collector: the tokenizer needs pad_token_id and eos_token_id set")
        if isinstance(model, GenerationEngine):
            self.engine = model
        else:
            self.engine = LoopEngine(model, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                     policy_version=policy_version)
        self.engine.check_sampling(self.config.sampling)  # a setting the engine cannot honour: refused now
        self.groups_emitted = 0
        self.trajectories_emitted = 0
        self.batches_emitted = 0
        self.generator = torch.Generator(device=self.engine.generator_device)
        self.generator.manual_seed(self.config.seed * MAX_COLLECTORS + self.config.collector_index)
        self.last_metrics: dict[str, float] = {}

    # ---------------------------------------------------------------- one batch
    def collect(self, before_write: Callable[[dict[str, Any]], None] | None = None) -> TrajectoryBatch:
        """One batch of whole groups: generate, score, emit to the sink, report metrics.

        ``before_write(state)`` is called with the state the collector will have once the
        sink took the batch, right before the sink is called (see ``collect/position.py``).
        """
        cfg = self.config
        t0 = time.perf_counter()
        records = self.prompts.next_batch(cfg.prompts_per_batch)
        requests = [SampleRequest(r.render(self.tokenizer), n=cfg.num_generations) for r in records]
        groups = self.engine.sample(requests, cfg.sampling, self.generator)
        t_gen = time.perf_counter()
        completions_out = [c for g in groups for c in g.completions]  # grouped by prompt, request order
        prompt_index = torch.tensor([g.index for g in groups for _ in g.completions], dtype=torch.int64)  # (N,)
        idx = prompt_index.tolist()
        response_tokens = RaggedTensor.from_sequences([c.token_ids for c in completions_out], dtype=torch.int32)
        terminated = torch.tensor([c.terminated for c in completions_out], dtype=torch.bool)
        version = torch.tensor([g.policy_version for g in groups for _ in g.completions], dtype=torch.int64)
        # render each prompt's text once, not once per completion
        record_texts = [r.display_text(self.tokenizer) for r in records]
        prompt_texts = [record_texts[i] for i in idx]
        completions = self.tokenizer.batch_decode([c.token_ids for c in completions_out], skip_special_tokens=True)
        field_names = sorted({k for r in records for k in r.fields})
        fields = {k: [records[i].fields.get(k) for i in idx] for k in field_names}
        reward, parts = score(self.rewards, prompt_texts, completions, fields)
        t_reward = time.perf_counter()

        n = len(idx)
        base = id_base(cfg.collector_index)
        group_id = base + self.groups_emitted + prompt_index
        trajectory_id = base + self.trajectories_emitted + torch.arange(n)
        batch = TrajectoryBatch({
            "prompt_tokens": RaggedTensor.from_sequences([requests[i].prompt_ids for i in idx], dtype=torch.int32),
            "response_tokens": response_tokens,
            "response_log_probs": RaggedTensor.from_sequences([c.log_probs for c in completions_out],
                                                              dtype=torch.float32),
            "group_id": group_id.to(torch.int64),
            "trajectory_id": trajectory_id.to(torch.int64),
            "step": torch.zeros(n, dtype=torch.int32),
            "reward": reward,
            "done": torch.ones(n, dtype=torch.bool),
            "terminated": terminated,
            "truncated": ~terminated,
            "policy_version": version,
            "prompt_text": prompt_texts,
            "response_text": completions,
        })
        if before_write is not None:
            before_write(self.state_dict(rounds_ahead=(1, len(records), n)))
        if self.sink is not None:
            self.sink(batch)
        # counters advance only once the sink has the rows, so a failed write is retried with the same ids
        self.groups_emitted += len(records)
        self.trajectories_emitted += n
        self.batches_emitted += 1
        self._report(batch, parts, t0, t_gen, t_reward)
        return batch

    @property
    def round_rows(self) -> int:
        """Rows one :meth:`collect` writes (pacing counts rounds in them, ``coordination/pacing.py``)."""
        return self.config.prompts_per_batch * self.config.num_generations

    def run(self, *, max_batches: int | None = None, max_rows: int | None = None,
            should_stop: Callable[[], bool] | None = None) -> int:
        """Calls :meth:`collect` until a limit is reached or ``should_stop()``; returns rows emitted."""
        rows = batches = 0
        while True:
            if max_batches is not None and batches >= max_batches:
                break
            if max_rows is not None and rows >= max_rows:
                break
            if should_stop is not None and should_stop():
                break
            rows += len(self.collect())
            batches += 1
        return rows

    def _report(self, batch: TrajectoryBatch, parts: dict[str, torch.Tensor], t0: float, t_gen: float, t_reward: float) -> None:
        elapsed = time.perf_counter() - t0
        reward = batch["reward"]
        g = self.config.num_generations
        group_std = reward.reshape(-1, g).std(dim=1, unbiased=False) if g > 1 else torch.zeros(1)
        metrics = {
            "rows": float(len(batch)),
            "rows_per_s": len(batch) / max(elapsed, 1e-9),
            "generate_s": t_gen - t0,
            "reward_s": t_reward - t_gen,
            "reward_mean": float(reward.mean()),
            "reward_std": float(reward.std(unbiased=False)),
            "groups_with_signal": float((group_std > 0).float().mean()),
            "response_len_mean": float(batch["response_tokens"].lengths().float().mean()),
            "terminated_frac": float(batch["terminated"].float().mean()),
            "policy_version": float(self.policy_version),
            "batches": float(self.batches_emitted),
            "trajectories": float(self.trajectories_emitted),
            **self.engine.stats.update_metrics(),
        }
        for name, values in parts.items():
            metrics[f"reward/{name}"] = float(values.mean())
        self.last_metrics = metrics
        for hook in self.hooks:
            hook(metrics)

    # ---------------------------------------------------------------- weights
    @property
    def policy_version(self) -> int:
        """The version of the weights the engine holds: what the next rows are tagged with."""
        return self.engine.policy_version

    def set_policy_state(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Loads new policy weights into the engine (all keys must match); later rows name ``version``."""
        if version < self.policy_version:
            raise ValueError(
                f"set_policy_state: version {version} is older than the current {self.policy_version}; "
                f"weights only move forward"
            )
        self.engine.update_weights(state_dict, version)

    def close(self) -> None:
        """Closes the engine (stops a vLLM engine's process); the loop engine holds nothing to stop."""
        self.engine.close()

    # ---------------------------------------------------------------- resume
    def state_dict(self, rounds_ahead: tuple[int, int, int] = (0, 0, 0)) -> dict[str, Any]:
        """``rounds_ahead``: (batches, groups, trajectories) not yet counted but to be included."""
        batches, groups, trajectories = rounds_ahead
        return {
            "prompts": self.prompts.state_dict(),
            "groups_emitted": self.groups_emitted + groups,
            "trajectories_emitted": self.trajectories_emitted + trajectories,
            "batches_emitted": self.batches_emitted + batches,
            "policy_version": self.policy_version,
            "rng": self.generator.get_state(),
            "config": {"collector_index": self.config.collector_index, "seed": self.config.seed,
                       "num_generations": self.config.num_generations,
                       "sampling": asdict(self.config.sampling)},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state["config"]["collector_index"] != self.config.collector_index:
            raise ValueError(
                f"collector state belongs to collector_index {state['config']['collector_index']}, "
                f"this is collector {self.config.collector_index}; restore each collector from its own state"
            )
        self.prompts.load_state_dict(state["prompts"])
        self.groups_emitted = int(state["groups_emitted"])
        self.trajectories_emitted = int(state["trajectories_emitted"])
        self.batches_emitted = int(state["batches_emitted"])
        # the saved policy_version is not restored: rows name the version the engine holds, and the
        # caller loads the newest published weights next (collect_main does)
        self.generator.set_state(state["rng"])


load_policy_weights = load_state_into  # the name the agent collector and older code use
