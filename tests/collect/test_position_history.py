"""A collector's position history: the writer state its store published after each round, by the
store's row count, kept on the checkpoint schedule, and agreeing with the store after a kill at any
point of a round."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from rlhf_pipeline.collect.position_history import PositionHistory, history_key
from rlhf_pipeline.files.run_store import LocalRunStore
from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage import create_store, open_store
from rlhf_pipeline.storage.writer_state import decode, encode

from helpers import make_batch, process_running

REPO = Path(__file__).resolve().parents[2]


def state(round_: int) -> dict:
    """What a collector's state_dict holds, made from the round: prompts, counters, RNG, version."""
    rng = torch.Generator()
    rng.manual_seed(round_)
    return {"prompts": {"position": round_ * 2}, "groups_emitted": round_ * 2, "trajectories_emitted": round_ * 8,
            "batches_emitted": round_, "policy_version": round_ // 2, "rng": rng.get_state(),
            "config": {"collector_index": 0}, "runner": {"rounds_at_version": round_ - 1}}


def published(round_: int) -> bytes:
    """The writer state a buffer publishes with the rows of ``round_`` rounds."""
    return encode(state(round_), [])


def commit_rounds(directory: Path, rounds: range, kept=lambda: None) -> PositionHistory:
    """Rounds as ``collect_main`` commits them: the append with its state, then the history entry."""
    store = open_store(directory / "shard", mode="a")
    history = PositionHistory(LocalRunStore(directory / "collector"), history_key("shard-0000.pt"), kept)
    if store.writer_state is not None and not history.has(store.next_row):  # what a start does
        history.record(store.next_row, store.writer_state)
    start = store.next_row // 8  # a restarted collector goes on from the rounds written
    try:
        for round_ in (start + r for r in rounds):
            store.append(make_batch(2, 4), writer_state=published(round_ + 1))
            history.record(store.next_row, store.writer_state)
    finally:
        store.close()
    return history


def test_each_round_is_kept_by_its_row_count_and_pruned_to_what_kept_checkpoints_name(tmp_path):
    create_store(tmp_path / "shard", "memmap", schema=StoreSchema()).close()
    commit_rounds(tmp_path, range(6))
    history = PositionHistory(LocalRunStore(tmp_path / "collector"), history_key("shard-0000.pt"))
    assert history.rows() == [8 * r for r in range(1, 7)]
    at_24 = history.state_at(24)
    assert at_24["committed"]["batches_emitted"] == 3 and at_24["loop"] == {"rounds_at_version": 2}
    assert at_24["pending_rows"] == 0
    assert torch.equal(at_24["committed"]["rng"], state(3)["rng"])
    # checkpoints kept at 16 and 32 rows: the rest before the newest goes, what follows it stays
    pruned = PositionHistory(LocalRunStore(tmp_path / "collector"), history_key("shard-0000.pt"),
                             lambda: [16, 32])
    assert pruned.prune() == [8, 24]
    assert pruned.rows() == [16, 32, 40, 48]


def test_a_history_made_before_the_learner_kept_the_weights_still_gives_the_ones_it_linked(tmp_path):
    """Runs made before the learner kept the versions a branch needs kept links to them in the history:
    a branch still finds them there; a history now records states only."""
    history = PositionHistory(LocalRunStore(tmp_path / "collector"), "shard-0000.history")
    (tmp_path / "collector" / "shard-0000.history").mkdir(parents=True)
    (tmp_path / "collector" / "shard-0000.history" / "policy_00000001").write_bytes(b"v1")  # an older run's link
    for round_ in range(1, 4):  # states holding versions 0, 1, 1
        history.record(8 * round_, published(round_))
    assert history.weights_key(0) is None
    assert (tmp_path / "collector" / history.weights_key(1)).read_bytes() == b"v1"
    assert sorted(p.name for p in (tmp_path / "collector" / "shard-0000.history").iterdir()) == [
        "policy_00000001", "row_000000000008.pt", "row_000000000016.pt", "row_000000000024.pt"]


