"""What a round's groups are: :class:`SingleTurn` (a group is one request of ``n`` completions, drawn
from the group's seed, scored by the rewards) and :class:`Environments` (each episode takes turns
with an environment, each turn seeded from the episode's own seed): how they run and the rows they
become (docs/collector.md).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from rlhf_pipeline.agents.episode import AGENT_ROW_FIELDS, EpisodeLimits
from rlhf_pipeline.agents.rollout import RolloutConfig, groups_to_batch, run_episodes
from rlhf_pipeline.collect.rewards import RewardFn, WeightedReward, as_rewards, drop_non_finite_groups, score
from rlhf_pipeline.generation.engine import SampleRequest, draw_seed
from rlhf_pipeline.setting_checks import check_fields
from rlhf_pipeline.schema import TrajectoryBatch
from rlhf_pipeline.schema.ragged import RaggedTensor

if TYPE_CHECKING:
    from rlhf_pipeline.agents.environment import Environment, ToolCall


@dataclass(frozen=True)
class EndedGroup:
    """One group once its episodes ended: ``index`` its task's place in the round; ``episodes`` what
    they became (a single-turn group's answer; an agent group's episodes, None when it was dropped)."""

    index: int
    episodes: Any


class SingleTurn:
    """Episodes of one turn: a group is ``group_size`` completions of the task's prompt, each scored
    by ``rewards`` (one callable, ``{name: fn}``, ``{name: (fn, weight)}`` or ``WeightedReward``s)."""

    drops_over = "non-finite rewards"
    """What drops a group, for the failure-rate message."""

    def __init__(self, rewards: RewardFn | Mapping[str, RewardFn | tuple[RewardFn, float]] | Sequence[WeightedReward]):
        self.rewards = as_rewards(rewards)

    def seeds_per_group(self, group_size: int) -> int:
        """One seed per group: its ``group_size`` completions are one request's."""
        return 1

    def turn_stop_ids(self, tokenizer) -> list[int]:
        """The ids that end a completion: the tokenizer's EOS."""
        return [tokenizer.eos_token_id]

    def start(self, collector, round_) -> None:
        """Every group's one request, asked now; each answer goes to ``round_.ended`` as it comes."""
        round_.requests = [SampleRequest(task.render(collector.tokenizer), n=collector.config.group_size)
                           for task in round_.tasks]
        left = [len(round_.tasks)]
        lock = threading.Lock()

        def answered(index: int, future) -> None:
            try:
                group = [EndedGroup(index, future.result())]
            except BaseException as exc:  # the engine failed: the round does
                round_.ended.put(exc)
                return
            with lock:
                left[0] -= 1
                last = left[0] == 0
            round_.ended.put(group)
            if last:
                round_.ended.put(None)

        for index, (request, seed) in enumerate(zip(round_.requests, round_.seeds, strict=True)):
            future = round_.turns.ask(request, seed)
            future.add_done_callback(lambda f, index=index: answered(index, f))

    def rows(self, collector, round_, groups: list[EndedGroup]) -> TrajectoryBatch | None:
        """The scored rows of ``groups`` (whole groups of the round, in order), with the ids they have in
        the round: group ``k`` is ``group_id`` base + groups so far + k; a group whose reward is not finite
        goes to ``round_.dropped``, its reward parts per row kept to ``round_.parts``. None: all dropped."""
        cfg, tokenizer, tasks = collector.config, collector.tokenizer, round_.tasks
        completions_out = [c for g in groups for c in g.episodes.completions]  # grouped by task, in order
        idx = [g.index for g in groups for _ in g.episodes.completions]
        prompt_index = torch.tensor(idx, dtype=torch.int64)
        member = torch.tensor([j for g in groups for j in range(len(g.episodes.completions))], dtype=torch.int64)
        terminated = torch.tensor([c.terminated for c in completions_out], dtype=torch.bool)
        version = torch.tensor([g.episodes.policy_version for g in groups for _ in g.episodes.completions],
                               dtype=torch.int64)
        record_texts = {i: tasks[i].display_text(tokenizer) for i in sorted(set(idx))}  # once per prompt
        prompt_texts = [record_texts[i] for i in idx]
        completions = tokenizer.batch_decode([c.token_ids for c in completions_out], skip_special_tokens=True)
        field_names = sorted({k for r in tasks for k in r.fields})
        fields = {k: [tasks[i].fields.get(k) for i in idx] for k in field_names}
        reward, parts = score(self.rewards, prompt_texts, completions, fields)
        n = len(idx)
        batch = TrajectoryBatch({
            "prompt_tokens": RaggedTensor.from_sequences([round_.requests[i].prompt_ids for i in idx],
                                                         dtype=torch.int32),
            "response_tokens": RaggedTensor.from_sequences([c.token_ids for c in completions_out], dtype=torch.int32),
            "response_log_probs": RaggedTensor.from_sequences([c.log_probs for c in completions_out],
                                                              dtype=torch.float32),
            "group_id": round_.first_group_id + prompt_index,
            # every group has group_size rows: row j of group k is the round's k * G + j
            "trajectory_id": round_.first_trajectory_id + prompt_index * cfg.group_size + member,
            "step": torch.zeros(n, dtype=torch.int32),
            "reward": reward,
            "done": torch.ones(n, dtype=torch.bool),
            "terminated": terminated,
            "truncated": ~terminated,
            "policy_version": version,
            "prompt_text": prompt_texts,
            "response_text": completions,
        })
        batch, parts, dropped = drop_non_finite_groups(batch, parts, prompt_index, completions)
        round_.dropped += [(g - round_.first_group_id, "non_finite_reward", why) for g, why in dropped]
        round_.parts.append(parts)
        return batch if len(batch) else None

    def finish(self, round_) -> None:
        """Nothing runs beside a single-turn round once its last answer came."""

    def failures(self, round_) -> list[tuple[int, str, str]]:
        """``(group index, reason, one line)`` of each dropped group, found as its rows were built."""
        return round_.dropped

    def metrics(self, collector, round_, batch: TrajectoryBatch | None, elapsed: float) -> dict[str, float]:
        def mean(values: torch.Tensor) -> float:  # 0 for a round whose every group was dropped
            return float(values.float().mean()) if values.numel() else 0.0

        rows = batch is not None
        parts = {k: torch.cat([p[k] for p in round_.parts]) for k in (round_.parts[0] if round_.parts else ())}
        return {
            "reward_s": round_.rows_s,
            **_reward_metrics(batch["reward"] if rows else torch.zeros(0), collector.config.group_size),
            "response_len_mean": mean(batch["response_tokens"].lengths()) if rows else 0.0,
            "terminated_frac": mean(batch["terminated"]) if rows else 0.0,
            **{f"reward/{name}": mean(values) for name, values in parts.items()},
        }


