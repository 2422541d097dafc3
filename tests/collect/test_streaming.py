"""Streamed rounds (``stream_groups``): groups written in request order as prefixes of the round end,
the same rows as one append per round, and a crash between two appends resumed to the same rows."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhf_pipeline.collect.streaming import commit_in_order, stored_in_round
from rlhf_pipeline.generation.engine import CompletionGroup
from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage import create_store, open_store

from helpers import Crash, resume, store_sink
from stream_setup import APPENDS, ROUND_ROWS, collector, policy

ROUNDS = 4


@pytest.fixture(scope="module")
def tiny():
    return policy()


def run_rounds(tiny, store, rounds, *, stream=True, crash_at_append=None):
    """Collects like ``collect_main`` does; ``crash_at_append=k``: stop right after the k-th append.
    Returns the state it resumed from and the appends of each round."""
    streamer = collector(*tiny, store_sink(store, crash_after=crash_at_append), stream=stream)
    resumed = resume(streamer, store)
    done, sizes = 0, []
    try:
        while done < rounds:
            streamer.collect()
            sizes.append(streamer.last_metrics.get("chunks", 1.0))
            done += 1
    except Crash:
        pass
    return resumed, sizes


def stored(store):
    return store.read(torch.arange(len(store)))


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    """Rows of ROUNDS uninterrupted rounds, each one append."""
    where = tmp_path_factory.mktemp("reference")
    store = create_store(where / "buffer", "memmap", schema=StoreSchema())
    run_rounds(tiny, store, ROUNDS, stream=False)
    rows = stored(store)
    store.close()
    return rows


def test_streamed_rounds_store_the_rows_of_whole_rounds_byte_equal(tiny, tmp_path, reference):
    store = create_store(tmp_path / "buffer", "memmap", schema=StoreSchema())
    _, chunks = run_rounds(tiny, store, ROUNDS)
    rows = stored(store)
    store.close()
    assert chunks == [len(sizes) for sizes in APPENDS]  # rounds really went in several appends
    assert rows.equal(reference)
    assert rows["trajectory_id"].tolist() == list(range(ROUNDS * ROUND_ROWS))


@pytest.mark.parametrize("crash_at_append", [1, 2, 3, 4, 5, 7])
def test_a_crash_between_appends_resumes_to_the_same_rows_each_trajectory_once(tiny, tmp_path, reference,
                                                                               crash_at_append):
    store = create_store(tmp_path / "buffer", "memmap", schema=StoreSchema())
    run_rounds(tiny, store, ROUNDS, crash_at_append=crash_at_append)
    cut = len(store)
    store.close()
    store = open_store(tmp_path / "buffer", mode="a")  # the restarted process
    finished = cut // ROUND_ROWS
    resumed, _ = run_rounds(tiny, store, ROUNDS - finished)
    partial = stored_in_round(resumed) * 3  # groups of 3 rows
    rows = stored(store)
    store.close()
    assert rows["trajectory_id"].tolist() == list(range(ROUNDS * ROUND_ROWS))  # each once, none skipped
    assert rows.equal(reference)
    appends = [rows for sizes in APPENDS for rows in sizes]
    assert cut == sum(appends[:crash_at_append])
    # cut inside a round (after its first or second of several appends): generated again, the rest written
    assert partial == (cut % ROUND_ROWS)


def test_groups_are_committed_in_request_order_in_chunks_as_prefixes_complete():
    group = {i: CompletionGroup(i, [], 0) for i in range(7)}
    steps = [[group[2]], [group[0]], [group[1]], [group[4], group[5]], [group[3], group[6]]]  # ended together
    chunks = []
    timing = commit_in_order(iter(steps), 7, lambda groups, last: chunks.append(([g.index for g in groups], last)))
    assert chunks == [([0], False), ([1, 2], False), ([3, 4, 5, 6], True)]  # one append per step at most
    assert timing.metrics()["chunks"] == 3 and timing.metrics()["groups_per_chunk"] == 7 / 3
    with pytest.raises(RuntimeError, match="ended after 2 of 3 groups"):
        commit_in_order(iter(steps[:2]), 3, lambda groups, last: None)
    with pytest.raises(RuntimeError, match="twice or outside"):
        commit_in_order(iter([[group[1]], [group[1]]]), 3, lambda groups, last: None)


def test_an_engine_that_cannot_stream_is_refused_by_setting_name(tiny):
    from rlhf_pipeline.generation.engine import GenerationEngine

    class WholeRounds(GenerationEngine):  # the contract's default: no streaming
        name = "whole-rounds"

        def sample(self, requests, sampling, generator):
            raise AssertionError("never asked")

    model, tok = tiny
    with pytest.raises(ValueError, match=r"'generation.stream_groups' is on, but the whole-rounds engine cannot"):
        collector(WholeRounds([tok.eos_token_id]), tok, None, stream=True)


WORKER = """
import sys, time
sys.path[:0] = [{tests!r}, {tests!r}.rsplit("/", 1)[0]]
from stream_setup import collector, policy
from helpers import resume
from rlhf_pipeline.collect.streaming import stored_in_round
from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage import create_store, make_replay_buffer, open_store
from pathlib import Path

where = Path({where!r})
if (where / "buffer").exists():
    store = open_store(where / "buffer", mode="a")
else:
    store = create_store(where / "buffer", "memmap", schema=StoreSchema())
buffer = make_replay_buffer(store)
appends = 0
def sink(batch, writer_state):
    global appends
    buffer.extend(batch, writer_state=writer_state)
    appends += 1
    print("appended", appends, store.next_row, flush=True)
    if appends == {stall_at}:
        time.sleep(600)  # killed here, between this append and the next
streamer = collector(*policy(), sink, stream=True)
print("resumed", stored_in_round(resume(streamer, store) or {{}}) * 3, flush=True)
while store.next_row < {rows}:
    streamer.collect()
store.close()
print("done", flush=True)
"""


@pytest.mark.slow
def test_kill_9_of_a_collector_between_two_appends_of_a_round_resumes_to_the_same_rows(tmp_path, reference):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    tests = str(Path(__file__).resolve().parent)

    def worker(stall_at):
        script = tmp_path / f"worker-{stall_at}.py"
        script.write_text(WORKER.format(tests=tests, where=str(tmp_path), stall_at=stall_at,
                                        rows=ROUNDS * ROUND_ROWS))
        return subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)

    child = worker(stall_at=2)  # the second round's first append (of three), with this policy
    lines = []
    for line in child.stdout:
        lines.append(line.split())
        if line.startswith("appended 2 "):
            child.send_signal(signal.SIGKILL)
            break
    child.wait()
    assert child.returncode == -signal.SIGKILL
    cut = int(lines[-1][2])
    assert cut % ROUND_ROWS != 0  # the kill came inside a round, between two of its appends

    again = worker(stall_at=-1)
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 0, out
    assert f"resumed {cut - ROUND_ROWS}" in out  # the rows of the cut round stored before the kill
    store = open_store(tmp_path / "buffer", mode="r")
    rows = stored(store)
    store.close()
    assert rows["trajectory_id"].tolist() == list(range(ROUNDS * ROUND_ROWS))
    assert rows.equal(reference)
