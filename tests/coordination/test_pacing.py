"""Collector pacing (``rlhf_pipeline/coordination/pacing.py``): a real learner and paced writers on real stores."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from helpers import make_batch
from rlhf_pipeline.learn.learner import Learner
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.learn.settings import LearnerSettings
from rlhf_pipeline.models import char_tokenizer, tiny_causal_lm
from rlhf_pipeline.coordination.pacing import (
    RECENT_DRAWS,
    WAITING_RENEW_S,
    CollectorPacer,
    LearnerIntake,
    PacingPublisher,
    read_intake,
    shard_key,
)
from rlhf_pipeline.pipeline import RunPaths
from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage import create_store
from rlhf_pipeline.coordination.weights import publish_weights

TOKENIZER = char_tokenizer()
ROUND = 8  # rows per collector round: 2 groups of 4


def make_model():
    return tiny_causal_lm(len(TOKENIZER), hidden_size=16, num_layers=1, num_heads=2, seed=0)


# ====================================================================== the rule
def test_a_collector_writes_the_learners_next_max_lag_batches(tmp_path):
    path = tmp_path / "pacing.json"
    pacer = CollectorPacer(path, "shard-0000", max_lag=2, round_rows=ROUND)
    # before the learner's first publish: max_lag rounds
    assert pacer.may_collect(8) and not pacer.may_collect(16)
    learner = PacingPublisher(path)
    learner.publish(LearnerIntake(step=3, draws=3, consumed={"shard-0000": 24}, next_draw_rows=8))
    assert read_intake(path) == learner.intake
    assert pacer.target_rows(read_intake(path)) == 24 + 2 * 8
    assert pacer.may_collect(39) and not pacer.may_collect(40)
    # with two shards the next batch is shared; a shard the learner has not seen counts from 0
    learner.publish(LearnerIntake(3, 3, {"shard-0000": 24, "shard-0001": 16}, next_draw_rows=16))
    assert pacer.target_rows(read_intake(path)) == 24 + 2 * 8
    late = CollectorPacer(path, "shard-0002", max_lag=1, round_rows=ROUND)
    assert late.target_rows(read_intake(path)) == 0 + 6  # ceil(16 / 3 shards)
    on_policy = CollectorPacer(path, "shard-0002", max_lag=0, round_rows=ROUND)
    assert on_policy.target_rows(read_intake(path)) == 0 + 6  # the next batch: its weights are waited for
    assert CollectorPacer(path, "shard-0000", max_lag=None).may_collect(10**9)  # unpaced


def test_after_the_learners_last_step_no_round_is_allowed(tmp_path):
    """Its last batch taken in, the learner takes in nothing more: no round, not even the rounds ahead
    or the share of a next batch it would have needed, and the collector's wait line says why."""
    path = tmp_path / "pacing.json"
    learner = PacingPublisher(path)
    pacer = CollectorPacer(path, "shard-0000", max_lag=2, round_rows=ROUND)
    learner.publish(LearnerIntake(step=4, draws=5, consumed={"shard-0000": 40}, next_draw_rows=8, last_step=True))
    assert read_intake(path).last_step
    assert pacer.target_rows(read_intake(path)) == 40 and not pacer.may_collect(40)
    plan = pacer.plan_round(40)
    assert not plan.allowed and "last step" in plan.waiting_for
    learner.publish(LearnerIntake(step=4, draws=5, consumed={"shard-0000": 40}, next_draw_rows=8))
    assert pacer.may_collect(40 + 2 * 8 - 1)  # the same intake, not the last: its next two batches


def test_pacing_through_a_run_store_reads_once_per_reread_interval(tmp_path):
    """At a URL a read is a GET: a pacer with ``reread_s`` reads the intake once for the calls of
    one wait iteration, then again once the interval has passed."""
    from rlhf_pipeline.files.run_store import LocalRunStore

    store = LocalRunStore(tmp_path / "run")
    learner = PacingPublisher("pacing.json", store=store)
    pacer = CollectorPacer("pacing.json", "shard-0000", max_lag=1, round_rows=ROUND, store=store, reread_s=60.0)
    learner.publish(LearnerIntake(step=1, draws=1, consumed={"shard-0000": 8}, next_draw_rows=8))
    assert pacer.may_collect(15) and not pacer.may_collect(16)
    learner.publish(LearnerIntake(step=2, draws=2, consumed={"shard-0000": 16}, next_draw_rows=8))
    assert not pacer.may_collect(16)  # the intake read a moment ago
    pacer._read_at -= pacer.reread_s  # the interval has passed (no sleep a loaded machine could stretch)
    assert pacer.may_collect(16) and not pacer.may_collect(24)
    assert (tmp_path / "run" / "pacing.json").is_file()


