"""The collector (:class:`Collector`): tasks in, groups of episodes run with the policy, scored rows out to a
sink. A round draws its tasks and every seed its episodes use at its start from the generator the
collector checkpoints, so rows never depend on timing; its groups (``episodes.py``) ask the engine
through ``turns.py`` and are written in group order (``commit.py``), each append with the state after
exactly its groups (``sink(rows, writer_state=state)``), so a collector killed at any moment runs the cut
round again from the same tasks and seeds and writes only the rest. ``group_id``/``trajectory_id`` are
``(collector_index << 40) | counter``; a dropped group leaves its ids unused.
Why one file: a round's draws, its episodes' requests, the in-order commit, ids, metrics and resume
state are one sequence whose parts must agree row for row.
Design: docs/collector.md#the-collector.
"""

from __future__ import annotations

import queue
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any

import torch

from rlhf_pipeline.collect.commit import InOrderCommit, partial_round, stored_in_round, without_stored
from rlhf_pipeline.collect.console import collector_tag, say
from rlhf_pipeline.collect.episodes import EndedGroup, Environments, SingleTurn
from rlhf_pipeline.collect.prompts import RecordCycle
from rlhf_pipeline.collect.rewards import check_failure_rate
from rlhf_pipeline.collect.turns import EngineTurns, RoundTurns
from rlhf_pipeline.setting_checks import SEEDS, Bounds, check_fields
from rlhf_pipeline.generation.engine import GenerationEngine, draw_seed
from rlhf_pipeline.generation.loop import LoopEngine
from rlhf_pipeline.generation.sampling import SamplingConfig
from rlhf_pipeline.schema import TrajectoryBatch
from rlhf_pipeline.schema.ids import MAX_COLLECTORS, id_base


@dataclass
class CollectorConfig:
    """Settings of one collector process."""

    tasks_per_round: Annotated[int, Bounds(ge=1)] = 8
    """Tasks per ``collect()`` call: a round writes ``tasks_per_round`` groups."""
    group_size: Annotated[int, Bounds(ge=1)] = 8
    """Episodes per task (GRPO's G); the write path's ``GroupAdvantage`` must use the same."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Temperature / top-k / top-p / max_new_tokens; the stored log-probs follow them (an agent turn's
    ``max_new_tokens`` is its episode's own limit)."""
    collector_index: int = 0
    """This collector's index among collectors writing one run; goes in the ids' high bits."""
    seed: Annotated[int, SEEDS] = 0
    """Seed of the collector's generator (mixed with ``collector_index`` so collectors differ)."""
    max_failed_group_fraction: Annotated[float | None, Bounds(ge=0, le=1)] = 0.1
    """Groups dropped (a reward that is not finite, an episode whose environment failed) may be at most
    this fraction of the groups run; past it ``collect`` raises ``EpisodeFailureRateError`` after
    writing its round, and the run stops. 0: the first drop stops it; None: never."""
    failure_rate_min_groups: Annotated[int, Bounds(ge=1)] = 32
    """The fraction above is taken over at least this many groups, so a few drops at the start do not
    stop a run (with 0.1 and 32, a fourth dropped group within the first 32 does)."""

    def __post_init__(self) -> None:
        check_fields(self, "CollectorConfig.")  # every number finite and within its Bounds
        if not 0 <= self.collector_index < MAX_COLLECTORS:
            raise ValueError(f"CollectorConfig.collector_index must be in [0, {MAX_COLLECTORS}), got {self.collector_index}")


COUNTERS = ("groups_emitted", "trajectories_emitted", "batches_emitted", "groups_dropped", "trajectories_written",
            "rows_written")
"""The id and pacing counters, saved in the state: ``groups_dropped`` is the failure rate's numerator;
``trajectories_written`` and ``rows_written`` the turns a trajectory has, for ``round_rows``."""

MetricsHook = Callable[[dict[str, float]], None]
Sink = Callable[..., Any]
"""``sink(rows | None, *, writer_state=state)``: stores whole groups with the collector's state after
them in one step (``ReplayBuffer.extend`` made by ``make_replay_buffer``); None: the state alone."""


