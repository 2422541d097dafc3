"""The collector: prompts in, scored ``TrajectoryBatch`` rows out to a sink.

Why one file: a round's sampling, scoring, ids, metrics and resume state are one sequence whose
parts must agree row for row (streaming and rounds ahead have their own modules).

One ``collect()`` call takes ``prompts_per_batch`` prompts from the source and draws one seed per
prompt, submits a request for ``num_generations`` completions of each to its generation engine
(``generation/engine.py``: our sampling loop by default, vLLM with ``generation.engine=vllm``; the
collector does not know which), and as each group is answered scores it and hands it to ``sink``
(typically ``ReplayBuffer.extend`` with the write-path transforms attached) once every group before
it went, in group-id order (``collect/streaming.py``); the next round may be submitted while this
one's tail decodes (``collect/overlap.py``). Each row's ``policy_version`` is the version the engine
held when it sampled the row's group.

Ids. ``group_id`` and ``trajectory_id`` are ``(collector_index << 40) | counter`` with
counters that live in :meth:`Collector.state_dict`, so ids stay unique across
collector processes (different indices) and restarts (counters resume). Every row
is a single-turn trajectory: ``step`` 0, ``done`` True, ``terminated`` when the
completion ended on EOS, ``truncated`` when it hit ``max_new_tokens``. A group with a NaN or
infinite reward is dropped, not the run, as the agent collector drops one: its ids stay unused, it
is counted in the round's metrics (``groups_dropped``, ``dropped/non_finite_reward``) and said in
one line on stderr, and a collector resumed before the round drops it again.

Resume. ``state_dict()`` holds the prompt position, the id counters, the policy version, the
sampling RNG and the pacing counts. Every call of the sink carries the state after exactly the
groups it holds (``sink(rows, writer_state=state)``; ``ReplayBuffer.extend`` publishes the two in
one atomic append, ``storage/writer_state.py``), so a collector restored from the store's last
``writer_state`` continues where the stored rows end: nothing is skipped or repeated, after a
``kill -9`` at any moment too. Within a round that state is the round's start and the groups of it
stored (``collect/streaming.py``): the round is generated again from the same prompts and seeds,
and only its groups not stored yet are written.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from rlhf_pipeline.collect.prompts import PromptSource
from rlhf_pipeline.collect.console import collector_tag, say
from rlhf_pipeline.collect.rewards import (RewardFn, WeightedReward, as_rewards, check_failure_fraction,
                                           check_failure_rate, drop_non_finite_groups, score)
from rlhf_pipeline.collect.overlap import IdleClock, Round, read_round
from rlhf_pipeline.collect.streaming import (InOrderCommit, StreamTiming, Submitted, partial_round, stored_in_round,
                                             without_stored)
from rlhf_pipeline.generation.engine import GenerationEngine, SampleRequest, draw_seed
from rlhf_pipeline.generation.loop import LoopEngine
from rlhf_pipeline.generation.sampling import SamplingConfig
from rlhf_pipeline.schema.ids import MAX_COLLECTORS, id_base
from rlhf_pipeline.finite_settings import check_fields
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
    max_failed_group_fraction: float | None = 0.1
    """Groups dropped for a reward that is not finite may be at most this fraction of the groups run;
    past it ``collect`` raises :class:`~rlhf_pipeline.collect.rewards.EpisodeFailureRateError` after
    writing its round, and the run stops (the agent collector's rule). 0: the first drop stops it;
    None: never."""
    failure_rate_min_groups: int = 32
    """The fraction above is taken over at least this many groups."""

    def __post_init__(self) -> None:
        if self.prompts_per_batch < 1 or self.num_generations < 1:
            raise ValueError("CollectorConfig: prompts_per_batch and num_generations must be >= 1")
        if not 0 <= self.collector_index < MAX_COLLECTORS:
            raise ValueError(f"CollectorConfig.collector_index must be in [0, {MAX_COLLECTORS}), got {self.collector_index}")
        check_failure_fraction(self.max_failed_group_fraction, self.failure_rate_min_groups, "CollectorConfig")
        check_fields(self, "CollectorConfig.")  # what the ranges above let through: every number finite


MetricsHook = Callable[[dict[str, float]], None]
Sink = Callable[..., Any]
"""``sink(rows | None, *, writer_state=state)``: stores whole groups with the collector's state after
them in one step (``ReplayBuffer.extend`` made by ``make_replay_buffer``); None: the state alone."""


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
        sink: Sink | None,
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
        self._ahead: Round | None = None  # the next round, submitted while the current one decoded
        self._idle = IdleClock()
        self._stored_in_round = 0  # a cut-off streamed round's groups already stored: not written again
        self.runner_state: dict[str, Any] = {}
        """The runner's own state (its row clock), saved in and restored from :meth:`state_dict`."""
        self.groups_emitted = 0
        self.trajectories_emitted = 0
        self.batches_emitted = 0
        self.generator = torch.Generator()  # one seed per request, drawn with the round's prompts
        self.generator.manual_seed(self.config.seed * MAX_COLLECTORS + self.config.collector_index)
        self.last_metrics: dict[str, float] = {}
        self._dropped: list[tuple[int, str]] = []  # this round's groups with a non-finite reward: (group id, why)
        self.groups_dropped = 0  # over every round, resumed with the state: the failure rate's numerator

    # ---------------------------------------------------------------- one batch
    def collect(self, next_round: Callable[[int], bool] | None = None) -> TrajectoryBatch:
        """One round of whole groups: its requests submitted (unless they went ahead), each group
        scored and written once it and every group before it ended (``collect/streaming.py``), each
        append with the state after its groups; metrics reported. ``next_round(rows not appended
        yet)``: asked once this round's first group ended; True submits the next round now, for the
        next call (``collect/overlap.py``).
        """
        cfg = self.config
        t0 = time.perf_counter()
        self._dropped = []
        round_, self._ahead = self._ahead or self._start_round(), None
        records, requests = round_.records, round_.requests
        rows_in_round = len(records) * cfg.num_generations

        def state_after(groups_done: int) -> dict[str, Any]:
            """The state once the round's groups ``0..groups_done - 1`` are stored."""
            if groups_done < len(records):
                return partial_round(round_.start_state, groups_done)
            if self._ahead is not None:  # the next round's draws are done: the state before them
                return dict(self._ahead.start_state)
            return self.state_dict(rounds_ahead=(1, len(records), rows_in_round))

        went_ahead = round_.submitted is not None
        if round_.submitted is None:
            round_.submitted = Submitted(self.engine, requests, round_.seeds, cfg.sampling)
        batch, parts, t_gen, t_reward, streamed = self._collect_streamed(
            round_, round_.submitted.batches(), t0, state_after, next_round)
        # the seconds the engine had nothing of this collector's before the round's requests went
        streamed.update(engine_idle_s=round_.idle_before_s, submitted_ahead=float(went_ahead))
        # counters advance only once the sink has the rows, so a failed write is retried with the same ids
        self.groups_emitted += len(records)
        self.trajectories_emitted += rows_in_round
        self.batches_emitted += 1
        self.groups_dropped += len(self._dropped)
        self._stored_in_round = 0
        for group_id, why in self._dropped:  # as the agent collector says its dropped groups
            say(f"{collector_tag(cfg.collector_index)} round {self.batches_emitted}: dropped group {group_id} "
                f"(non_finite_reward): {why}")
        self._report(batch, parts, t0, t_gen, t_reward, streamed)
        check_failure_rate(self.groups_dropped, self.groups_emitted, cfg.max_failed_group_fraction,
                           cfg.failure_rate_min_groups, self._dropped[-1][1] if self._dropped else None,
                           "CollectorConfig", over="non-finite rewards")
        return batch

    def _start_round(self) -> Round:
        """This round's prompts and seeds, drawn now, with the state before them."""
        start = self.state_dict()
        records = self.prompts.next_batch(self.config.prompts_per_batch)
        return Round(records, *self.requests_for(records), start, None, self._idle.submitted())

    def requests_for(self, records) -> tuple[list[SampleRequest], list[int]]:
        """The requests of ``records`` and their seeds, drawn from the generator in request order."""
        requests = [SampleRequest(r.render(self.tokenizer), n=self.config.num_generations) for r in records]
        return requests, [draw_seed(self.generator) for _ in requests]

    def _collect_streamed(self, round_: Round, batches, t0, state_after, next_round):
        """The round's stream (``batches``), written in request order as prefixes complete; with
        ``next_round``, the next round submitted once this one's first group ended, if it allows."""
        chunks: list[TrajectoryBatch] = []
        parts: list[dict[str, torch.Tensor]] = []
        scoring_s = 0.0
        stored = self._stored_in_round  # groups of the round in the store

        def write(groups, last: bool) -> None:
            nonlocal scoring_s, stored
            started = time.perf_counter()
            batch, chunk_parts = self._rows(round_.records, round_.requests, groups)
            scoring_s += time.perf_counter() - started
            self._commit(batch, state_after(groups[-1].index + 1), last)
            stored = max(stored, groups[-1].index + 1)
            chunks.append(batch)
            parts.append(chunk_parts)

        timing = StreamTiming(started=t0)
        commit = InOrderCommit(len(round_.requests), write, timing)
        try:
            ended_at = read_round(self, batches, commit, next_round, len(round_.records))
        except BaseException:
            batches.close()
            round_.submitted.cancel()  # what the engine has not begun of this round
            rewound = self._cancel_ahead()
            if stored:  # part of the round is stored: a retry generates it again, writes the rest
                self.load_state_dict(partial_round(round_.start_state, stored))
            elif rewound:  # the next round's draws are undone with this round's: a retry samples both again
                self.load_state_dict(round_.start_state)
            raise
        if self._ahead is None:
            self._idle.emptied(ended_at)
        t_gen = t0 + max(timing.ended_s.values())
        batch = chunks[0] if len(chunks) == 1 else TrajectoryBatch.cat(chunks)
        names = parts[0].keys()
        return (batch, {k: torch.cat([p[k] for p in parts]) for k in names}, t_gen, t_gen + scoring_s,
                timing.metrics())

    def _rows(self, records, requests, groups) -> tuple[TrajectoryBatch, dict[str, torch.Tensor]]:
        """The scored rows of ``groups`` (whole groups of this round, in request order), with the ids
        they have in the round: group ``k`` of the round is ``group_id`` base + groups so far + k."""
        cfg = self.config
        completions_out = [c for g in groups for c in g.completions]  # grouped by prompt, request order
        prompt_index = torch.tensor([g.index for g in groups for _ in g.completions], dtype=torch.int64)  # (N,)
        member = torch.tensor([j for g in groups for j in range(len(g.completions))], dtype=torch.int64)  # (N,)
        idx = prompt_index.tolist()
        response_tokens = RaggedTensor.from_sequences([c.token_ids for c in completions_out], dtype=torch.int32)
        terminated = torch.tensor([c.terminated for c in completions_out], dtype=torch.bool)
        version = torch.tensor([g.policy_version for g in groups for _ in g.completions], dtype=torch.int64)
        # render each prompt's text once, not once per completion
        record_texts = {i: records[i].display_text(self.tokenizer) for i in sorted(set(idx))}
        prompt_texts = [record_texts[i] for i in idx]
        completions = self.tokenizer.batch_decode([c.token_ids for c in completions_out], skip_special_tokens=True)
        field_names = sorted({k for r in records for k in r.fields})
        fields = {k: [records[i].fields.get(k) for i in idx] for k in field_names}
        reward, parts = score(self.rewards, prompt_texts, completions, fields)

        n = len(idx)
        base = id_base(cfg.collector_index)
        group_id = base + self.groups_emitted + prompt_index
        # every group of a round has num_generations rows: row j of group k is the round's k * G + j
        trajectory_id = base + self.trajectories_emitted + prompt_index * cfg.num_generations + member
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
        batch, parts, dropped = drop_non_finite_groups(batch, parts, prompt_index, completions)
        self._dropped += dropped
        return batch, parts

    def _commit(self, batch: TrajectoryBatch, state: dict[str, Any], last: bool) -> None:
        """``batch`` (consecutive groups of this round) to the sink with the state after them, less
        the groups a cut-off round stored before; a round's last call goes even with no rows."""
        base = id_base(self.config.collector_index) + self.groups_emitted
        batch = without_stored(batch, base, self._stored_in_round)
        if self.sink is not None and (last or len(batch)):
            self.sink(batch if len(batch) else None, writer_state=state)

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
            rounds_left = lambda: ((max_batches is None or batches + 1 < max_batches)  # noqa: E731
                                   and (max_rows is None or rows + self.round_rows < max_rows))
            rows += len(self.collect(next_round=lambda _rows: rounds_left()))
            batches += 1
        return rows

    def _report(self, batch: TrajectoryBatch, parts: dict[str, torch.Tensor], t0: float, t_gen: float, t_reward: float,
                streamed: dict[str, float]) -> None:
        elapsed = time.perf_counter() - t0
        reward = batch["reward"]
        g = self.config.num_generations
        grouped = reward.reshape(-1, g)
        group_std = grouped.std(dim=1, unbiased=False) if g > 1 and len(batch) else torch.zeros(len(grouped))

        def mean(values: torch.Tensor) -> float:  # 0 for a round whose every group was dropped
            return float(values.float().mean()) if values.numel() else 0.0

        metrics = {
            "rows": float(len(batch)),
            "rows_per_s": len(batch) / max(elapsed, 1e-9),
            "generate_s": t_gen - t0,
            "reward_s": t_reward - t_gen,
            "reward_mean": mean(reward),
            "reward_std": float(reward.std(unbiased=False)) if len(batch) else 0.0,
            "groups_with_signal": mean(group_std > 0),
            "response_len_mean": mean(batch["response_tokens"].lengths()),
            "terminated_frac": mean(batch["terminated"]),
            "groups_dropped": float(len(self._dropped)),  # the agent collector's names (agent_metrics.py)
            "groups_dropped_total": float(self.groups_dropped),
            **({"dropped/non_finite_reward": float(len(self._dropped))} if self._dropped else {}),
            "policy_version": float(self.policy_version),
            "batches": float(self.batches_emitted),
            "trajectories": float(self.trajectories_emitted),
            **self.engine.stats.update_metrics(),
            **streamed,  # a streamed round: when its first and last groups were committed (collect/streaming.py)
        }
        for name, values in parts.items():
            metrics[f"reward/{name}"] = mean(values)
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
        if self._ahead is not None and version != self.policy_version:
            raise RuntimeError(f"set_policy_state: version {version} while a round submitted ahead samples with "
                               f"version {self.policy_version}; weights change between rounds only: collect it first")
        self.engine.load_weights(state_dict, version)

    def close(self) -> None:
        """Closes the engine (a vLLM engine's process, with a round submitted ahead); our loop has none."""
        self._ahead = None
        self.engine.close()

    @property
    def has_round_ahead(self) -> bool:
        """The next round went while the last one decoded: the next :meth:`collect` reads it."""
        return self._ahead is not None

    @property
    def continues_a_round(self) -> bool:
        """The next :meth:`collect` goes on with a round already started, which keeps the weights it
        started with: one submitted ahead, or one written in part before the last stop (its rest
        sampled with any other version would not be the uninterrupted run's rows)."""
        return self._ahead is not None or self._stored_in_round > 0

    def _cancel_ahead(self) -> bool:
        """Drops the round submitted ahead, if any (the engine discards its groups)."""
        ahead, self._ahead = self._ahead, None
        return ahead is not None and ahead.submitted.cancel() is None

    # ---------------------------------------------------------------- resume
    def state_dict(self, rounds_ahead: tuple[int, int, int] = (0, 0, 0)) -> dict[str, Any]:
        """``rounds_ahead``: (batches, groups, trajectories) not yet counted but to be included."""
        batches, groups, trajectories = rounds_ahead
        return {
            "prompts": self.prompts.state_dict(),
            "groups_emitted": self.groups_emitted + groups,
            "trajectories_emitted": self.trajectories_emitted + trajectories,
            "batches_emitted": self.batches_emitted + batches,
            # a round being counted (batches) has its drops in _dropped already: its rows are built
            "groups_dropped": self.groups_dropped + (len(self._dropped) if batches else 0),
            "policy_version": self.policy_version,
            "runner": dict(self.runner_state),
            "rng": self.generator.get_state(),
            "config": {"collector_index": self.config.collector_index, "seed": self.config.seed,
                       "num_generations": self.config.num_generations,
                       "sampling": asdict(self.config.sampling)},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._cancel_ahead()  # drawn from the state being replaced
        if state["config"]["collector_index"] != self.config.collector_index:
            raise ValueError(
                f"collector state belongs to collector_index {state['config']['collector_index']}, "
                f"this is collector {self.config.collector_index}; restore each collector from its own state"
            )
        self.prompts.load_state_dict(state["prompts"])
        self.groups_emitted = int(state["groups_emitted"])
        self.trajectories_emitted = int(state["trajectories_emitted"])
        self.batches_emitted = int(state["batches_emitted"])
        self.groups_dropped = int(state.get("groups_dropped", 0))  # saved before groups could be dropped: none
        # the saved policy_version is not restored: rows name the version the engine holds, and the
        # caller loads the newest published weights next (collect_main does)
        self.generator.set_state(state["rng"])
        self._stored_in_round = stored_in_round(state)
        self.runner_state = dict(state["runner"])