def test_a_collector_alone_is_unpaced_until_a_learner_publishes(tmp_path):
    path = tmp_path / "pacing.json"
    alone = CollectorPacer(path, "shard-0000", max_lag=1, round_rows=ROUND, learner_expected=False)
    assert alone.may_collect(10 * ROUND)  # `collect` recording a buffer with no learner
    PacingPublisher(path).publish(LearnerIntake(step=1, draws=1, consumed={"shard-0000": 8}, next_draw_rows=8))
    assert alone.may_collect(15) and not alone.may_collect(16)  # a learner came: paced from now on


def test_a_learner_still_waiting_after_a_round_gets_one_more(tmp_path, monkeypatch):
    """The last resort against a deadlock: the learner needs more than it said it would."""
    from types import SimpleNamespace

    from rlhf_pipeline.coordination import pacing

    # the pacing module's wall clock is the test's: a loaded machine cannot stretch the gap between two
    # calls that must come within WAITING_RENEW_S
    clock = SimpleNamespace(now=1_000_000.0)
    monkeypatch.setattr(pacing, "time", SimpleNamespace(time=lambda: clock.now, monotonic=time.monotonic))
    path = tmp_path / "pacing.json"
    learner = PacingPublisher(path)
    learner.publish(LearnerIntake(1, 1, {"shard-0000": 8}, next_draw_rows=0))
    pacer = CollectorPacer(path, "shard-0000", max_lag=1, round_rows=ROUND, stall_s=0.2)
    pacer.round_written(ROUND)
    assert not pacer.may_collect(16)
    learner.waiting()
    since = read_intake(path).waiting_since
    clock.now += WAITING_RENEW_S / 2
    learner.waiting()  # the time it began stays; a renewal comes at most every WAITING_RENEW_S
    assert read_intake(path).waiting_since == since and read_intake(path).waiting_seen == since
    assert not pacer.may_collect(16)
    clock.now += 0.3
    assert not pacer.may_collect(16)  # waited, but the learner has not said it still waits
    clock.now += WAITING_RENEW_S
    learner.waiting()
    assert read_intake(path).waiting_since == since
    assert pacer.may_collect(16)
    learner.publish(LearnerIntake(2, 2, {"shard-0000": 16}, next_draw_rows=0))  # it took the round
    assert not pacer.may_collect(16)


def test_a_learner_that_died_waiting_gets_no_more_rounds(tmp_path):
    """A learner lost mid-wait (its node gone; under Ray the collector runs on) renews nothing: the
    collector writes no rounds for it, which would take whatever weights are newest."""
    path = tmp_path / "pacing.json"
    learner = PacingPublisher(path)
    learner.publish(LearnerIntake(1, 1, {"shard-0000": 8}, next_draw_rows=0))
    pacer = CollectorPacer(path, "shard-0000", max_lag=1, round_rows=ROUND, stall_s=0.05)
    learner.waiting()
    time.sleep(0.1)
    learner.waiting()  # not yet renewed: within WAITING_RENEW_S of the last
    pacer.round_written(ROUND)
    time.sleep(0.1)  # more than stall_s since the round, by the collector's clock
    assert not pacer.may_collect(16)


def test_a_learner_slow_to_read_rows_it_has_gets_no_round_from_the_stall_rule(tmp_path):
    """Issue 41: under load a learner took longer than ``stall_s`` to read the round it had waited
    for; the stall rule gave it one more round, with whatever weights were newest, that the same run
    on a quiet machine wrote later with other weights (a resumed agent run trained other rows). A
    learner whose sampler says what it lacks is never second-guessed from the clock."""
    path = tmp_path / "pacing.json"
    learner = PacingPublisher(path)
    learner.publish(LearnerIntake(1, 1, {"shard-0000": 8}, next_draw_rows=8, policy_version=1))
    pacer = CollectorPacer(path, "shard-0000", max_lag=1, round_rows=ROUND, stall_s=1.0)
    pacer.round_written(ROUND)  # 16 rows: what the learner's next draw needs
    now = time.time()  # the learner still says it waits a minute after that round (a slow read)
    waits = dataclasses.replace(learner.intake, waiting_since=now - 1, waiting_seen=now + 60)
    learner.publish(waits, new_draw=False)
    plan = lambda: pacer.plan_round(16)  # noqa: E731
    assert plan().allowed and plan().version is None  # a sampler that says nothing: the rule, the newest weights
    learner.publish(dataclasses.replace(waits, lacking=(2, 0, {"shard-0000": 16})), new_draw=False)
    assert not plan().allowed and not pacer.may_collect(16)  # it has its rows, it is reading them
    assert read_intake(path).lacking == (2, 0, {"shard-0000": 16})


