"""Pacing cannot deadlock, whatever the batch size, the group size and the turns per episode.

A learner batch larger than the rounds a collector would write with one version once stalled a
run for ever: the collector waited for new weights after two rounds, the learner for the rows of
its first step (seen with ``pipelines/tool_use.py``'s one-turn episodes). Here the real pacing file
and the collector's real decision (``CollectorPacer.plan_round``, as ``runs/processes.py`` uses it)
meet a learner that takes batches as the ``exact`` sampler does, over a grid of batch sizes, group
sizes, turns per episode, ``max_lag`` and ``publish_every``, step by step in one process. The same
meeting between real processes is ``tests/integration/test_tool_use_pipeline.py``.
"""

from __future__ import annotations

import itertools
import random

import pytest

from rlhf_pipeline.coordination.pacing import CollectorPacer, LearnerIntake, PacingPublisher

KEY = "shard-0000"


class Learner:
    """The learner's side of pacing: a batch is ``batch`` new rows (``exact``, each row used once);
    it publishes its intake after each draw and a new policy version every ``publish_every`` steps."""

    def __init__(self, path, batch: int, publish_every: int) -> None:
        self.pacing, self.batch, self.publish_every = PacingPublisher(path), batch, publish_every
        self.step = self.draws = self.consumed = self.version = 0
        self.trained: list[tuple[int, int, int]] = []  # (first row, end, version) of each step's batch
        self.pacing.publish(LearnerIntake(0, 0, {}, next_draw_rows=batch, policy_version=0))  # as at setup

    def act(self, shard_rows: int) -> bool:
        if shard_rows - self.consumed < self.batch:
            self.pacing.waiting()
            return False
        self.consumed += self.batch
        self.draws += 1
        publishes = (self.step + 1) % self.publish_every == 0
        self.pacing.publish(LearnerIntake(self.step, self.draws, {KEY: self.consumed}, next_draw_rows=self.batch,
                                          policy_version=self.version, next_version=self.version + publishes))
        self.trained.append((self.consumed - self.batch, self.consumed, self.version))
        self.step += 1  # trains the batch
        if self.step % self.publish_every == 0:
            self.version += 1  # publishes its weights
        return True


class Collector:
    """The collector's loop of ``runs/processes.py`` (collect_main) around ``plan_round``: rounds of
    ``tasks x group`` episodes of 1..``max_turns`` turns (one row each), weights as the
    ``WeightsPoller`` loads them (an exact version once published, or the newest)."""

    def __init__(self, path, learner: Learner, *, tasks: int, group: int, max_turns: int, max_lag,
                 seed: int) -> None:
        self.learner, self.tasks, self.group, self.max_turns = learner, tasks, group, max_turns
        self.pacer = CollectorPacer(path, KEY, max_lag, round_rows=tasks * group, stall_s=1e9)
        self.rng = random.Random(seed)
        self.rows = self.version = 0
        self.versions: list[int] = []  # the version each round used
        self.row_versions: list[int] = []  # the version each row was sampled with

    def plan(self):
        return self.pacer.plan_round(self.rows)

    def waiting_for(self) -> str:
        return self.plan().waiting_for

    def act(self) -> bool:
        plan = self.plan()
        published = self.learner.version
        if plan.version is not None and self.pacer.max_lag is not None:
            loaded = plan.version if self.version < plan.version <= published else None
        elif plan.allowed or self.pacer.max_lag is None:
            loaded = published if published > self.version else None
        else:
            loaded = None
        if loaded is not None:
            self.version = loaded
        if not plan.allowed or self.version < plan.min_version:
            assert plan.waiting_for  # what a long wait would say
            return False
        written = sum(self.rng.randint(1, self.max_turns) for _ in range(self.tasks * self.group))
        self.rows += written
        self.versions.append(self.version)
        self.row_versions += [self.version] * written
        self.pacer.round_written(written, round_rows=round(self.tasks * self.group * (1 + self.max_turns) / 2))
        return True


GRID = list(itertools.product([1, 5, 8, 20, 40, 70], [2, 4], [1, 3]))  # batch rows, group size, turns at most
PACING = [  # max_lag, publish_every
    (1, 1),  # the pipelines' default
    (0, 1),  # on-policy
    (0, 3),
    (1, 3),
    (2, 2),
    (3, 1),
    (None, 1),  # unpaced
]


@pytest.mark.parametrize("max_lag, publish_every", PACING)
def test_pacing_never_deadlocks_over_batch_group_and_turn_sizes(tmp_path, max_lag, publish_every):
    steps = 6
    for n, (batch, group, max_turns) in enumerate(GRID):
        path = tmp_path / f"pacing-{n}.json"
        learner = Learner(path, batch, publish_every)
        collector = Collector(path, learner, tasks=2, group=group, max_turns=max_turns, max_lag=max_lag, seed=n)
        idle = 0
        while learner.step < steps:
            moved = collector.act()
            moved = learner.act(collector.rows) or moved
            idle = 0 if moved else idle + 1
            assert idle < 3, (f"deadlock: batch {batch}, group {group}, turns <= {max_turns}: the learner waits at "
                              f"step {learner.step} for {batch} rows ({collector.rows - learner.consumed} there), the "
                              f"collector: {collector.waiting_for()}")
        if max_lag is None:
            continue
        # it wrote no more than pacing allows: the next max_lag batches and the round that crossed that
        assert collector.rows - learner.consumed <= max(max_lag, 1) * batch + 2 * group * max_turns
        # a round that starts within the batch it is pinned for trains no more than max_lag versions
        # behind; only the tail of a round that crossed into a later batch may be older (the learner
        # passes those rows over: learner.max_staleness)
        for first, end, version in learner.trained:
            pinned_for = collector.row_versions[first]
            if first == 0 or collector.row_versions[first - 1] != pinned_for:  # the batch starts a round
                assert version - pinned_for <= max_lag, (batch, group, max_turns, first, version, pinned_for)
