"""Many episodes at once: generation batched over every active episode, environments stepped
concurrently, whole groups of whole trajectories handed back together.

One round is: every active episode's token list goes to the sampler in one batch (each with its
own ``max_new_tokens``, the smaller of its per-turn limit and what its budget and context leave);
each episode records its sampled ids; then every environment answers its episode's turn at the
same time (:class:`~.environment.EnvironmentRunner`: sync steps in a thread pool, async ones
awaited, a per-step timeout). Episodes that ended drop out; the rest go round again.

The sampler is a callable, so this package needs no generation code of its own::

    sample(prompts: list[list[int]], max_new_tokens: list[int]) -> list[tuple[list[int], list[float]]]

returning each prompt's sampled ids (the stop token included when it stopped on one) and their
sampling log-probs. :func:`cut_to_limits` adapts a sampler that takes one ``max_new_tokens`` for
the batch (``collect.generate``): sample to the largest limit, cut each row at its own; a prefix
of an autoregressive sample is a sample of that prefix, so its log-probs stay exact.

Each round re-runs the model over every episode's whole token list (no KV cache kept across
turns); a rollout engine with prefix caching would keep it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlhf_pipeline.agents.environment import Environment, EnvironmentRunner, ToolCall
from rlhf_pipeline.agents.episode import Episode, EpisodeLimits, episodes_to_batch
from rlhf_pipeline.schema import TerminationReason, TrajectoryBatch

Sample = tuple[list[int], list[float]]
Sampler = Callable[[list[list[int]], list[int]], list[Sample]]


def cut_to_limits(sample_batch: Callable[[list[list[int]], int], list[Sample]], stop_token_ids: Sequence[int]) -> Sampler:
    """A per-episode-limit sampler from one that takes one ``max_new_tokens`` for the batch."""
    stops = set(stop_token_ids)

    def sample(prompts: list[list[int]], max_new_tokens: list[int]) -> list[Sample]:
        out = []
        for (ids, log_probs), limit in zip(sample_batch(prompts, max(max_new_tokens)), max_new_tokens, strict=True):
            end = next((k + 1 for k, token in enumerate(ids[:limit]) if token in stops), min(limit, len(ids)))
            out.append((list(ids[:end]), list(log_probs[:end])))
        return out

    return sample


@dataclass(frozen=True)
class RolloutConfig:
    """How episodes are run."""

    group_size: int = 4
    """Episodes per task (a GRPO group)."""
    limits: EpisodeLimits = EpisodeLimits()
    step_timeout_s: float | None = 60.0
    """Per ``reset``/``step`` call; a step past it ends its episode with ``TIMEOUT``."""
    episode_timeout_s: float | None = None
    """Wall-clock seconds an episode may run from its reset: one still going after a step past it
    ends there with ``TIMEOUT`` (the step's reward kept, its messages dropped), so one slow
    environment cannot hold a round, and its whole group, for ever."""
    max_workers: int = 16
    """Threads for synchronous environments."""
    check_drift: bool = True
    """Count re-tokenization drift each turn (one extra encode of the conversation)."""


@dataclass
class Rollout:
    """Ended episodes, ``group_size`` per task in task order, and what was counted."""

    tasks: list[Mapping[str, Any]]
    episodes: list[Episode]
    group_size: int
    metrics: Counter[str] = field(default_factory=Counter)

    def to_batch(self, *, first_group_id: int, first_trajectory_id: int, policy_version: int,
                 fields: Collection[str] = ()) -> TrajectoryBatch:
        """Every episode's rows (one per turn), task ``i``'s group id ``first_group_id + i``, with
        the optional ``fields`` (``episode.AGENT_ROW_FIELDS``) asked for."""
        n = len(self.episodes)
        return episodes_to_batch(self.episodes,
                                 group_ids=[first_group_id + k // self.group_size for k in range(n)],
                                 trajectory_ids=list(range(first_trajectory_id, first_trajectory_id + n)),
                                 policy_version=policy_version, fields=fields)


async def run_episodes(tasks: Sequence[Mapping[str, Any]], make_env: Callable[[], Environment], sample: Sampler,
                       tokenizer, config: RolloutConfig = RolloutConfig(), *,
                       parser: Callable[[str], list[ToolCall]] | None = None,
                       stop_token_ids: Sequence[int] | None = None,
                       template_kwargs: Mapping[str, Any] | None = None) -> Rollout:
    """Runs ``group_size`` episodes of each task to their ends. ``make_env()`` builds one episode's
    environment; one with a ``toolbox`` attribute (a :class:`~.tools.ToolBox`) has its tools'
    schemas rendered by the chat template, or one with ``tool_schemas`` (read after its reset:
    OpenAI-format function schemas, as :class:`~.verifiers_env.VerifiersEnvironment` has) those."""
    with EnvironmentRunner(max_workers=config.max_workers, step_timeout_s=config.step_timeout_s) as runner:
        envs = [make_env() for _ in tasks for _ in range(config.group_size)]
        boxes = {id(box): box for env in envs if (box := getattr(env, "toolbox", None)) is not None}
        # a ToolBox shared across rollouts counts forever; this rollout reports its own calls
        tools_before = {key: Counter(box.metrics) for key, box in boxes.items()}
        jobs = [task for task in tasks for _ in range(config.group_size)]
        openings = await asyncio.gather(*(runner.reset(env, task) for env, task in zip(envs, jobs, strict=True)))
        episodes = [Episode(tokenizer, messages, limits=config.limits, tools=_schemas(env), parser=parser,
                            stop_token_ids=stop_token_ids, check_drift=config.check_drift,
                            template_kwargs=template_kwargs)
                    for env, messages in zip(envs, openings, strict=True)]
        metrics: Counter[str] = Counter()
        started = time.monotonic()
        while active := [k for k, episode in enumerate(episodes) if not episode.done]:
            samples = sample([episodes[k].token_ids for k in active], [episodes[k].max_new_tokens() for k in active])
            metrics["generation_batches"] += 1
            metrics["generated_rows"] += len(active)
            turns = [episodes[k].add_turn(ids, log_probs) for k, (ids, log_probs) in zip(active, samples, strict=True)]
            results = await asyncio.gather(*(runner.step_counting_tools(envs[k], turn)
                                             for k, turn in zip(active, turns, strict=True)))
            overdue = config.episode_timeout_s is not None and time.monotonic() - started > config.episode_timeout_s
            for k, (result, tool_outcomes) in zip(active, results, strict=True):
                if overdue and not result.done:
                    result = dataclasses.replace(result, messages=[], done=True, reason=TerminationReason.TIMEOUT)
                    metrics["episode_timeouts"] += 1
                episodes[k].add_environment(result, tool_outcomes)
        metrics["environment_timeouts"] = runner.timeouts
    for episode in episodes:
        metrics.update(episode.metrics)
        metrics[f"reason/{episode.reason.name.lower()}"] += 1
        metrics["turns"] += len(episode.turns)
        metrics["tool_calls"] += sum(len(t.tool_calls) for t in episode.turns)
    for key, box in boxes.items():  # environments may share one
        metrics.update({f"tools/{name}": count - tools_before[key][name] for name, count in box.metrics.items()})
    return Rollout(list(tasks), episodes, config.group_size, metrics)


def rollout(*args, **kwargs) -> Rollout:
    """:func:`run_episodes` from synchronous code (a fresh event loop)."""
    return asyncio.run(run_episodes(*args, **kwargs))


def _schemas(env: Environment) -> list[dict[str, Any]] | None:
    schemas = getattr(env, "tool_schemas", None)  # known after reset (verifiers_env.py: per task)
    if schemas is not None:
        return list(schemas)
    box = getattr(env, "toolbox", None)
    return box.schemas if box is not None else None