def test_a_waiting_learner_gets_the_rows_its_sampler_lacks_at_once_with_its_draws_version(tmp_path):
    """The exact sampler passed over stale rows and needs more than its intake said: the collectors
    write them without waiting out ``stall_s``, with the version the waiting draw trains with, and
    with several shards each writes its share."""
    path = tmp_path / "pacing.json"
    learner = PacingPublisher(path)
    learner.publish(LearnerIntake(1, 1, {"shard-0000": 8}, next_draw_rows=8, policy_version=1))
    pacer = CollectorPacer(path, "shard-0000", max_lag=1, round_rows=ROUND, stall_s=1e9)
    assert not pacer.may_collect(16)
    learner.waiting((3, 5, {"shard-0000": 16}))
    plan = pacer.plan_round(16)
    assert (plan.allowed, plan.version, plan.min_version) == (True, 3, 3)
    assert pacer.may_collect(20) and not pacer.may_collect(21)  # 5 rows lacking: a round from 16 to 20 on
    learner.waiting((3, 5, {"shard-0000": 16, "shard-0001": 4}))
    assert pacer.may_collect(18) and not pacer.may_collect(19)  # its share, ceil(5 / 2)
    learner.publish(LearnerIntake(2, 2, {"shard-0000": 16}, next_draw_rows=8, policy_version=3))
    assert read_intake(path).lacking is None  # the draw came: the intake says what the next one needs


def test_an_imported_shard_shares_the_next_batch_only_while_the_learner_takes_rows_from_it(tmp_path):
    """``import`` into a run adds a shard no collector writes (``shard-9000``): while the learner's draws take
    rows from it, a collector's share is half the batch; once it gave its last rows, the whole batch again.
    Counted still, it left a lone collector a round short of max_lag=1 at every step, the learner waiting
    for the rest each time: the run trained as with max_lag=0 for good."""
    path = tmp_path / "pacing.json"
    learner = PacingPublisher(path)
    pacer = CollectorPacer(path, "shard-0000", max_lag=1, round_rows=ROUND, stall_s=1e9)
    learner.publish(LearnerIntake(1, 1, {"shard-0000": 8, "shard-9000": 8}, next_draw_rows=16))
    learner.publish(LearnerIntake(2, 2, {"shard-0000": 16, "shard-9000": 16}, next_draw_rows=16))
    assert pacer.target_rows(read_intake(path)) == 16 + 8  # the import gives half of the next batch
    learner.publish(LearnerIntake(3, 3, {"shard-0000": 32, "shard-9000": 16}, next_draw_rows=16))
    assert pacer.target_rows(read_intake(path)) == 32 + 16  # its rows used up: the collector's whole batch
    assert pacer.plan_round(40).allowed and not pacer.plan_round(48).allowed
    # a collector's shard counts though it gave nothing to the last draw: it may only be slow
    learner.publish(LearnerIntake(4, 4, {"shard-0000": 48, "shard-0001": 0, "shard-9000": 16}, next_draw_rows=16))
    assert pacer.target_rows(read_intake(path)) == 48 + 8
    # what a waiting learner lacks, only collectors give: here the lone collector, all of it
    learner.publish(LearnerIntake(5, 5, {"shard-0000": 64, "shard-9000": 16}, next_draw_rows=16))
    learner.waiting((5, 16, {"shard-0000": 80, "shard-9000": 16}))
    assert pacer.may_collect(95) and not pacer.may_collect(96)


