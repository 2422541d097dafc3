"""Pacing cannot deadlock, whatever the batch size, the group size and the turns per episode.

A learner batch larger than ``rounds_per_version`` rounds once stalled a run for ever: the
collector waited for new weights after two rounds, the learner for the rows of its first step
(seen with ``pipelines/tool_use.py``'s one-turn episodes). Here the real pacing file and the
collector's real decision (``CollectorPacer.plan_round``, as ``runs/processes.py`` uses it) meet a
learner that takes batches as the ``exact`` sampler does, over a grid of batch sizes, group sizes,
turns per episode, ``rounds_per_version``, ``rounds_ahead`` and ``publish_every``, step by step in
one process. The same meeting between real processes is ``tests/integration/test_tool_use_pipeline.py``.
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
        self.pacing.publish(LearnerIntake(0, 0, {}, next_draw_rows=batch, policy_version=0))  # as at setup

    def act(self, shard_rows: int) -> bool:
        if shard_rows - self.consumed < self.batch:
            self.pacing.waiting()
            return False
        self.consumed += self.batch
        self.draws += 1
        self.pacing.publish(LearnerIntake(self.step, self.draws, {KEY: self.consumed}, next_draw_rows=self.batch,
                                          policy_version=self.version))
        self.step += 1  # trains the batch
        if self.step % self.publish_every == 0:
            self.version += 1  # publishes its weights
        return True


class Collector:
    """The collector's loop of ``runs/processes.py`` (collect_main) around ``plan_round``: rounds of
    ``tasks x group`` episodes of 1..``max_turns`` turns (one row each), weights as the
    ``WeightsPoller`` loads them (an exact version once published, or the newest)."""

    def __init__(self, path, learner: Learner, *, tasks: int, group: int, max_turns: int, rounds_ahead,
                 rounds_per_version, seed: int) -> None:
        self.learner, self.tasks, self.group, self.max_turns = learner, tasks, group, max_turns
        self.rounds_per_version = rounds_per_version
        self.pacer = CollectorPacer(path, KEY, rounds_ahead, round_rows=tasks * group, stall_s=1e9)
        self.rng = random.Random(seed)
        self.rows = self.version = self.rounds_at_version = 0
        self.versions: list[int] = []  # the version each round used

    def plan(self):
        return self.pacer.plan_round(self.rows, policy_version=self.version, rounds_at_version=self.rounds_at_version,
                                     rounds_per_version=self.rounds_per_version)

    def waiting_for(self) -> str:
        return self.plan().waiting_for

    def act(self) -> bool:
        plan = self.plan()
        published = self.learner.version
        if plan.version is not None and self.pacer.rounds_ahead is not None:
            loaded = plan.version if self.version < plan.version <= published else None
        elif plan.allowed or self.pacer.rounds_ahead is None:
            loaded = published if published > self.version else None
        else:
            loaded = None
        if loaded is not None:
            self.version, self.rounds_at_version = loaded, 0
        if not plan.allowed or self.version < plan.min_version:
            assert plan.waiting_for  # what a long wait would say
            return False
        written = sum(self.rng.randint(1, self.max_turns) for _ in range(self.tasks * self.group))
        self.rows += written
        self.versions.append(self.version)
        self.rounds_at_version += 1
        self.pacer.round_written(written, round_rows=round(self.tasks * self.group * (1 + self.max_turns) / 2))
        return True


GRID = list(itertools.product([1, 5, 8, 20, 40, 70], [2, 4], [1, 3]))  # batch rows, group size, turns at most
PACING = [  # rounds_per_version, rounds_ahead, publish_every
    (2, 0, 1),  # the pipelines' defaults
    (1, 0, 3),
    (2, 1, 2),
    (2, None, 1),  # unpaced: the limit alone
    (None, 0, 1),
]


@pytest.mark.parametrize("rounds_per_version, rounds_ahead, publish_every", PACING)
def test_pacing_never_deadlocks_over_batch_group_and_turn_sizes(tmp_path, rounds_per_version, rounds_ahead,
                                                                 publish_every):
    steps = 6
    for n, (batch, group, max_turns) in enumerate(GRID):
        path = tmp_path / f"pacing-{n}.json"
        learner = Learner(path, batch, publish_every)
        collector = Collector(path, learner, tasks=2, group=group, max_turns=max_turns, rounds_ahead=rounds_ahead,
                              rounds_per_version=rounds_per_version, seed=n)
        idle = 0
        while learner.step < steps:
            moved = collector.act()
            moved = learner.act(collector.rows) or moved
            idle = 0 if moved else idle + 1
            assert idle < 3, (f"deadlock: batch {batch}, group {group}, turns <= {max_turns}: the learner waits at "
                              f"step {learner.step} for {batch} rows ({collector.rows - learner.consumed} there), the "
                              f"collector: {collector.waiting_for()}")
        round_most = 2 * group * max_turns
        if rounds_ahead is not None:  # and it wrote no more than pacing allows
            assert collector.rows - learner.consumed <= batch + (rounds_ahead + 1) * round_most
        if rounds_per_version is not None and batch <= 2 * group and publish_every == 1:
            # a batch within one round: the limit holds as before
            assert max(collector.versions.count(v) for v in set(collector.versions)) <= rounds_per_version


def test_past_the_limit_a_round_takes_the_first_intake_that_asks_for_it(tmp_path):
    """Which version a round past ``rounds_per_version`` uses is read off the intakes in order, not
    off when they are read: the first intake whose next batch needs it, or that allows it with a
    newer version."""
    path = tmp_path / "pacing.json"
    learner = PacingPublisher(path)
    pacer = CollectorPacer(path, KEY, rounds_ahead=1, round_rows=8)
    learner.publish(LearnerIntake(0, 0, {}, next_draw_rows=8, policy_version=0))
    learner.publish(LearnerIntake(0, 1, {KEY: 8}, next_draw_rows=8, policy_version=0))
    # two rounds of version 0 written (16 rows); the third is allowed by rounds_ahead, not needed yet
    plan = pacer.plan_round(16, policy_version=0, rounds_at_version=2, rounds_per_version=2)
    assert not plan.allowed and "rounds_per_version=2" in plan.waiting_for
    learner.publish(LearnerIntake(1, 2, {KEY: 16}, next_draw_rows=8, policy_version=0))  # now its next batch needs it
    plan = pacer.plan_round(16, policy_version=0, rounds_at_version=2, rounds_per_version=2)
    assert plan.allowed and plan.version == 0 and plan.min_version == 0  # no new version can come without it
    learner.publish(LearnerIntake(2, 3, {KEY: 24}, next_draw_rows=8, policy_version=1))
    plan = pacer.plan_round(24, policy_version=0, rounds_at_version=3, rounds_per_version=2)
    assert plan.allowed and plan.version == 1  # the first intake that allows it with a newer version
    assert pacer.plan_round(16, policy_version=0, rounds_at_version=0, rounds_per_version=2).version == 0  # as before
