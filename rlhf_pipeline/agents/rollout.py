"""Many episodes at once: each episode asks for its next turn as soon as its environment answered,
environments stepped concurrently, whole groups of whole trajectories handed back together.

An episode that fails drops its group, with the reason in :attr:`Rollout.failures`. The sampler is
an async ``sample_turn(episode, token_ids, max_new_tokens) -> (ids, log_probs)`` (the collector's
``collect/episodes.py`` asks the engine). Design: docs/architecture.md#episodes-are-token-lists.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
import traceback
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlhf_pipeline.agents.environment import (
    Environment,
    EnvironmentRunner,
    StepTimeout,
    ToolCall,
    describe_exception,
)
from rlhf_pipeline.agents.episode import Episode, EpisodeLimits, episodes_to_batch
from rlhf_pipeline.agents.tools import ToolBox
from rlhf_pipeline.schema import TerminationReason, TrajectoryBatch
from rlhf_pipeline.schema.fields import FLOAT32_MAX

Sample = tuple[list[int], list[float]]
TurnSampler = Callable[[int, list[int], int], Awaitable[Sample]]
"""``sample_turn(episode index, its token ids, its max_new_tokens)``: one episode's next turn, awaited."""


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


FAILURE_REASONS = ("reset_failed", "step_failed", "non_finite_reward")
"""Why an episode failed (and dropped its group): its environment could not be built, or its
``reset`` raised, timed out or opened with messages the template refused; its ``step`` raised,
returned something that is not a ``StepResult`` or messages the template refused; its reward was
NaN or infinite."""


@dataclass(frozen=True)
class EpisodeFailure:
    """One failed episode: its group (task index), its index in the rollout, why, and what happened."""

    group: int
    episode: int
    reason: str
    """One of :data:`FAILURE_REASONS`."""
    message: str
    """One line: what raised, with what, and where (``CalculatorEnv.step raised KeyError: 'x' at env.py:42``)."""


@dataclass
class Rollout:
    """Ended episodes of the groups kept, ``group_size`` per task in task order, and what was counted.

    ``kept_groups`` are the indices (in ``tasks``) of the groups whose episodes are in ``episodes``;
    the others were dropped, and ``failures`` says why."""

    tasks: list[Mapping[str, Any]]
    episodes: list[Episode]
    group_size: int
    metrics: Counter[str] = field(default_factory=Counter)
    kept_groups: list[int] | None = None
    """None: every task's group (nothing dropped)."""
    failures: list[EpisodeFailure] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.kept_groups is None:
            self.kept_groups = list(range(len(self.tasks)))

    def to_batch(self, *, first_group_id: int, first_trajectory_id: int, policy_version: int,
                 fields: Collection[str] = ()) -> TrajectoryBatch | None:
        """Every kept episode's rows (one per turn), with the ids :func:`groups_to_batch` gives them.
        None: every group was dropped."""
        g = self.group_size
        groups = [(i, self.episodes[k * g:(k + 1) * g]) for k, i in enumerate(self.kept_groups)]
        return groups_to_batch(groups, group_size=g, first_group_id=first_group_id,
                               first_trajectory_id=first_trajectory_id, policy_version=policy_version, fields=fields)


def groups_to_batch(groups: Sequence[tuple[int, Sequence[Episode]]], *, group_size: int, first_group_id: int,
                    first_trajectory_id: int, policy_version: int,
                    fields: Collection[str] = ()) -> TrajectoryBatch | None:
    """The rows of ended groups ``(task index, its episodes)``: task ``i``'s group id is ``first_group_id + i``
    and its episode ``j``'s trajectory id ``first_trajectory_id + i * group_size + j``, so a dropped group
    leaves its ids unused and ids depend on the task's place, not on what failed. None: no groups."""
    if not groups:
        return None
    return episodes_to_batch([e for _, episodes in groups for e in episodes],
                             group_ids=[first_group_id + i for i, episodes in groups for _ in episodes],
                             trajectory_ids=[first_trajectory_id + i * group_size + j
                                             for i, episodes in groups for j in range(len(episodes))],
                             policy_version=policy_version, fields=fields)