def test_a_collector_gone_for_all_the_draws_on_record_no_longer_shares_the_next_batch(tmp_path):
    """A run of two collectors resumed with one: collector 1's shard gives no more rows. It counted for good,
    and collector 0 wrote half a batch ahead for the rest of the run (staleness 0 from then on, measured).
    It counts until no draw on record (RECENT_DRAWS) took rows from it: a slow collector is not dropped for a
    draw or two."""
    path = tmp_path / "pacing.json"
    learner = PacingPublisher(path)
    pacer = CollectorPacer(path, "shard-0000", max_lag=1, round_rows=ROUND, stall_s=1e9)
    learner.publish(LearnerIntake(1, 1, {"shard-0000": 8, "shard-0001": 8}, next_draw_rows=16))
    for draw in range(2, RECENT_DRAWS + 2):  # collector 1 gone: every draw from collector 0 alone
        learner.publish(LearnerIntake(draw, draw, {"shard-0000": 16 * draw - 8, "shard-0001": 8}, next_draw_rows=16))
        # half a batch while a draw on record took its rows (it may only be slow), then the whole batch
        share = 8 if draw < RECENT_DRAWS else 16
        assert pacer.target_rows(read_intake(path)) == 16 * draw - 8 + share, draw
    learner.publish(LearnerIntake(RECENT_DRAWS + 2, RECENT_DRAWS + 2,
                                  {"shard-0000": 16 * RECENT_DRAWS + 16, "shard-0001": 16}, next_draw_rows=16))
    assert pacer.target_rows(read_intake(path)) == 16 * RECENT_DRAWS + 16 + 8  # back: it shares again


def test_a_round_uses_the_version_of_the_intake_that_first_allowed_it(tmp_path):
    """Not the newest: a collector that reads pacing.json late (it was generating) still names
    the weights the learner held when the round first became allowed, so timing cannot change it."""
    path = tmp_path / "pacing.json"
    learner = PacingPublisher(path)
    pacer = CollectorPacer(path, "shard-0000", max_lag=2, round_rows=ROUND)
    assert pacer.plan_round(0).version is None  # no learner yet: only the initial policy exists
    learner.publish(LearnerIntake(0, 0, {}, next_draw_rows=8, policy_version=0))
    for step in range(1, 6):  # draw `step` took rows up to 8 * step, trained with version step - 1
        learner.publish(LearnerIntake(step - 1, step, {"shard-0000": 8 * step}, next_draw_rows=8,
                                      policy_version=step - 1, next_version=step))
    learner.waiting()  # a republish, not a draw
    # a round starting at 8r rows is allowed once 8r < consumed + 2 * 8, i.e. from draw r - 1
    assert [pacer.plan_round(8 * r).version for r in range(7)] == [0, 0, 0, 1, 2, 3, 4]
    assert not pacer.plan_round(8 * 7).allowed  # not allowed yet (the stall rule would take the newest)
    assert CollectorPacer(path, "shard-0000", max_lag=None).plan_round(0).version is None  # unpaced
    assert read_intake(path).recent[-1] == (4, 5, 8, {"shard-0000": 40})


def test_on_policy_a_round_waits_for_the_version_the_draw_it_feeds_trains_with(tmp_path):
    """max_lag=0: the rows of step k are sampled with the version step k-1 publishes, which the round
    waits for; the learner's next batch alone is allowed, never a round more."""
    path = tmp_path / "pacing.json"
    learner = PacingPublisher(path)
    pacer = CollectorPacer(path, "shard-0000", max_lag=0, round_rows=ROUND)
    learner.publish(LearnerIntake(0, 0, {}, next_draw_rows=8, policy_version=0, next_version=0))
    assert pacer.may_collect(0) and not pacer.may_collect(8)  # draw 0 trains with version 0: no wait
    assert pacer.plan_round(0).version == 0
    for step in range(1, 4):  # draw `step` trains with version step - 1 and publishes version step
        learner.publish(LearnerIntake(step - 1, step, {"shard-0000": 8 * step}, next_draw_rows=8,
                                      policy_version=step - 1, next_version=step))
    plans = [pacer.plan_round(8 * r) for r in range(4)]
    assert [(plan.version, plan.min_version) for plan in plans] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert not pacer.plan_round(8 * 4).allowed
    # a draw that publishes nothing (publish_every > 1, or one that trains nothing) keeps its version
    learner.publish(LearnerIntake(3, 4, {"shard-0000": 32}, next_draw_rows=8, policy_version=3, next_version=3))
    assert pacer.plan_round(32).version == 3


