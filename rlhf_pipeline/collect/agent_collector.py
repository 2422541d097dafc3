"""The agent collector: multi-turn, tool-using episodes into the buffer, whole groups at a time.

One ``collect()`` call is one round: ``tasks_per_round`` tasks from a :class:`TaskSource`,
``group_size`` episodes of each (a GRPO group), run to their ends by
:func:`rlhf_pipeline.agents.rollout.run_episodes` with the collector's generation engine
(``generation/engine.py``; vLLM's prefix cache holds the earlier turns) as the sampler: each
episode's next turn (its token ids so far, its own limit) asked for as soon as its environment
answered (``collect/agent_turns.py``). Each group goes to ``sink`` (typically ``ReplayBuffer.extend``
with the write path attached) once its episodes and every earlier group's ended
(``collect/agent_streaming.py``), so:

* an episode that is still running is never in the buffer, nor is part of a group (appends are atomic);
* a trajectory's rows are contiguous and in step order (one row per model turn, ``step`` = turn
  index, the last ``done`` with its ``termination_reason``), trajectories of a group together;
* the write path's :class:`~rlhf_pipeline.transforms.group_advantage.GroupAdvantage` sees whole
  groups of whole trajectories: it sums each trajectory's turn rewards into one return, computes
  the group-relative advantage of that return and writes it on every turn of the trajectory.

Rewards are the environment's (``StepResult.reward`` per turn); a trajectory's return is their sum.
An episode that fails (its environment raises in ``reset`` or ``step``, or gives a reward that is
not finite) drops its group, not the round: the other groups are written, the dropped ones are
counted by reason in the round's metrics (``groups_dropped``, ``dropped/<reason>``) and each is
said in one line on stderr. Their ids stay unused, so the rows a round writes depend on the
tasks, the sampling RNG and the environment only: a collector resumed before such a round drops
the same groups and writes the same rows. Past ``max_failed_group_fraction`` of the groups run
(counted over at least ``failure_rate_min_groups``), :meth:`AgentCollector.collect` raises
:class:`EpisodeFailureRateError`, one line saying how many failed and the last reason.
Each row also holds its turn's ``tool_calls`` and ``tool_errors``, counted per turn by the
``ToolBox`` the environment ran them through, so ``filter`` and ``inspect`` can pick out
trajectories whose tool use failed, and its ``turn_messages`` (the chat messages with their
roles), so ``export --format chat`` writes the conversation (``AgentCollectorConfig.row_fields``).

Ids and resume are the single-turn :class:`~rlhf_pipeline.collect.collector.Collector`'s:
``(collector_index << 40) | counter`` with the counters, the task position and the sampling RNG
in :meth:`AgentCollector.state_dict`, each sink call carrying the state after exactly its groups
(``sink(rows, writer_state=state)``, one atomic append). Episodes in flight are not saved: a
collector killed mid-round (``kill -9``) runs the round again from the round's start state on
restart and writes only the groups it had not (``collect/streaming.py``), so it neither duplicates
nor loses a trajectory and never stores half of one. Sampling on a CPU is deterministic, so the rerun gives the same rows (with
vLLM: the same seeds, request by request; its logits may differ in the last bits with another batch
or a cold prefix cache, which ``generation/engine.py`` says of every engine that samples elsewhere).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhf_pipeline.agents.environment import Environment, ToolCall
from rlhf_pipeline.agents.episode import AGENT_ROW_FIELDS, EpisodeLimits
from rlhf_pipeline.agents.rollout import Rollout, RolloutConfig, rollout
from rlhf_pipeline.collect.agent_streaming import round_stream, write_round
from rlhf_pipeline.collect.streaming import partial_round, stored_in_round, without_stored
from rlhf_pipeline.collect.agent_metrics import round_metrics
from rlhf_pipeline.collect.agent_turns import EpisodeTurns, episode_seeds
from rlhf_pipeline.collect.collector import MetricsHook, Sink
from rlhf_pipeline.collect.console import collector_tag, say
from rlhf_pipeline.collect.rewards import EpisodeFailureRateError, check_failure_fraction, check_failure_rate
from rlhf_pipeline.generation.engine import GenerationEngine
from rlhf_pipeline.generation.loop import LoopEngine
from rlhf_pipeline.generation.sampling import SamplingConfig
from rlhf_pipeline.collect.prompts import TaskSource
from rlhf_pipeline.schema import TrajectoryBatch
from rlhf_pipeline.schema.ids import MAX_COLLECTORS, id_base
from rlhf_pipeline.finite_settings import check_fields


@dataclass
class AgentCollectorConfig:
    """Settings of one agent collector process."""

    tasks_per_round: int = 4
    """Tasks per ``collect()`` call; a round writes ``tasks_per_round`` groups."""
    group_size: int = 4
    """Episodes per task (GRPO's G); the write path's ``GroupAdvantage`` must use the same."""
    limits: EpisodeLimits = field(default_factory=EpisodeLimits)
    """Turns, tokens per turn, token budget and context of each episode."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Temperature / top-k / top-p; its ``max_new_tokens`` is replaced by each turn's own limit."""
    step_timeout_s: float | None = 60.0
    """Per environment ``reset``/``step``; past it the episode ends with ``TIMEOUT``."""
    episode_timeout_s: float | None = None
    """Wall-clock seconds of a round's episodes from their reset; past it, after the step in
    progress, they end with ``TIMEOUT`` (``RolloutConfig.episode_timeout_s``)."""
    max_workers: int = 16
    """Threads stepping synchronous environments."""
    check_drift: bool = True
    """Count ``retokenization_drift`` each turn (one extra encode of the conversation)."""
    row_fields: tuple[str, ...] = AGENT_ROW_FIELDS
    """Optional fields stored on each turn's row: ``tool_calls``, ``tool_errors`` (its tool calls and
    the failed ones) and ``turn_messages`` (its chat messages, for ``export --format chat``). The
    buffer must hold each; leave out those a buffer was created without."""
    collector_index: int = 0
    """This collector's index among collectors writing one run; goes in the ids' high bits."""
    seed: int = 0
    """Seed of the sampling RNG (mixed with ``collector_index`` so collectors differ)."""
    max_failed_group_fraction: float | None = 0.1
    """Groups dropped because an episode failed (its environment raised, or gave a reward that is
    not finite) may be at most this fraction of the groups run; past it ``collect`` raises
    :class:`EpisodeFailureRateError` and the run stops. 0: the first failure stops it; None: never."""
    failure_rate_min_groups: int = 32
    """The fraction above is taken over at least this many groups, so a few failures at the start
    do not stop a run (with 0.1 and 32, a fourth failed group within the first 32 does)."""

    def __post_init__(self) -> None:
        if self.tasks_per_round < 1 or self.group_size < 1:
            raise ValueError("AgentCollectorConfig: tasks_per_round and group_size must be >= 1")
        check_failure_fraction(self.max_failed_group_fraction, self.failure_rate_min_groups, "AgentCollectorConfig")
        check_fields(self, "AgentCollectorConfig.")  # turns is one of its choices; every number finite
        unknown = sorted(set(self.row_fields) - set(AGENT_ROW_FIELDS))
        if unknown:
            raise ValueError(f"AgentCollectorConfig.row_fields: {unknown} are not fields an episode fills; "
                             f"choose from {list(AGENT_ROW_FIELDS)}")
        if not 0 <= self.collector_index < MAX_COLLECTORS:
            raise ValueError(f"AgentCollectorConfig.collector_index must be in [0, {MAX_COLLECTORS}), "
                             f"got {self.collector_index}")


class AgentCollector:
    """Runs groups of episodes with the policy, emits them whole; resumable; takes new weights.

    ``make_env()`` builds one episode's environment (:class:`~rlhf_pipeline.agents.environment.Environment`);
    ``parser`` finds tool calls in the model's text (``rlhf_pipeline.agents.tools``);
    ``stop_token_ids`` end a model turn (default: the tokenizer's EOS). ``model``: the policy to
    sample with in this process (our sampling loop), or a
    :class:`~rlhf_pipeline.generation.engine.GenerationEngine`, whose own stop tokens must then be
    ``stop_token_ids``; the collector owns it (:meth:`close`).
    """

    def __init__(
        self,
        model,
        tokenizer,
        tasks: TaskSource,
        make_env: Callable[[], Environment],
        sink: Sink | None,
        config: AgentCollectorConfig | None = None,
        *,
        parser: Callable[[str], list[ToolCall]] | None = None,
        stop_token_ids: Collection[int] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        policy_version: int = 0,
        hooks: Sequence[MetricsHook] = (),
    ) -> None:
        if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
            raise ValueError("AgentCollector: the tokenizer needs pad_token_id and eos_token_id set")
        self.tokenizer = tokenizer
        self.tasks = tasks
        self.make_env = make_env
        self.sink = sink
        self.config = config or AgentCollectorConfig()
        self.parser = parser
        self.stop_token_ids = sorted(stop_token_ids if stop_token_ids is not None else [tokenizer.eos_token_id])
        self.template_kwargs = dict(template_kwargs or {})
        self.hooks = list(hooks)
        if isinstance(model, GenerationEngine):
            if stop_token_ids is not None and sorted(stop_token_ids) != model.stop_token_ids:
                raise ValueError(f"AgentCollector: stop_token_ids {self.stop_token_ids} differ from the engine's "
                                 f"{model.stop_token_ids}; build the engine with the turn's stop tokens")
            self.engine = model
            self.stop_token_ids = model.stop_token_ids
        else:
            self.engine = LoopEngine(model, pad_token_id=tokenizer.pad_token_id, eos_token_id=self.stop_token_ids,
                                     policy_version=policy_version)
        self.engine.check_sampling(self.config.sampling)
        self._stored_in_round = 0  # a cut-off streamed round's groups already stored: not written again
        self.runner_state: dict[str, Any] = {}
        """The runner's own state (its row clock), saved in and restored from :meth:`state_dict`."""
        self.groups_emitted = 0
        self.trajectories_emitted = 0
        self.batches_emitted = 0
        self.groups_dropped = 0  # over every round, resumed with the state: the failure rate's numerator
        # rows and trajectories this process wrote: the turns a trajectory has, for round_rows
        self._rows_written = self._trajectories_written = 0
        self.generator = torch.Generator()  # seeds: one per request, or per episode
        self.generator.manual_seed(self.config.seed * MAX_COLLECTORS + self.config.collector_index)
        self.last_metrics: dict[str, float] = {}
        self._generate_s = 0.0

    @property
    def trajectories_per_round(self) -> int:
        return self.config.tasks_per_round * self.config.group_size

    @property
    def round_rows(self) -> int:
        """Rows a round is expected to write: its trajectories times the rows (turns) a trajectory
        has had so far in this process, one before any round. Turns vary, so this is an estimate;
        pacing counts rounds ahead with it and never needs it to be exact (``coordination/pacing.py``)."""
        if not self._trajectories_written:
            return self.trajectories_per_round
        return max(1, round(self.trajectories_per_round * self._rows_written / self._trajectories_written))

    # ---------------------------------------------------------------- one round
    def collect(self, next_round: Callable[[int], bool] | None = None) -> TrajectoryBatch | None:
        """One round of whole groups: run the episodes to their ends, each episode's next turn sent as
        soon as its environment answered (``collect/agent_turns.py``), each group written once its
        episodes and every earlier group's ended (``collect/agent_streaming.py``), each append with the
        state after its groups. Returns the round's rows, or None when every group was dropped (the
        sink then gets the state alone). Agent rounds are not submitted ahead: ``next_round`` is never
        asked."""
        cfg = self.config
        started = time.perf_counter()
        self._generate_s = 0.0
        start_state = self.state_dict()
        tasks = self.tasks.next_batch(cfg.tasks_per_round)
        base = id_base(cfg.collector_index)
        stream = round_stream(self, len(tasks), start_state, started)
        try:
            # one seed per episode, in episode order, before any turn: rows do not depend on timing
            turns = EpisodeTurns(self.engine, cfg.sampling, episode_seeds(self.generator, len(tasks) * cfg.group_size))
            result = rollout(tasks, self.make_env, turns.sample_turn, self.tokenizer, RolloutConfig(
                group_size=cfg.group_size, limits=cfg.limits, step_timeout_s=cfg.step_timeout_s,
                episode_timeout_s=cfg.episode_timeout_s, max_workers=cfg.max_workers, check_drift=cfg.check_drift),
                parser=self.parser, stop_token_ids=self.stop_token_ids, template_kwargs=self.template_kwargs,
                on_groups_ended=stream.groups_ended, episode_ended=turns.episode_ended)
            self._generate_s = turns.busy_s
            batch = result.to_batch(first_group_id=base + self.groups_emitted,
                                    first_trajectory_id=base + self.trajectories_emitted,
                                    policy_version=self.policy_version, fields=cfg.row_fields)
            # a dropped group's ids stay unused: ids follow the tasks, whatever failed
            n_traj = len(tasks) * cfg.group_size
            dropped = len(tasks) - len(result.kept_groups)
            state_after = lambda: self.state_dict(  # noqa: E731
                rounds_ahead=(1, len(tasks), n_traj), dropped_ahead=dropped,
                written_ahead=(len(result.episodes), 0 if batch is None else len(batch)))
            streamed = write_round(stream, batch, state_after, self._commit)
        except BaseException:
            stored = max(self._stored_in_round, stream.stored)
            if stored:  # part of the round is stored: a retry runs it again and writes only the rest
                self.load_state_dict(partial_round(start_state, stored))
            raise
        self._stored_in_round = 0
        # counters advance only once the sink has the rows, so a failed write is retried with the same ids
        self.groups_emitted += len(tasks)
        self.trajectories_emitted += n_traj
        self.batches_emitted += 1
        self.groups_dropped += dropped
        self._trajectories_written += len(result.episodes)
        self._rows_written += 0 if batch is None else len(batch)
        self._say_failures(result)
        self._report(result, batch, time.perf_counter() - started, streamed)
        self._check_failure_rate(result)
        return batch

    def _say_failures(self, result: Rollout) -> None:
        """One line on stderr per dropped group: the collector's log says what failed and where."""
        base = id_base(self.config.collector_index) + self.groups_emitted - len(result.tasks)
        first = {}
        for failure in result.failures:
            first.setdefault(failure.group, failure)
        for group, failure in sorted(first.items()):
            say(f"{collector_tag(self.config.collector_index)} round {self.batches_emitted}: dropped group "
                f"{base + group} ({failure.reason}): {failure.message}")

    def _check_failure_rate(self, result: Rollout) -> None:
        last = result.failures[-1] if result.failures else None
        check_failure_rate(self.groups_dropped, self.groups_emitted, self.config.max_failed_group_fraction,
                           self.config.failure_rate_min_groups,
                           None if last is None else f"{last.reason}: {last.message}", "AgentCollectorConfig",
                           over="failed episodes")

    def _commit(self, batch: TrajectoryBatch | None, state: dict[str, Any], last: bool) -> None:
        """``batch`` (consecutive groups of this round; None: all dropped) to the sink with the state
        after them, less the groups a cut-off round stored before; the round's last call goes even
        with no rows."""
        if batch is not None:
            batch = without_stored(batch, id_base(self.config.collector_index) + self.groups_emitted,
                                   self._stored_in_round)
        rows = batch if batch is not None and len(batch) else None
        if self.sink is not None and (last or rows is not None):
            self.sink(rows, writer_state=state)

    def _report(self, result: Rollout, batch: TrajectoryBatch | None, elapsed: float,
                streamed: dict[str, float]) -> None:
        self.last_metrics = metrics = round_metrics(self, result, batch, elapsed, self._generate_s, streamed)
        for hook in self.hooks:
            hook(metrics)

    # ---------------------------------------------------------------- weights
    def set_policy_state(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Loads new policy weights (all keys must match) and tags later rows with ``version``."""
        if version < self.policy_version:
            raise ValueError(f"set_policy_state: version {version} is older than the current "
                             f"{self.policy_version}; weights only move forward")
        self.engine.load_weights(state_dict, version)

    @property
    def policy_version(self) -> int:
        """The version of the weights the engine holds (weights change between rounds only, so a
        round's rows all name one)."""
        return self.engine.policy_version

    def close(self) -> None:
        """Closes the engine (stops a vLLM engine's process)."""
        self.engine.close()

    @property
    def continues_a_round(self) -> bool:
        """The next :meth:`collect` goes on with the round written in part before the last stop, which
        keeps the weights it started with (its rest sampled with another version would not be the
        uninterrupted run's rows)."""
        return self._stored_in_round > 0

    # ---------------------------------------------------------------- resume
    def state_dict(self, rounds_ahead: tuple[int, int, int] = (0, 0, 0), dropped_ahead: int = 0,
                   written_ahead: tuple[int, int] = (0, 0)) -> dict[str, Any]:
        """``rounds_ahead``: (rounds, groups, trajectories) not yet counted but to be included;
        ``dropped_ahead``: of those groups, the dropped ones; ``written_ahead``: (trajectories,
        rows) those rounds write, which :attr:`round_rows` estimates from (so a resumed collector
        paces as the uninterrupted one did)."""
        batches, groups, trajectories = rounds_ahead
        cfg = self.config
        return {
            "tasks": self.tasks.state_dict(),
            "groups_emitted": self.groups_emitted + groups,
            "trajectories_emitted": self.trajectories_emitted + trajectories,
            "batches_emitted": self.batches_emitted + batches,
            "groups_dropped": self.groups_dropped + dropped_ahead,
            "trajectories_written": self._trajectories_written + written_ahead[0],
            "rows_written": self._rows_written + written_ahead[1],
            "policy_version": self.policy_version,
            "runner": dict(self.runner_state),
            "rng": self.generator.get_state(),
            "config": {"collector_index": cfg.collector_index, "seed": cfg.seed, "group_size": cfg.group_size,
                       "sampling": dataclasses.asdict(cfg.sampling), "limits": dataclasses.asdict(cfg.limits)},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = state["config"]["collector_index"]
        if saved != self.config.collector_index:
            raise ValueError(f"collector state belongs to collector_index {saved}, this is collector "
                             f"{self.config.collector_index}; restore each collector from its own state")
        if "tasks" not in state:
            raise ValueError("this collector state was saved by a single-turn Collector (it has prompts, not "
                             "tasks); an agent collector cannot resume from it")
        self.tasks.load_state_dict(state["tasks"])
        self.groups_emitted = int(state["groups_emitted"])
        self.trajectories_emitted = int(state["trajectories_emitted"])
        self.batches_emitted = int(state["batches_emitted"])
        self.groups_dropped = int(state.get("groups_dropped", 0))  # saved before groups could be dropped: none
        # saved before pacing estimated a round's rows: the estimate starts again
        self._trajectories_written = int(state.get("trajectories_written", 0))
        self._rows_written = int(state.get("rows_written", 0))
        # the saved policy_version is not restored: rows name the version the engine holds, and the
        # caller loads the newest published weights next (collect_main does)
        self.generator.set_state(state["rng"])
        self._stored_in_round = stored_in_round(state)
        self.runner_state = dict(state["runner"])

