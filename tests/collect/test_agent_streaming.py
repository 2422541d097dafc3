"""An agent round's groups written as they end (``collect/commit.py``): each group once its
episodes all ended and the earlier groups are written, in several appends a round, and a crash
between two appends resumed to the same rows, each trajectory once."""

from __future__ import annotations

import pytest
import torch

from helpers import resume
from rlhf_pipeline.collect.commit import stored_in_round
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


def run_rounds(policy, where, rounds, *, crash_at_append=None):
    """Collects like ``collect_main`` does; ``crash_at_append=k``: stop right after the k-th append.
    Returns the stored rows, the appends of each round (the cut one's too) and the state it resumed from."""
    store = open_or_create(where / "buffer")
    buffer = make_replay_buffer(store, batch_size=4, transforms=[GroupAdvantage(GROUP_SIZE)])
    appends, per_round = [], []

    def sink(batch, writer_state):
        if crash_at_append is not None and len(appends) >= crash_at_append:
            raise Crash  # another episode's group, after the crash: nothing after a kill runs
        buffer.extend(batch, writer_state=writer_state)
        appends.append(0 if batch is None else len(batch))
        if len(appends) == crash_at_append:
            raise Crash

    collector = agent_collector(*policy, None, sink=sink, tasks_per_round=TASKS_PER_ROUND)
    resumed = resume(collector, store)
    try:
        for _ in range(rounds):
            before = len(appends)
            collector.collect()
            per_round.append(appends[before:])
    except Crash:
        per_round.append(appends[before:])  # the cut round's appends
    rows = store.read(torch.arange(len(store))) if len(store) else None
    store.close()
    return rows, per_round, resumed


@pytest.fixture(scope="module")
def reference(policy, tmp_path_factory):
    """Rows of ROUNDS uninterrupted rounds, and their appends."""
    rows, appends, _ = run_rounds(policy, tmp_path_factory.mktemp("uninterrupted"), ROUNDS)
    return rows, rows, appends


def test_an_agent_round_goes_to_the_store_in_groups_each_trajectory_whole(reference):
    rows, streamed, appends = reference
    assert any(len(a) > 1 for a in appends)  # groups really went to the store before the round ended
    assert streamed["trajectory_id"].tolist() == sorted(streamed["trajectory_id"].tolist())  # in group-id order
    trajectories = streamed["trajectory_id"].unique_consecutive()
    assert len(trajectories) == len(set(streamed["trajectory_id"].tolist()))  # each trajectory's rows together


@pytest.mark.parametrize("crash_at_append", [1, 2, 3, 5])
def test_a_crash_between_two_appends_resumes_to_the_same_rows_each_trajectory_once(policy, tmp_path, reference,
                                                                                   crash_at_append):
    rows, _, _ = reference
    # how a round splits into appends follows the environments' timing: this run's own appends
    cut_rows, appends, _ = run_rounds(policy, tmp_path, ROUNDS, crash_at_append=crash_at_append)
    flat = [n for a in appends for n in a]
    assert len(cut_rows) == sum(flat[:crash_at_append])
    round_ends = [int((rows["group_id"] < r * TASKS_PER_ROUND).sum()) for r in range(ROUNDS + 1)]
    finished = max(r for r, end in enumerate(round_ends) if end <= len(cut_rows))
    again, _, resumed = run_rounds(policy, tmp_path, ROUNDS - finished)
    # a round cut between two of its appends is run again from its start, its stored groups not rewritten
    assert (stored_in_round(resumed) > 0) == (len(cut_rows) not in round_ends)
    assert again.equal(rows)  # each trajectory once, none skipped, the same rows