def test_a_round_that_would_cross_into_the_batch_after_next_waits_for_the_step_in_progress(tmp_path):
    """max_lag=1 with rounds of 12 rows and batches of 8: sampled with the version the learner holds,
    the round's last rows would train two versions later; it waits for the next version instead
    (never a later one, which needs its rows), so nothing is generated to be passed over."""
    path = tmp_path / "pacing.json"
    learner = PacingPublisher(path)
    learner.publish(LearnerIntake(2, 3, {"shard-0000": 16}, next_draw_rows=8, policy_version=2, next_version=3))
    crossing = CollectorPacer(path, "shard-0000", max_lag=1, round_rows=12).plan_round(16)
    assert (crossing.allowed, crossing.version, crossing.min_version) == (True, 3, 3)
    within = CollectorPacer(path, "shard-0000", max_lag=1, round_rows=8).plan_round(16)
    assert within.version == 2  # all its rows in the next batch: it overlaps the step in progress
    ahead = CollectorPacer(path, "shard-0000", max_lag=2, round_rows=12).plan_round(16)
    assert ahead.version == 2  # two versions allowed: the crossing round overlaps too
    on_policy = CollectorPacer(path, "shard-0000", max_lag=0, round_rows=12).plan_round(16)
    assert on_policy.version == 3  # its tail in the batch after next is passed over by the learner


def test_shard_keys_match_the_learners(tmp_path):
    assert shard_key(tmp_path / "buffer" / "shard-0003", tmp_path / "buffer") == "shard-0003"
    assert shard_key(tmp_path / "buffer", tmp_path / "buffer") == "."
    with pytest.raises(ValueError, match="max_lag must be >= 0"):
        CollectorPacer(tmp_path / "p.json", ".", max_lag=-1)


# ====================================================================== learner + writers
class PacedWriter(threading.Thread):
    """A collector's loop around a real store: a round of whole groups whenever the pacer allows."""

    def __init__(self, paths: RunPaths, index: int, max_lag: int, start_at_step: int = 0) -> None:
        super().__init__(daemon=True)
        store_path = paths.shard(index)
        self.store = create_store(store_path, "memmap", schema=StoreSchema(optional=("advantage",)),
                                  segment_rows=64)
        self.pacer = CollectorPacer(paths.pacing, shard_key(store_path, paths.buffer), max_lag,
                                    round_rows=ROUND)
        self.index, self.start_at_step = index, start_at_step
        self.stop = threading.Event()
        self.most_ahead = 0  # rows past the learner's intake of this shard, at the worst moment
        self.looked = 0  # times it asked the pacer whether to write a round (and acted on the answer)

    def run(self) -> None:
        while self.start_at_step and not self.stop.is_set():  # a collector started late
            intake = read_intake(self.pacer.path)
            if intake is not None and intake.step >= self.start_at_step:
                break
            time.sleep(0.005)
        groups = 0
        while not self.stop.is_set():
            self.looked += 1
            if not self.pacer.may_collect(self.store.next_row):
                time.sleep(0.005)
                continue
            base = self.index << 40
            self.store.append(make_batch(2, 4, seed=groups + 97 * self.index, optional=("advantage",),
                                         first_group_id=base + groups, first_trajectory_id=base + 4 * groups,
                                         vocab_size=len(TOKENIZER)))
            groups += 2
            self.pacer.round_written(ROUND)
            intake = read_intake(self.pacer.path)
            taken = intake.consumed.get(f"shard-{self.index:04d}", 0) if intake else 0
            self.most_ahead = max(self.most_ahead, self.store.next_row - taken)


