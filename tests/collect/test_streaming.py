"""A round's groups written in group order as prefixes of the round end (``collect/commit.py``),
and a crash between two appends of a round resumed to the same rows, each trajectory once. Our loop
answers each request as soon as its rows stopped, so a round whose completions end apart goes to the
store in several appends; how many follows the timing, the rows never do."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhf_pipeline.collect.commit import InOrderCommit, stored_in_round
from rlhf_pipeline.generation.engine import CompletionGroup
from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage import create_store, open_store

from helpers import Crash, resume, store_sink
from stream_setup import GROUP_ROWS, ROUND_ROWS, collect_into, collector, policy

ROUNDS = 4


@pytest.fixture(scope="module")
def tiny():
    return policy()


def run_rounds(tiny, store, rounds, *, crash_at_append=None):
    """Collects like ``collect_main`` does; ``crash_at_append=k``: stop right after the k-th append.
    Returns the state it resumed from and the rows each append stored."""
    appends = []
    sink = store_sink(store, crash_after=crash_at_append)

    def counted(batch, writer_state):
        appends.append(0 if batch is None else len(batch))
        sink(batch, writer_state=writer_state)

    streamer = collector(*tiny, counted)
    resumed = resume(streamer, store)
    done = 0
    try:
        while done < rounds:
            streamer.collect()
            done += 1
    except Crash:
        pass
    return resumed, appends


def stored(store):
    return store.read(torch.arange(len(store)))


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    """Rows of ROUNDS uninterrupted rounds."""
    where = tmp_path_factory.mktemp("reference")
    store = create_store(where / "buffer", "memmap", schema=StoreSchema())
    run_rounds(tiny, store, ROUNDS)
    rows = stored(store)
    store.close()
    assert rows["trajectory_id"].tolist() == list(range(ROUNDS * ROUND_ROWS))  # in group-id order
    return rows


@pytest.mark.parametrize("crash_at_append", [1, 2, 3, 4, 5, 7])
def test_a_crash_between_appends_resumes_to_the_same_rows_each_trajectory_once(tiny, tmp_path, reference,
                                                                               crash_at_append):
    store = create_store(tmp_path / "buffer", "memmap", schema=StoreSchema())
    _, appends = run_rounds(tiny, store, ROUNDS, crash_at_append=crash_at_append)
    cut = len(store)
    store.close()
    assert cut == sum(appends[:crash_at_append])
    store = open_store(tmp_path / "buffer", mode="a")  # the restarted process
    finished = cut // ROUND_ROWS
    resumed, _ = run_rounds(tiny, store, ROUNDS - finished)
    rows = stored(store)
    store.close()
    assert rows["trajectory_id"].tolist() == list(range(ROUNDS * ROUND_ROWS))  # each once, none skipped
    assert rows.equal(reference)
    # cut inside a round (after one of its several appends): generated again, the rest written
    assert stored_in_round(resumed or {}) * GROUP_ROWS == cut % ROUND_ROWS


def test_groups_are_committed_in_request_order_in_chunks_as_prefixes_complete():
    group = {i: CompletionGroup([], 0, seed=i, index=i) for i in range(7)}
    steps = [[group[2]], [group[0]], [group[1]], [group[4], group[5]], [group[3], group[6]]]  # ended together
    chunks = []
    timing = commit_in_order(steps, 7, lambda groups, last: chunks.append(([g.index for g in groups], last)))
    assert chunks == [([0], False), ([1, 2], False), ([3, 4, 5, 6], True)]  # one append per step at most
    assert timing.metrics()["chunks"] == 3 and timing.metrics()["groups_per_chunk"] == 7 / 3
    with pytest.raises(RuntimeError, match="ended with 2 of its 3 groups"):
        commit_in_order(steps[:2], 3, lambda groups, last: None)
    with pytest.raises(RuntimeError, match="twice or outside"):
        commit_in_order([[group[1]], [group[1]]], 3, lambda groups, last: None)


def commit_in_order(steps, count, write):
    """The collector's use of :class:`InOrderCommit`: each list of groups that ended together, then finish."""
    commit = InOrderCommit(count, write)
    for ended_together in steps:
        commit.add(ended_together)
    return commit.finish()


WORKER = """
import sys, time
sys.path[:0] = [{tests!r}]
from stream_setup import ROUND_ROWS, collect_into

def stall(next_row):
    print("appended", next_row, flush=True)
    if next_row % ROUND_ROWS:
        time.sleep(600)  # killed here, between this append of a round and its next

collect_into({where!r}, {rows}, stall)
"""


@pytest.mark.slow
def test_kill_9_of_a_collector_between_two_appends_of_a_round_resumes_to_the_same_rows(tmp_path, reference):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    tests = str(Path(__file__).resolve().parent)

    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=tests, where=str(tmp_path), rows=ROUNDS * ROUND_ROWS))
    # stalls at the first append that leaves a round in part
    child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    lines = []
    for line in child.stdout:
        lines.append(line.split())
        if line.startswith("appended ") and int(line.split()[1]) % ROUND_ROWS:
            child.send_signal(signal.SIGKILL)
            break
    child.wait()
    if child.returncode == 0:
        pytest.skip("no round of this run went to the store in more than one append (every group of each round "
                    "was answered before the collector looked): nothing to kill between")
    assert child.returncode == -signal.SIGKILL
    cut = int(lines[-1][1])

    # the rerun, in this process (only the victim needs one of its own): it resumes with the rows of the
    # cut round stored before the kill
    assert collect_into(tmp_path, ROUNDS * ROUND_ROWS) == cut % ROUND_ROWS
    store = open_store(tmp_path / "buffer", mode="r")
    rows = stored(store)
    store.close()
    assert rows["trajectory_id"].tolist() == list(range(ROUNDS * ROUND_ROWS))
    assert rows.equal(reference)