@dataclass(eq=False)
class Round:
    """One round in flight: its tasks and seeds, drawn at its start, and what its episodes sent back."""

    tasks: list
    seeds: list[int]
    """One per single-turn group, one per agent episode, drawn from the collector's generator."""
    draws: dict[str, Any]
    """The task source's and the generator's state before this round's draws."""
    turns: RoundTurns
    first_group_id: int
    first_trajectory_id: int
    idle_before_s: float
    """Seconds the engine had nothing of this collector's before this round's requests went."""
    went_ahead: bool
    ended: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    """Lists of :class:`EndedGroup` as they end, an exception if the round failed, None once all ended."""
    start_state: dict[str, Any] | None = None
    """The collector's state at this round's start (what a restart runs it again from)."""
    requests: list = field(default_factory=list)  # a single-turn round's, one per group
    runner: Any = None  # an agent round's thread
    rollout: Any = None  # an agent round's episodes, once all ended
    rows_s: float = 0.0  # seconds building (and scoring) rows
    dropped: list[tuple[int, str, str]] = field(default_factory=list)  # (group index, reason, one line)
    parts: list[dict[str, torch.Tensor]] = field(default_factory=list)  # a single-turn round's reward parts
    trajectories_written: int = 0
    rows_written: int = 0


class Collector:
    """Runs groups of episodes with the policy, emits them whole in order; resumable; takes new weights.

    ``model``: the policy to sample with in this process (our sampling loop, ``LoopEngine``), or a
    :class:`~rlhf_pipeline.generation.engine.GenerationEngine`, which the collector then owns
    (:meth:`close` closes it); with :class:`Environments` its stop tokens must be the episodes' turn
    stop tokens. ``tasks``: a :class:`~rlhf_pipeline.collect.prompts.PromptSource` for
    :class:`SingleTurn` episodes, a :class:`~rlhf_pipeline.collect.prompts.TaskSource` for
    :class:`Environments`."""

    def __init__(self, model: Any, tokenizer, tasks: RecordCycle, episodes: SingleTurn | Environments,
                 sink: Sink | None, config: CollectorConfig | None = None, *, hooks: Sequence[MetricsHook] = ()) -> None:
        if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
            raise ValueError("Collector: the tokenizer needs pad_token_id and eos_token_id set")
        if not isinstance(episodes, (SingleTurn, Environments)):
            raise TypeError(f"Collector: episodes must be SingleTurn(rewards) or Environments(make_env, ...), got "
                            f"{type(episodes).__name__}")
        self.tokenizer = tokenizer
        self.tasks = tasks
        self.episodes = episodes
        self.sink = sink
        self.config = config or CollectorConfig()
        self.hooks = list(hooks)
        stops = episodes.turn_stop_ids(tokenizer)
        if isinstance(model, GenerationEngine):
            if isinstance(episodes, Environments) and episodes.stop_token_ids is not None and stops != model.stop_token_ids:
                raise ValueError(f"Collector: stop_token_ids {stops} differ from the engine's {model.stop_token_ids}; "
                                 f"build the engine with the turn's stop tokens")
            self.engine = model
        else:
            self.engine = LoopEngine(model, pad_token_id=tokenizer.pad_token_id, eos_token_id=stops)
        self._turns = EngineTurns(self.engine, self.config.sampling)  # refuses what the engine cannot honour
        self.runner_state: dict[str, Any] = {}
        """The runner's own state (its row clock), saved in and restored from :meth:`state_dict`."""
        for name in COUNTERS:
            setattr(self, name, 0)
        self.generator = torch.Generator()  # the round's seeds, drawn with its tasks
        self.generator.manual_seed(self.config.seed * MAX_COLLECTORS + self.config.collector_index)
        self.last_metrics: dict[str, float] = {}
        self._ahead: Round | None = None  # the next round, started while the last one's tail ran
        self._stored_in_round = 0  # a cut-off round's groups already stored: not written again
        self._idle_since: float | None = None  # when the engine last had nothing of this collector's

    # ---------------------------------------------------------------- one round
    def collect(self, next_round: Callable[[int], bool] | None = None) -> TrajectoryBatch | None:
        """One round of whole groups, each written once it and every group before it ended, each append
        with the state after its groups; metrics reported. Returns the round's rows (None when every
        group was dropped: the sink then got the state alone). ``next_round(rows not appended yet)``:
        asked once, when the round's first groups ended; True starts the next round now."""
        started = time.perf_counter()
        round_, self._ahead = self._ahead or self._start_round(None), None
        round_.start_state = self._state(round_.draws)  # every earlier round is counted now
        chunks: list[TrajectoryBatch] = []

        def write(groups: list[EndedGroup], last: bool) -> None:
            began = time.perf_counter()
            rows = self.episodes.rows(self, round_, groups)  # its dropped groups go to round_.dropped
            round_.rows_s += time.perf_counter() - began
            if rows is not None:
                round_.trajectories_written += len(set(rows["trajectory_id"].tolist()))
                round_.rows_written += len(rows)
                chunks.append(rows)
            state = (self._state(self._draws(), counted=round_) if last
                     else partial_round(round_.start_state, groups[-1].index + 1))
            unstored = without_stored(rows, round_.first_group_id, self._stored_in_round)
            if self.sink is not None and (last or unstored is not None):  # the last append goes even with no rows
                self.sink(unstored, writer_state=state)

        commit = InOrderCommit(len(round_.tasks), write, started)
        try:
            for ended in self._ended(round_):
                if next_round is not None:  # asked once, when the first slots of the engine came free
                    rows_to_come = self.round_rows * (commit.count - commit.written) // commit.count
                    if next_round(rows_to_come):
                        self._ahead = self._start_round(round_)
                    next_round = None
                commit.add(ended)
            self.episodes.finish(round_)
            commit.finish()
        except BaseException:
            self._abandon(round_)  # (load_state_dict abandons the round started ahead)
            # a retry runs the round again from its start, writing only its groups not stored yet
            self.load_state_dict(partial_round(round_.start_state, max(self._stored_in_round, commit.written)))
            raise
        if self._ahead is None:
            self._idle_since = time.perf_counter()
        # counters advance only once the sink has the rows, so a failed write is retried with the same ids
        for name, value in self._counts(round_).items():
            setattr(self, name, value)
        self._stored_in_round = 0
        tag = collector_tag(self.config.collector_index)
        failures = self.episodes.failures(round_)
        for index, reason, line in failures:
            say(f"{tag} round {self.batches_emitted}: dropped group {round_.first_group_id + index} ({reason}): "
                f"{line.removeprefix(reason + ': ')}")
        batch = TrajectoryBatch.cat(chunks) if len(chunks) > 1 else chunks[0] if chunks else None
        self._report(round_, batch, time.perf_counter() - started, commit.metrics())
        check_failure_rate(self.groups_dropped, self.groups_emitted, self.config.max_failed_group_fraction,
                           self.config.failure_rate_min_groups, failures[-1][2] if failures else None,
                           over=self.episodes.drops_over)
        return batch

    def _start_round(self, after: Round | None) -> Round:
        """Draws a round's tasks and seeds and starts its episodes; ``after``: the round in flight it follows."""
        cfg = self.config
        draws = {"tasks": self.tasks.state_dict(), "rng": self.generator.get_state()}
        tasks = self.tasks.next_batch(cfg.tasks_per_round)
        seeds = [draw_seed(self.generator) for _ in range(len(tasks) * self.episodes.seeds_per_group(cfg.group_size))]
        groups_before = self.groups_emitted + (len(after.tasks) if after is not None else 0)
        base = id_base(cfg.collector_index)
        idle = 0.0 if self._idle_since is None else time.perf_counter() - self._idle_since
        self._idle_since = None
        round_ = Round(tasks, seeds, draws, self._turns.round(len(seeds)), base + groups_before,
                       base + groups_before * cfg.group_size, idle, went_ahead=after is not None)
        self.episodes.start(self, round_)
        return round_

    def _ended(self, round_: Round):
        """The round's groups as they end, in lists that ended together; raises what failed the round."""
        while True:
            items = [round_.ended.get()]
            while not round_.ended.empty():  # this is its one reader
                items.append(round_.ended.get_nowait())
            for item in items:
                if isinstance(item, BaseException):
                    raise item
            if groups := [group for item in items if item is not None for group in item]:
                yield groups
            if None in items:
                return

    def _abandon(self, round_: Round | None) -> None:
        """Stops a round that will not be written: its held and queued requests dropped, its episodes ended."""
        if round_ is None:
            return
        round_.turns.cancel()
        self.episodes.finish(round_)

    def _counts(self, round_: Round | None = None) -> dict[str, int]:
        """The id and pacing counters, with ``round_``'s in when given."""
        added = {} if round_ is None else {
            "groups_emitted": len(round_.tasks), "trajectories_emitted": len(round_.tasks) * self.config.group_size,
            "batches_emitted": 1, "groups_dropped": len(round_.dropped),
            "trajectories_written": round_.trajectories_written, "rows_written": round_.rows_written}
        return {name: getattr(self, name) + added.get(name, 0) for name in COUNTERS}

    def _report(self, round_: Round, batch: TrajectoryBatch | None, elapsed: float, streamed: dict[str, float]) -> None:
        reasons = {f"dropped/{r}": float(n) for r, n in Counter(r for _, r, _ in round_.dropped if r).items()}
        rows = 0 if batch is None else len(batch)
        metrics = {
            "rows": float(rows),
            "rows_per_s": rows / max(elapsed, 1e-9),
            "generate_s": round_.turns.busy_s,  # seconds the engine had at least one request of the round
            **self.episodes.metrics(self, round_, batch, elapsed),
            "groups_dropped": float(len(round_.dropped)),
            "groups_dropped_total": float(self.groups_dropped),
            **reasons,
            "policy_version": float(self.policy_version),
            "batches": float(self.batches_emitted),
            "trajectories": float(self.trajectories_emitted),
            **self.engine.stats.update_metrics(),
            "engine_idle_s": round_.idle_before_s,
            "submitted_ahead": float(round_.went_ahead),
            **streamed,  # when the round's first and last groups were committed (collect/commit.py)
        }
        self.last_metrics = metrics
        for hook in self.hooks:
            hook(metrics)

    @property
    def round_rows(self) -> int:
        """Rows a round is expected to write: its trajectories times the rows (turns) a trajectory has had
        so far, one before any round (exact for single-turn episodes). Pacing counts rounds in them and
        never needs them exact (``coordination/pacing.py``)."""
        trajectories = self.config.tasks_per_round * self.config.group_size
        if not self.trajectories_written:
            return trajectories
        return max(1, round(trajectories * self.rows_written / self.trajectories_written))

    # ---------------------------------------------------------------- weights
    @property
    def policy_version(self) -> int:
        """The version of the weights the engine holds: what the next rows are tagged with."""
        return self.engine.policy_version

    def set_policy_state(self, state_dict, version: int) -> None:
        """Loads new policy weights into the engine (all keys must match; versions only move forward);
        later rows name ``version``."""
        if self._ahead is not None and version != self.policy_version:
            raise RuntimeError(f"set_policy_state: version {version} while a round started ahead samples with "
                               f"version {self.policy_version}; weights change between rounds only: collect it first")
        self.engine.load_weights(state_dict, version)

    @property
    def has_round_ahead(self) -> bool:
        """The next round started while the last one's tail ran: the next :meth:`collect` reads it."""
        return self._ahead is not None

    @property
    def continues_a_round(self) -> bool:
        """The next :meth:`collect` goes on with a round already started, which keeps the weights it started
        with: one started ahead, or one written in part before the last stop (its rest sampled with any
        other version would not be the uninterrupted run's rows)."""
        return self._ahead is not None or self._stored_in_round > 0

    def close(self) -> None:
        """Abandons a round started ahead and closes the engine (a vLLM engine's process)."""
        self._abandon(self._ahead)
        self._ahead = None
        self.engine.close()

    # ---------------------------------------------------------------- resume
    def _state(self, draws: dict[str, Any], counted: Round | None = None) -> dict[str, Any]:
        """The state with the task source and generator as in ``draws`` and the counters as they are,
        ``counted``'s in."""
        cfg = self.config
        return {
            "tasks": draws["tasks"],
            **self._counts(counted),
            "policy_version": self.policy_version,
            "runner": dict(self.runner_state),
            "rng": draws["rng"],
            "config": {"collector_index": cfg.collector_index, "seed": cfg.seed, "group_size": cfg.group_size,
                       "sampling": asdict(cfg.sampling)},
        }

    def _draws(self) -> dict[str, Any]:
        """The task source and generator before the next round's draws (undone for a round started ahead)."""
        if self._ahead is not None:
            return self._ahead.draws
        return {"tasks": self.tasks.state_dict(), "rng": self.generator.get_state()}

    def state_dict(self) -> dict[str, Any]:
        """The state between rounds (a round started ahead is drawn again from it)."""
        return self._state(self._draws())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._abandon(self._ahead)  # drawn from the state being replaced
        self._ahead = None
        if state["config"]["collector_index"] != self.config.collector_index:
            raise ValueError(f"collector state belongs to collector_index {state['config']['collector_index']}, "
                             f"this is collector {self.config.collector_index}; restore each collector from its own state")
        # a single-turn collector's state saved before there was one collector names its task position prompts
        self.tasks.load_state_dict(state["tasks"] if "tasks" in state else state["prompts"])
        for name in COUNTERS:
            setattr(self, name, int(state.get(name, 0)))
        # the saved policy_version is not restored: rows name the version the engine holds, and the
        # caller loads the newest published weights next (collect_main does)
        self.generator.set_state(state["rng"])
        self._stored_in_round = stored_in_round(state)
        self.runner_state = dict(state["runner"])
