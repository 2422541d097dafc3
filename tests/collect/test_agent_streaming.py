"""Streamed agent rounds (``AgentCollectorConfig.stream_groups``): each group written once its
episodes all ended and the earlier groups are written, the same rows as one append per round, and a
crash between two appends resumed to the same rows, each trajectory once."""

from __future__ import annotations

import pytest
import torch

from helpers import resume
from rlhf_pipeline.collect.streaming import stored_in_round
from rlhf_pipeline.storage import make_replay_buffer
from rlhf_pipeline.transforms.group_advantage import GroupAdvantage

from agent_setup import GROUP_SIZE, agent_collector, open_or_create, tiny_policy

ROUNDS = 3
TASKS_PER_ROUND = 4


class Crash(Exception):
    """Stands for kill -9: nothing after the raise point runs (the restart is a fresh collector)."""


@pytest.fixture(scope="module")
def policy():
    return tiny_policy()


def run_rounds(policy, where, rounds, *, stream=True, crash_at_append=None):
    """Collects like ``collect_main`` does; ``crash_at_append=k``: stop right after the k-th append.
    Returns the appends of each round."""
    store = open_or_create(where / "buffer")
    buffer = make_replay_buffer(store, batch_size=4, transforms=[GroupAdvantage(GROUP_SIZE)])
    appends, per_round = [], []

    def sink(batch, writer_state):
        buffer.extend(batch, writer_state=writer_state)
        appends.append(0 if batch is None else len(batch))
        if len(appends) == crash_at_append:
            raise Crash

    collector = agent_collector(*policy, None, sink=sink, stream=stream, tasks_per_round=TASKS_PER_ROUND)
    resumed = resume(collector, store)
    try:
        for _ in range(rounds):
            before = len(appends)
            collector.collect()
            per_round.append(appends[before:])
    except Crash:
        pass
    rows = store.read(torch.arange(len(store))) if len(store) else None
    store.close()
    return rows, per_round, resumed


@pytest.fixture(scope="module")
def reference(policy, tmp_path_factory):
    """Rows of ROUNDS uninterrupted rounds, unstreamed (one append each), and the streamed appends."""
    rows, per_round, _ = run_rounds(policy, tmp_path_factory.mktemp("whole"), ROUNDS, stream=False)
    assert all(len(appends) == 1 for appends in per_round)
    streamed, streamed_appends, _ = run_rounds(policy, tmp_path_factory.mktemp("streamed"), ROUNDS)
    return rows, streamed, streamed_appends


def test_a_streamed_agent_round_stores_the_rows_of_the_whole_round(reference):
    rows, streamed, appends = reference
    assert any(len(a) > 1 for a in appends)  # groups really went to the store before the round ended
    assert streamed.equal(rows)
    trajectories = streamed["trajectory_id"].unique_consecutive()
    assert len(trajectories) == len(set(streamed["trajectory_id"].tolist()))  # each trajectory's rows together


@pytest.mark.parametrize("crash_at_append", [1, 2, 3, 5])
def test_a_crash_between_two_appends_resumes_to_the_same_rows_each_trajectory_once(policy, tmp_path, reference,
                                                                                   crash_at_append):
    rows, _, appends = reference
    flat = [n for a in appends for n in a]
    cut_rows, _, _ = run_rounds(policy, tmp_path, ROUNDS, crash_at_append=crash_at_append)
    assert len(cut_rows) == sum(flat[:crash_at_append])
    round_ends = [sum(sum(a) for a in appends[:r]) for r in range(ROUNDS + 1)]
    finished = max(r for r, end in enumerate(round_ends) if end <= len(cut_rows))
    again, _, resumed = run_rounds(policy, tmp_path, ROUNDS - finished)
    # a round cut between two of its appends is run again from its start, its stored groups not rewritten
    assert (stored_in_round(resumed) > 0) == (len(cut_rows) not in round_ends)
    assert again.equal(rows)  # each trajectory once, none skipped, the same rows