def paced_run(tmp_path, *, writers: int, max_lag: int, steps: int, late: int = 0, on_step=None, **learner):
    """``on_step(step, threads)``: called after each learner step with the writer threads."""
    paths = RunPaths(tmp_path / "run")
    publish_weights(paths.root, make_model().state_dict(), 0)
    threads = [PacedWriter(paths, k, max_lag, start_at_step=late if k == writers - 1 else 0)
               for k in range(writers)]
    settings = dataclasses.replace(LearnerSettings(batch_size=16, sampler="exact", micro_batch_tokens=4096,
                                                   max_staleness=None, checkpoint_every=1000, data_timeout_s=60),
                                   **learner)
    hook = None if on_step is None else lambda step, *_: on_step(step, threads)
    run = Learner(settings, paths, make_model=make_model, steps=steps, seed=0, show_progress=False, on_step=hook)
    for thread in threads:
        thread.start()
    try:
        run.setup()
        assert run.train() is True  # no deadlock: it got every batch it waited for
    finally:
        run.cleanup()
        for thread in threads:
            thread.stop.set()
            thread.join(timeout=30)
            thread.store.close()
    return paths, threads


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def wait_for_a_look_after_it(step: int, threads: list[PacedWriter], last: int) -> None:
    """At the learner's ``last`` step (its batch taken in and published): returns once every writer
    has asked the pacer afresh and acted on the answer, as a fast collector would before ``STOP``."""
    if step != last:
        return
    before = [writer.looked for writer in threads]
    deadline = time.monotonic() + 60
    while any(writer.looked < n + 2 for writer, n in zip(threads, before, strict=True)):
        assert time.monotonic() < deadline, "a writer stopped asking the pacer"
        time.sleep(0.005)


def test_a_paced_collector_writes_what_the_learner_trains_on_and_no_more(tmp_path):
    """Not even the round of a step after the last: the buffer a run leaves is the same at any load."""
    paths, (writer,) = paced_run(tmp_path, writers=1, max_lag=1, steps=6,
                                 on_step=lambda step, threads: wait_for_a_look_after_it(step, threads, last=6))
    last = read_metrics(paths.metrics)[-1]
    # 16 rows a step, each trained on once; the collector never ran past the next batch
    assert last["charts/rows_trained"] == 6 * 16
    assert writer.most_ahead <= 16 + 16  # the batch being trained on + the next one
    assert writer.store.next_row == 6 * 16
    assert read_intake(paths.pacing).last_step
    assert last["charts/staleness_p90"] >= last["charts/staleness_p50"] >= 0


def test_several_collectors_and_a_late_one_feed_the_learner_without_deadlock(tmp_path):
    paths, writers = paced_run(tmp_path, writers=3, max_lag=2, steps=12, late=2)
    records = read_metrics(paths.metrics)
    assert records[-1]["charts/rows_trained"] == 12 * 16
    # the late collector got its rows in, and the learner trained rows of more than one shard (whether
    # one batch mixes them is timing: on a loaded machine one writer alone fed whole batches); the
    # exact sampler trains on rows in write order, so nearly all that was written was trained on:
    # each shard is at most its share of the next two batches and one round past the learner's intake
    consumed = read_intake(paths.pacing).consumed
    assert writers[2].store.next_row > 0 and sum(1 for rows in consumed.values() if rows) >= 2, consumed
    assert sum(w.store.next_row for w in writers) <= 12 * 16 + 3 * (2 * ROUND + ROUND)
    # each at most its share of the next two batches and the round that crossed it. A share is the
    # draw over the shards the learner has taken rows of: 16 / 2 while the late one is unseen, but the
    # whole 16 while a loaded machine has let one writer alone reach the learner's first intakes
    assert all(w.most_ahead <= 2 * 16 + ROUND for w in writers)


def test_a_batch_of_two_rounds_with_nothing_ahead_does_not_deadlock(tmp_path):
    """The learner says it needs 32 rows; a paced collector writes both rounds, then waits."""
    paths, (writer,) = paced_run(tmp_path, writers=1, max_lag=1, steps=3, batch_size=32)
    assert read_metrics(paths.metrics)[-1]["charts/rows_trained"] == 3 * 32
    assert writer.store.next_row <= 4 * 32


def test_a_resumed_learner_republishes_its_checkpoints_intake(tmp_path):
    """Collectors that ran ahead of a learner's last checkpoint wait while it catches up."""
    paths, (writer,) = paced_run(tmp_path, writers=1, max_lag=1, steps=3)
    PacingPublisher(paths.pacing).publish(LearnerIntake(9, 9, {"shard-0000": 999}, 16, waiting_since=1.0))
    resumed = Learner(LearnerSettings(batch_size=16, sampler="exact", max_staleness=None), paths,
                      make_model=make_model, steps=5, seed=0, show_progress=False)
    resumed.setup()
    try:
        intake = read_intake(paths.pacing)
        # the third batch (48 rows) was taken when 2 steps were done; the old wait is over
        assert (intake.step, intake.draws, intake.consumed, intake.waiting_since) == (2, 3, {"shard-0000": 48}, None)
        assert not intake.last_step  # its checkpoint's draw was the last of 3 steps; it now takes 5
    finally:
        resumed.cleanup()