@dataclass
class Environments:
    """Episodes of many turns: each of a group's ``group_size`` episodes runs ``make_env()`` (an
    :class:`~rlhf_pipeline.agents.environment.Environment`) to its end, its next turn asked as soon as
    its environment answered; an episode that fails drops its group (``agents/rollout.py``)."""

    make_env: Callable[[], Environment]
    """Builds one episode's environment."""
    parser: Callable[[str], list[ToolCall]] | None = None
    """Finds tool calls in the model's text (``rlhf_pipeline.agents.tools``)."""
    stop_token_ids: Collection[int] | None = None
    """The ids that end a model turn (default: the tokenizer's EOS); an engine built outside the
    collector must stop on the same."""
    template_kwargs: Mapping[str, Any] | None = None
    """Passed to the chat template."""
    limits: EpisodeLimits = field(default_factory=EpisodeLimits)
    """Turns, tokens per turn, token budget and context of each episode."""
    step_timeout_s: float | None = 60.0
    """Per environment ``reset``/``step``; past it the episode ends with ``TIMEOUT``."""
    episode_timeout_s: float | None = None
    """Wall-clock seconds of an episode from its reset; past it, after the step in progress, it ends
    with ``TIMEOUT`` (``RolloutConfig.episode_timeout_s``)."""
    max_workers: int = 16
    """Threads stepping synchronous environments."""
    check_drift: bool = True
    """Count ``retokenization_drift`` each turn (one extra encode of the conversation)."""
    row_fields: tuple[str, ...] = AGENT_ROW_FIELDS
    """Optional fields stored on each turn's row: ``tool_calls``, ``tool_errors``, ``tool_error_kinds``
    and ``turn_messages`` (for ``export --format chat``). The buffer must hold each; leave out those a
    buffer was created without."""

    drops_over = "failed episodes"
    """What drops a group, for the failure-rate message."""

    def __post_init__(self) -> None:
        check_fields(self, "Environments.")  # every number finite
        unknown = sorted(set(self.row_fields) - set(AGENT_ROW_FIELDS))
        if unknown:
            raise ValueError(f"Environments.row_fields: {unknown} are not fields an episode fills; "
                             f"choose from {list(AGENT_ROW_FIELDS)}")

    def seeds_per_group(self, group_size: int) -> int:
        """One seed per episode: each turn's seed is drawn from a generator seeded with it."""
        return group_size

    def turn_stop_ids(self, tokenizer) -> list[int]:
        """The ids that end a model turn: ``stop_token_ids``, or the tokenizer's EOS."""
        return sorted(self.stop_token_ids if self.stop_token_ids is not None else [tokenizer.eos_token_id])

    def start(self, collector, round_) -> None:
        """Runs the round's episodes on a thread of their own (their event loop and environments' workers);
        each group goes to ``round_.ended`` as its episodes all ended, then the :class:`Rollout`."""
        cfg = collector.config
        generators = [torch.Generator().manual_seed(seed) for seed in round_.seeds]  # one per episode

        async def sample_turn(episode: int, token_ids: list[int], max_new_tokens: int):
            future = round_.turns.ask(SampleRequest(token_ids, n=1, max_new_tokens=max_new_tokens),
                                      draw_seed(generators[episode]))
            completion = (await asyncio.wrap_future(future)).completions[0]
            return completion.token_ids, completion.log_probs

        def run() -> None:
            try:
                result = asyncio.run(run_episodes(
                    round_.tasks, self.make_env, sample_turn, collector.tokenizer, RolloutConfig(
                        group_size=cfg.group_size, limits=self.limits, step_timeout_s=self.step_timeout_s,
                        episode_timeout_s=self.episode_timeout_s, max_workers=self.max_workers,
                        check_drift=self.check_drift),
                    parser=self.parser, stop_token_ids=collector.engine.stop_token_ids,
                    template_kwargs=self.template_kwargs,
                    on_groups_ended=lambda ended: round_.ended.put([EndedGroup(i, e) for i, e in ended]),
                    episode_ended=lambda _episode: round_.turns.ended()))
            except BaseException as exc:  # the engine failed, or the round was abandoned
                round_.ended.put(exc)
                return
            round_.rollout = result
            round_.ended.put(None)

        round_.runner = threading.Thread(target=run, name="collector-episodes", daemon=True)
        round_.runner.start()

    def rows(self, collector, round_, groups: list[EndedGroup]) -> TrajectoryBatch | None:
        """The rows of ended groups, task ``i``'s group id ``first_group_id + i`` and its episode ``j``'s
        trajectory ``first_trajectory_id + i * group_size + j``: a dropped group leaves its ids unused (and
        goes to ``round_.dropped`` with no reason: what failed is known once the round's episodes all ended)."""
        round_.dropped += [(group.index, "", "") for group in groups if group.episodes is None]
        return groups_to_batch([(group.index, group.episodes) for group in groups if group.episodes is not None],
                                group_size=collector.config.group_size, first_group_id=round_.first_group_id,
                                first_trajectory_id=round_.first_trajectory_id,
                                policy_version=collector.policy_version, fields=self.row_fields)

    def finish(self, round_) -> None:
        """Waits for the round's episodes' thread (an abandoned round's episodes stop at their next turn)."""
        if round_.runner is not None:
            round_.runner.join()

    def failures(self, round_) -> list[tuple[int, str, str]]:
        """``(group index, reason, one line)`` of the first failure of each dropped group."""
        first: dict[int, Any] = {}
        for failure in round_.rollout.failures:
            first.setdefault(failure.group, failure)
        return [(group, f.reason, f"{f.reason}: {f.message}") for group, f in sorted(first.items())]

    def metrics(self, collector, round_, batch: TrajectoryBatch | None, elapsed: float) -> dict[str, float]:
        """Rewards, turns, tool calls and failures of the round; ``engine_idle_share``: the share of the
        round in which the engine had no turn to sample."""
        episodes, m = round_.rollout.episodes, round_.rollout.metrics
        n = max(len(episodes), 1)  # every group dropped: the per-episode figures are 0
        returns = torch.tensor([sum(e.rewards) for e in episodes], dtype=torch.float64)  # (n,)
        turns = torch.tensor([len(e.turns) for e in episodes] or [0], dtype=torch.float64)
        calls = [sum(len(t.tool_calls) for t in e.turns) for e in episodes]
        return {
            "engine_idle_share": max(0.0, 1.0 - round_.turns.busy_s / max(elapsed, 1e-9)),
            **_reward_metrics(returns, collector.config.group_size),
            "turns_per_episode": float(turns.mean()),
            "turns_max": float(turns.max()),
            "tool_call_rate": sum(c > 0 for c in calls) / n,  # episodes that called a tool at least once
            "tool_calls_per_episode": sum(calls) / n,
            "sampled_tokens_per_episode": 0.0 if batch is None else float(batch["response_tokens"].lengths().sum()) / n,
            "generation_batches": float(m["generation_batches"]),
            "retokenization_drift": float(m["retokenization_drift"]),
            "template_mismatch": float(m["template_mismatch"]),
            "environment_timeouts": float(m["environment_timeouts"]),
            **{name: float(count) for name, count in sorted(m.items())  # reason/env_done..., tools/ok, dropped/...
               if name.startswith(("reason/", "tools/", "dropped/"))},
        }


def _reward_metrics(returns: torch.Tensor, group_size: int) -> dict[str, float]:
    """Mean and spread of ``returns`` (n,), one per trajectory in groups of ``group_size``, and the share
    of groups whose returns differ (what GRPO learns from); 0 each when every group was dropped."""
    if not returns.numel():
        return {"reward_mean": 0.0, "reward_std": 0.0, "groups_with_signal": 0.0}
    spread = returns.reshape(-1, group_size).std(dim=1, unbiased=False) if group_size > 1 else torch.zeros(1)
    return {"reward_mean": float(returns.mean()), "reward_std": float(returns.std(unbiased=False)),
            "groups_with_signal": float((spread > 0).to(returns.dtype).mean())}