async def run_episodes(tasks: Sequence[Mapping[str, Any]], make_env: Callable[[], Environment],
                       sample_turn: TurnSampler, tokenizer, config: RolloutConfig = RolloutConfig(), *,
                       parser: Callable[[str], list[ToolCall]] | None = None,
                       stop_token_ids: Sequence[int] | None = None,
                       template_kwargs: Mapping[str, Any] | None = None,
                       on_groups_ended: Callable[[list[tuple[int, list[Episode] | None]]], None] | None = None,
                       episode_ended: Callable[[int], None] | None = None,
                       clock: Callable[[int], float] = lambda episode: time.monotonic()) -> Rollout:
    """Runs ``group_size`` episodes of each task to their ends. ``make_env()`` builds one episode's
    environment; one with a ``toolbox`` attribute (a :class:`~.tools.ToolBox`) has its tools'
    schemas rendered by the chat template, or one with ``tool_schemas`` (read after its reset:
    OpenAI-format function schemas, as :class:`~.verifiers_env.VerifiersEnvironment` has) those.
    An episode that fails drops its group (the module docstring).

    ``on_groups_ended(ended)``: called between turns with the groups whose episodes all ended since
    the last call, each as ``(task index, its episodes)``, or ``(task index, None)`` for a dropped
    group; every group comes once (the collector writes them there, ``collect/commit.py``).

    ``sample_turn``: each episode takes its turns on its own, its next turn asked for (awaited) as soon
    as its environment answered; the first error it raises ends the rollout. ``episode_ended(k)``:
    called once for each episode, when it asks for no more turns (or never started).

    ``clock(k)``: the seconds episode ``k``'s ``episode_timeout_s`` is measured in, read at its reset
    and after each of its steps (a test gives each episode a clock its own steps move, so whether it
    is overdue follows from its steps, not from the machine's speed or the other episodes')."""
    g = config.group_size
    n = len(tasks) * g
    failures: list[EpisodeFailure] = []
    dropped: dict[int, str] = {}  # group -> the reason of its first failure

    def fail(k: int, reason: str, message: str) -> None:
        failures.append(EpisodeFailure(k // g, k, reason, message))
        dropped.setdefault(k // g, reason)

    reported: set[int] = set()

    def report_ended() -> None:
        if on_groups_ended is None:
            return
        ended = [i for i in range(len(tasks)) if i not in reported
                 and (i in dropped or all(episodes[i * g + j].done for j in range(g)))]
        reported.update(ended)
        if ended:
            on_groups_ended([(i, None if i in dropped else episodes[i * g:(i + 1) * g]) for i in ended])

    metrics: Counter[str] = Counter()
    tool_counts: Counter[str] = Counter()  # every call this rollout's resets and steps made, as they ended
    with EnvironmentRunner(max_workers=config.max_workers, step_timeout_s=config.step_timeout_s) as runner:
        envs: list[Environment | None] = []
        for k in range(n):
            try:
                envs.append(make_env())
            except Exception as exc:
                envs.append(None)
                fail(k, "reset_failed", _failed_call("make_env()", exc))
        boxes = {id(box): box for env in envs if (box := getattr(env, "toolbox", None)) is not None}
        jobs = [task for task in tasks for _ in range(g)]
        live = [k for k in range(n) if envs[k] is not None]
        openings = await asyncio.gather(*(_outcome(runner.reset_counting_tools(envs[k], jobs[k])) for k in live))
        episodes: list[Episode | None] = [None] * n
        for k, (opened, exc) in zip(live, openings, strict=True):
            if exc is not None:
                fail(k, "reset_failed", _failed_call(f"{type(envs[k]).__name__}.reset", exc))
                continue
            messages, counts = opened
            tool_counts.update(counts)
            try:
                episodes[k] = Episode(tokenizer, messages, limits=config.limits, tools=_schemas(envs[k]),
                                      parser=parser, stop_token_ids=stop_token_ids, check_drift=config.check_drift,
                                      template_kwargs=template_kwargs)
            except Exception as exc:
                fail(k, "reset_failed", _failed_call(f"the opening messages of {type(envs[k]).__name__}.reset", exc))
        report_ended()
        started = {k: clock(k) for k in range(n) if episodes[k] is not None}

        def answer(k: int, stepped: Any, exc: Exception | None) -> None:
            """Episode ``k``'s environment answered (or raised): the answer goes on its token list."""
            where = f"{type(envs[k]).__name__}.step"
            if exc is not None:
                fail(k, "step_failed", _failed_call(where, exc))
                return
            result, tool_outcomes = stepped
            tool_counts.update(tool_outcomes)
            reward = result.reward
            if isinstance(reward, float) and not (math.isfinite(reward) and abs(reward) <= FLOAT32_MAX):
                beyond = ", beyond float32's range (±3.4e38), in which rewards are stored," if math.isfinite(reward) else ""
                fail(k, "non_finite_reward", f"{where} gave reward {reward}{beyond} at turn {len(episodes[k].turns) - 1}")
                return
            overdue = config.episode_timeout_s is not None and clock(k) - started[k] > config.episode_timeout_s
            if overdue and not result.done:
                result = dataclasses.replace(result, messages=[], done=True, reason=TerminationReason.TIMEOUT)
                metrics["episode_timeouts"] += 1
            try:
                episodes[k].add_environment(result, tool_outcomes)
            except Exception as exc:  # a reward set to text after construction, messages the template refuses
                fail(k, "step_failed", _failed_call(f"the answer of {where}", exc))

        def running(k: int) -> bool:
            return episodes[k] is not None and not episodes[k].done and k // g not in dropped

        ended = episode_ended or (lambda k: None)

        async def take_turns(k: int) -> None:
            try:
                while running(k):
                    ids, log_probs = await sample_turn(k, episodes[k].token_ids, episodes[k].max_new_tokens())
                    metrics["generation_batches"] += 1  # one request per turn
                    metrics["generated_rows"] += 1
                    if k // g in dropped:  # another episode of its group failed meanwhile: nothing is kept
                        return
                    turn = episodes[k].add_turn(ids, log_probs)
                    answer(k, *await _outcome(runner.step_counting_tools(envs[k], turn)))
                    report_ended()
            finally:
                ended(k)

        for k in range(n):
            if not running(k):
                ended(k)
        await _all_or_first_error([take_turns(k) for k in range(n) if running(k)])
        metrics["environment_timeouts"] = runner.timeouts
    kept_groups = [i for i in range(len(tasks)) if i not in dropped]
    kept = [episodes[i * g + j] for i in kept_groups for j in range(g)]
    for episode in kept:
        metrics.update(episode.metrics)
        metrics[f"reason/{episode.reason.name.lower()}"] += 1
        metrics["turns"] += len(episode.turns)
        metrics["tool_calls"] += sum(len(t.tool_calls) for t in episode.turns)
    metrics["groups_dropped"] = len(dropped)
    for reason in dropped.values():
        metrics[f"dropped/{reason}"] += 1
    if boxes or tool_counts:
        metrics.update({f"tools/{name}": tool_counts[name] for name in ToolBox.METRICS})
    return Rollout(list(tasks), kept, g, metrics, kept_groups, failures)


async def _all_or_first_error(coroutines: list[Awaitable[None]]) -> None:
    """Runs ``coroutines`` together; the first to raise (the engine failed) cancels the others and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    if not tasks:
        return
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for task in done:
        task.result()


async def _outcome(awaitable: Awaitable[Any]) -> tuple[Any, Exception | None]:
    """``(value, None)``, or ``(None, the exception)`` it raised: one episode's failure is its own."""
    try:
        return await awaitable, None
    except Exception as exc:
        return None, exc


def _failed_call(what: str, exc: Exception) -> str:
    """One line: what raised, the exception, and the innermost frame it came from."""
    if isinstance(exc, StepTimeout):
        return str(exc)
    frames = traceback.extract_tb(exc.__traceback__)
    at = f" at {frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames else ""
    return f"{what} raised {describe_exception(exc)}{at}"


def rollout(*args, **kwargs) -> Rollout:
    """:func:`run_episodes` from synchronous code (a fresh event loop)."""
    return asyncio.run(run_episodes(*args, **kwargs))


def _schemas(env: Environment) -> list[dict[str, Any]] | None:
    schemas = getattr(env, "tool_schemas", None)  # known after reset (verifiers_env.py: per task)
    if schemas is not None:
        return list(schemas)
    box = getattr(env, "toolbox", None)
    return box.schemas if box is not None else None