def test_the_draws_taken_since_the_checkpoint_stay_on_record_until_a_learner_takes_them_in_again(tmp_path):
    """``pacing.json`` records each draw taken in since the checkpoint (what a resumed learner's exact
    sampler takes again). A learner resumed from the checkpoint of draw 1 and killed again after taking
    in draw 2 as recorded leaves draw 3 on record; one that took other rows into draw 2 ends the record."""
    killed = PacingPublisher(tmp_path / "pacing.json")
    for draws in (1, 2, 3):
        killed.publish(LearnerIntake(step=draws, draws=draws, consumed={"shard-0000": 8 * draws, "shard-0001": draws}))
    recorded = read_intake(tmp_path / "pacing.json").taken_since_checkpoint
    assert recorded == [(d, {"shard-0000": 8 * d, "shard-0001": d}) for d in (1, 2, 3)]

    resumed = PacingPublisher(tmp_path / "pacing.json")
    assert resumed.published().taken_since_checkpoint == recorded  # what a learner reads before it publishes
    intake = LearnerIntake(step=1, draws=1, consumed=dict(recorded[0][1]))
    intake.taken_since_checkpoint = recorded[1:]  # the checkpoint's intake, with what is to be taken again
    resumed.publish(intake, new_draw=False)
    resumed.publish(LearnerIntake(step=2, draws=2, consumed=dict(recorded[1][1])))
    assert read_intake(tmp_path / "pacing.json").taken_since_checkpoint == recorded[1:]  # the kill here keeps draw 3

    resumed.publish(LearnerIntake(step=2, draws=2, consumed={"shard-0000": 12}))  # other rows than recorded
    assert read_intake(tmp_path / "pacing.json").taken_since_checkpoint == [(2, {"shard-0000": 12})]


class VersionedWriter(PacedWriter):
    """A :class:`PacedWriter` that stamps each round with the policy version pacing names for it, as
    ``collect_main`` samples it, and waits for the stall rule never (``stall_s`` out of reach)."""

    def __init__(self, paths: RunPaths, max_lag: int) -> None:
        super().__init__(paths, 0, max_lag)
        self.pacer.stall_s = 1e9
        self.versions: list[int] = []  # of each round

    def run(self) -> None:
        while not self.stop.is_set():
            plan = self.pacer.plan_round(self.store.next_row)
            if not plan.allowed:
                time.sleep(0.005)
                continue
            groups = self.store.next_row // 4
            self.versions.append(plan.version or 0)
            self.store.append(make_batch(2, 4, seed=groups, optional=("advantage",), first_group_id=groups,
                                         first_trajectory_id=4 * groups, policy_version=self.versions[-1],
                                         vocab_size=len(TOKENIZER)))
            self.pacer.round_written(ROUND)


def test_rows_the_learner_passes_over_as_stale_are_written_again_with_its_draws_version(tmp_path):
    """max_staleness=0: after each step every row written ahead is stale for the next draw, which
    needs a whole batch more than the learner's intake said. It says so while it waits (``lacking``),
    and the collector writes it with the version that draw trains with; with only the stall rule to
    go by (out of reach here) the learner waited till its data timeout."""
    paths = RunPaths(tmp_path / "run")
    publish_weights(paths.root, make_model().state_dict(), 0)
    writer = VersionedWriter(paths, max_lag=2)
    settings = LearnerSettings(batch_size=8, sampler="exact", micro_batch_tokens=4096, max_staleness=0,
                               checkpoint_every=1000, data_timeout_s=60)
    learner = Learner(settings, paths, make_model=make_model, steps=3, seed=0, show_progress=False)
    writer.start()
    try:
        learner.setup()
        assert learner.train() is True
    finally:
        learner.cleanup()
        writer.stop.set()
        writer.join(timeout=30)
        writer.store.close()
    records = read_metrics(paths.metrics)
    assert [r["charts/rows_dropped_stale_total"] for r in records] == [0, 16, 32]  # two rounds ahead, each step
    assert writer.versions[:7] == [0, 0, 0, 1, 1, 1, 2]  # rounds 3 and 6: what draws 1 and 2 lacked