def test_an_older_historys_links_go_once_no_entry_left_held_their_versions(tmp_path):
    """Those links were never pruned: a run made before the learner kept versions, resumed now, kept up to
    checkpoint_every versions of the weights for ever. Once the entries that held a version are pruned, its
    link goes; what an entry left held, and anything newer, stays."""
    where = tmp_path / "collector" / "shard-0000.history"
    where.mkdir(parents=True)
    for version in range(4):
        (where / f"policy_{version:08d}").write_bytes(b"v%d" % version)
    kept = []  # no checkpoint yet: nothing is pruned
    history = PositionHistory(LocalRunStore(tmp_path / "collector"), "shard-0000.history", lambda: list(kept))
    for round_ in range(1, 8):  # the states of rows 8, 16, ... hold versions 0, 1, 1, 2, 2, 3, 3
        history.record(8 * round_, published(round_))
    assert len(list(where.glob("policy_*"))) == 4
    kept[:] = [16]  # a checkpoint kept at row 16 (version 1 held there): the links of versions 1 and later stay
    history.record(8 * 8, published(8))
    assert sorted(p.name for p in where.iterdir() if p.name.startswith("policy_")) == [
        "policy_00000001", "policy_00000002", "policy_00000003"]
    kept[:] = [40]  # only the checkpoint at row 40 (version 2 held) is kept now
    history.record(8 * 9, published(9))
    assert history.rows() == [40, 48, 56, 64, 72]
    assert sorted(p.name for p in where.iterdir() if p.name.startswith("policy_")) == [
        "policy_00000002", "policy_00000003"]
    (where / "row_000000000064.pt").write_bytes(b"damaged")  # what it held is unknown: nothing more goes
    kept[:] = [56]
    history.record(8 * 10, published(10))
    assert (where / "policy_00000002").exists()


# a process that imports once, then forks a child per line it reads: the child commits rounds until the
# test kills it, and the process says the child's pid, then "reaped" when it is gone (a start of its
# own for each child would import torch again, seconds of CPU each)
FORKER = """
import os, sys
sys.path[:0] = [{tests!r}, {collect!r}]
from pathlib import Path
from test_position_history import commit_rounds
for _ in sys.stdin:
    pid = os.fork()
    if pid == 0:
        commit_rounds(Path({directory!r}), range(10_000))
        os._exit(0)
    print(pid, flush=True)
    os.waitpid(pid, 0)
    print("reaped", flush=True)
"""


def test_a_kill_at_any_moment_of_a_round_leaves_a_history_the_reload_agrees_with(tmp_path):
    """A child commits rounds until it is killed with SIGKILL, several times at random moments;
    each reload finds the state it resumes from in the history, under the store's row count, and
    every entry the history lists loads whole."""
    create_store(tmp_path / "shard", "memmap", schema=StoreSchema()).close()
    script = FORKER.format(tests=str(REPO / "tests"), collect=str(REPO / "tests" / "collect"), directory=str(tmp_path))
    forker = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        for kill in range(4):
            rounds_before = open_store(tmp_path / "shard", mode="r").next_row
            forker.stdin.write("commit\n")
            forker.stdin.flush()
            child = int(forker.stdout.readline())
            deadline = time.monotonic() + 120
            while process_running(child) and time.monotonic() < deadline:  # until it commits rounds of its own
                with open_store(tmp_path / "shard", mode="r") as store:
                    if store.next_row > rounds_before:
                        break
                time.sleep(0.01)
            time.sleep(0.05 + 0.07 * kill)  # then somewhere in a later round
            os.kill(child, signal.SIGKILL)
            assert forker.stdout.readline() == "reaped\n"
            commit_rounds(tmp_path, range(0))  # the next start: it keeps the entry a kill came before
            store = open_store(tmp_path / "shard", mode="r")
            history = PositionHistory(LocalRunStore(tmp_path / "collector"), history_key("shard-0000.pt"))
            resumed = decode(store.writer_state, store.location)["writer"]
            entry = history.state_at(store.next_row)
            assert resumed is not None and entry is not None, f"kill {kill}: nothing written yet"
            assert entry["committed"]["batches_emitted"] == resumed["batches_emitted"] == store.next_row // 8
            for row in history.rows():
                assert history.state_at(row)["committed"]["batches_emitted"] == row // 8
            store.close()
    finally:
        forker.kill()
        forker.communicate()


def test_a_crash_between_the_append_and_the_history_entry_is_kept_at_the_next_start(tmp_path):
    """Killed after the append, before the history entry: the next start finds the state the store
    published and keeps it under the new row count."""
    create_store(tmp_path / "shard", "memmap", schema=StoreSchema()).close()
    commit_rounds(tmp_path, range(2))
    with open_store(tmp_path / "shard", mode="a") as store:
        store.append(make_batch(2, 4), writer_state=published(3))  # the kill came before its entry
    history = commit_rounds(tmp_path, range(0))
    kept = history.state_at(24)
    assert kept["committed"]["batches_emitted"] == 3 and kept["loop"] == {"rounds_at_version": 2}
    assert torch.equal(kept["committed"]["rng"], state(3)["rng"])


def test_at_a_url_each_entry_is_one_put(s3_server, s3_env):
    """Nothing else per round: no copy of weights, no listing (the learner keeps what a branch needs)."""
    from rlhf_pipeline.files.object_run_store import ObjectRunStore

    store = ObjectRunStore(s3_server.url("run"))
    history = PositionHistory(store, "collector/shard-0000.history")
    with s3_server.requests.recording() as sent:
        for round_ in range(1, 5):
            history.record(8 * round_, published(round_))
    assert sorted(method for method, _ in sent) == ["PUT"] * 4, sent
    assert history.rows() == [8, 16, 24, 32] and history.held_at(32) == 2
