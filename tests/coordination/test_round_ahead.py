"""When the next round may go to the engine while this one's tail decodes (``CollectorPacer.next_round_goes_ahead``):
only when pacing gives it the weights the collector holds, from the learner's intake alone, however
many of the round's remaining rows are written. Real pacing and weight files in a run directory."""

from __future__ import annotations

import dataclasses

from rlhf_pipeline.coordination.pacing import CollectorPacer, LearnerIntake, PacingPublisher
from rlhf_pipeline.coordination.weights import WeightsPoller, publish_weights
from rlhf_pipeline.models import char_tokenizer, tiny_causal_lm

ROUND = 8


def weights():
    return tiny_causal_lm(len(char_tokenizer()), hidden_size=16, num_layers=1, num_heads=2, seed=0).state_dict()


def ask(pacer, poller, shard_rows, *, version=0, rows_to_come=4):
    return pacer.next_round_goes_ahead(poller.store, shard_rows=shard_rows, rows_to_come=rows_to_come,
                                       policy_version=version)


def test_unpaced_rounds_go_ahead_until_a_newer_version_is_published(tmp_path):
    state = weights()
    publish_weights(tmp_path, state, 0)
    poller = WeightsPoller(tmp_path, current_version=0)
    pacer = CollectorPacer(tmp_path / "pacing.json", "shard-0000", max_lag=None, round_rows=ROUND)
    assert ask(pacer, poller, 100)
    publish_weights(tmp_path, state, 1)  # due: the next round waits for it, as without overlap
    assert not ask(pacer, poller, 100)
    assert ask(pacer, poller, 100, version=1)


def test_paced_rounds_go_ahead_only_with_the_version_pacing_pins_and_within_the_intakes_target(tmp_path):
    state = weights()
    publish_weights(tmp_path, state, 0)
    publish_weights(tmp_path, state, 1)
    poller = WeightsPoller(tmp_path, current_version=0)
    learner = PacingPublisher(tmp_path / "pacing.json")
    pacer = CollectorPacer(tmp_path / "pacing.json", "shard-0000", max_lag=2, round_rows=ROUND)
    # version 0's intake allows the shard up to 8 + 2 * 8 = 24 rows; version 1's up to 40
    learner.publish(LearnerIntake(step=1, draws=1, consumed={"shard-0000": 8}, next_draw_rows=8, policy_version=0))
    learner.publish(LearnerIntake(step=2, draws=2, consumed={"shard-0000": 24}, next_draw_rows=8, policy_version=1))
    assert ask(pacer, poller, 16, rows_to_come=4)  # 16..20 rows: pinned to version 0, which it holds
    # 20..24: with every row written the round starts at 24, which only version 1's intake allows
    assert not ask(pacer, poller, 20, rows_to_come=4)
    assert ask(pacer, poller, 24, version=1, rows_to_come=8)  # pinned to 1, held
    assert not ask(pacer, poller, 24, version=0, rows_to_come=8)  # pinned to 1, not loaded: waits, loads it
    # past every intake's target (40 rows): not allowed at all, whatever the stall rule says later
    assert not ask(pacer, poller, 36, version=1, rows_to_come=8)


def test_a_round_only_the_stall_rule_allows_does_not_go_ahead(tmp_path):
    publish_weights(tmp_path, weights(), 0)
    poller = WeightsPoller(tmp_path, current_version=0)
    learner = PacingPublisher(tmp_path / "pacing.json")
    pacer = CollectorPacer(tmp_path / "pacing.json", "shard-0000", max_lag=1, round_rows=ROUND, stall_s=0.0)
    intake = LearnerIntake(step=1, draws=1, consumed={"shard-0000": 8}, next_draw_rows=8, policy_version=0)
    learner.publish(intake)
    learner.publish(dataclasses.replace(intake, waiting_since=0.0, waiting_seen=1e12), new_draw=False)
    assert pacer.plan_round(16).allowed  # stalled
    assert not ask(pacer, poller, 16, rows_to_come=0)