def test_a_draw_that_trains_nothing_is_not_the_learners_last_step(tmp_path):
    """Multi-turn rows of which none ends a trajectory train nothing: the learner draws again, so a
    last-step intake then would keep collectors from writing the rows it waits for."""
    import torch

    paths = RunPaths(tmp_path / "run")
    publish_weights(paths.root, make_model().state_dict(), 0)
    store = create_store(paths.shard(0), "memmap", schema=StoreSchema(optional=("advantage",)), segment_rows=64)
    turns = make_batch(1, 4, optional=("advantage",), vocab_size=len(TOKENIZER)).with_columns(  # 3 turns, then 1
        trajectory_id=torch.tensor([0, 0, 0, 1]), step=torch.tensor([0, 1, 2, 0], dtype=torch.int32),
        done=torch.tensor([False, False, True, True]), terminated=torch.tensor([False, False, True, True]),
        truncated=torch.zeros(4, dtype=torch.bool))
    store.append(turns.select(torch.arange(2)))  # no trajectory ended yet
    settings = LearnerSettings(batch_size=2, sampler="exact", micro_batch_tokens=4096, max_staleness=None,
                               data_timeout_s=60)
    run = Learner(settings, paths, make_model=make_model, steps=1, seed=0, show_progress=False)
    run.setup()
    finished = []
    learner = threading.Thread(target=lambda: finished.append(run.train()), daemon=True)
    learner.start()
    try:
        deadline = time.monotonic() + 60
        while (intake := read_intake(paths.pacing)) is None or intake.draws < 1:
            assert time.monotonic() < deadline and learner.is_alive(), "the learner published no first draw"
            time.sleep(0.01)
        assert not intake.last_step and not finished
        store.append(turns.select(torch.arange(2, 4)))
        learner.join(timeout=60)
        assert finished == [True]
        assert (read_intake(paths.pacing).draws, read_intake(paths.pacing).last_step) == (2, True)
    finally:
        run.cleanup()
        store.close()


def _waiting_lines(tmp_path, capsys, *, groups_written: int, steps: int, data_timeout_s: float) -> list[str]:
    """A learner over one shard holding ``groups_written`` groups of 4, run until its data timeout:
    the lines it printed while it waited (``wait_report_s`` 0.3)."""
    from rlhf_pipeline.learn.errors import DataTimeoutError

    paths = RunPaths(tmp_path / "run")
    publish_weights(paths.root, make_model().state_dict(), 0)
    store = create_store(paths.shard(0), "memmap", schema=StoreSchema(optional=("advantage",)), segment_rows=64)
    if groups_written:
        store.append(make_batch(groups_written, 4, seed=1, optional=("advantage",), vocab_size=len(TOKENIZER)))
    settings = LearnerSettings(batch_size=16, sampler="exact", max_staleness=None, data_timeout_s=data_timeout_s,
                               wait_report_s=0.3)
    learner = Learner(settings, paths, make_model=make_model, steps=steps, seed=0, show_progress=False)
    learner.setup()
    try:
        with pytest.raises(DataTimeoutError):
            learner.train()
    finally:
        learner.cleanup()
        store.close()
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("[learner] waiting")]


def test_a_learner_that_waits_long_says_in_one_line_what_for(tmp_path, capsys):
    """Issue 32: a stalled run printed nothing for 9 minutes. Past learner.wait_report_s the learner
    says what it waits for (the rows its next draw needs, the rows there) and why it lacks them."""
    lines = _waiting_lines(tmp_path, capsys, groups_written=2, steps=2, data_timeout_s=2.0)  # 8 of the 16 rows
    assert lines  # once past 0.3 s (and again each time the wait doubles)
    assert "for the batch of step 1: its next draw needs 16 new rows; the buffer holds 8 past the rows taken in " \
           "(shard-0000: 8); no collector has written a row since the wait began" in lines[0], lines[0]


def test_a_learner_waiting_for_the_first_rows_says_the_collectors_are_starting(tmp_path, capsys):
    """A vLLM engine takes tens of seconds to start: meanwhile the learner's line said "no collector
    has written a row since the wait began: is one running?", which read like a failure."""
    lines = _waiting_lines(tmp_path, capsys, groups_written=0, steps=1, data_timeout_s=1.0)
    assert lines and "no collector has written a row yet: they are starting" in lines[0], lines
    assert "is one running" not in lines[0]
