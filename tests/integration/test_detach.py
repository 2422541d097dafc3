"""``rlhf-pipeline detach BRANCH``: a branch of a run with collectors copies the parent rows it reads
into its own store; then the parent's directory is deleted and the branch, resumed with the same
``replay`` command, trains what an undetached twin trains (same rows, losses, weights). Every state
a kill can leave mid-detach (a partial copy; a whole copy not switched to; switched but not
recorded in ``branch.json``) reads the same rows and finishes with ``detach`` run again, and so
does a ``detach`` killed with SIGKILL while it copies.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from integration.test_branch import DEFAULT, ONLINE, REPO, digest, rows, trained
import preloaded

from rlhf_pipeline.cli.main import main
from rlhf_pipeline.coordination.weights import load_weights
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.runs.replay import ReplayOptions, replay_command
from rlhf_pipeline.storage import open_buffer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


def replay_branch(home, name: str, steps: int) -> None:
    assert replay_command(DEFAULT, ReplayOptions(buffer=str(home / name / "parent-rows"), steps=steps),
                          home=str(home), run_name=name, overrides=ONLINE) == 0


def held_ids(selection) -> list[int]:
    with open_buffer(selection) as store:
        return store.read(torch.arange(len(store)), fields=("trajectory_id",))["trajectory_id"].tolist()


@pytest.fixture()
def home(online_parent):
    """Where a parent trained 8 steps with its collector is (tests/integration/conftest.py); branches at
    step 4 made by the tests beside it."""
    return online_parent.parent


def test_a_detached_branch_trains_the_same_after_its_parent_is_deleted(home, capsys):
    parent = home / "doomed"  # a copy of the parent, deleted below (the other tests keep theirs)
    shutil.copytree(home / "parent", parent)
    assert main(["branch", str(home / "parent"), "--from-step", "4", "twin"]) == 0
    assert main(["branch", str(parent), "--from-step", "4", "alone"]) == 0
    replay_branch(home, "twin", 10)  # the undetached twin, trained while the parent exists
    replay_branch(home, "alone", 6)  # half way, then detached
    before = held_ids(home / "alone" / "parent-rows")
    parent_files = digest(parent)
    capsys.readouterr()
    assert main(["detach", str(home / "alone")]) == 0
    assert f"{len(before)} parent rows copied into {home / 'alone' / 'own-rows'}" in capsys.readouterr().err
    assert digest(parent) == parent_files  # detaching only read the parent
    lineage = json.loads((home / "alone" / "branch.json").read_text())
    assert lineage["parent"] == str(parent) and lineage["step"] == 4 and lineage["detached"]["rows_copied"] == len(
        before)
    assert main(["detach", str(home / "alone")]) == 0  # again: nothing left to do, and said so
    again = capsys.readouterr().err
    assert f"{home / 'alone'} was already self-contained, detached {lineage['detached']['at']}" in again, again
    assert again.rstrip().endswith("; nothing to do")

    shutil.rmtree(parent)
    assert held_ids(home / "alone" / "parent-rows") == before  # the same rows at the same positions
    replay_branch(home, "alone", 10)  # resumes from its step-6 checkpoint, over its own rows
    alone, twin = home / "alone", home / "twin"
    assert [m["step"] for m in read_metrics(alone / "metrics.jsonl")] == list(range(1, 11))
    assert rows(alone) == rows(twin) and trained(alone) == trained(twin)
    (wa, va), (wb, vb) = load_weights(alone), load_weights(twin)
    assert va == vb and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert main(["inspect", str(alone)]) == 0  # the lineage is kept
    assert f"branched from  {parent} at step 4" in capsys.readouterr().out
    assert main(["inspect", str(home / "parent")]) == 0  # the twin still reads the parent's rows
    assert f"{twin} (from step 4; reads the parent's rows below" in capsys.readouterr().out


@pytest.mark.parametrize("stopped_after", ["partial copy", "whole copy", "switch"])
def test_a_detach_stopped_anywhere_leaves_the_branch_usable_and_runs_again(home, stopped_after, capsys):
    """What SIGKILL leaves at each point between the atomic steps (runs/detach.py), made by
    detaching a twin and taking the later steps back."""
    parent, name = home / "parent", f"cut-{stopped_after.replace(' ', '-')}"
    assert main(["branch", str(parent), "--from-step", "4", name]) == 0
    branch = home / name
    rows_read = held_ids(branch / "parent-rows")
    if stopped_after == "switch":  # the selection points at own-rows, branch.json does not say so yet
        lineage = json.loads((branch / "branch.json").read_text())
        assert main(["detach", str(branch)]) == 0
        (branch / "branch.json").write_text(json.dumps(lineage))
    else:  # the copy made, or being made; the selection untouched
        twin = home / f"{name}-twin"
        assert main(["branch", str(parent), "--from-step", "4", twin.name]) == 0
        assert main(["detach", str(twin)]) == 0
        target = branch / ("own-rows.partial" if stopped_after == "partial copy" else "own-rows")
        shutil.copytree(twin / "own-rows", target)
        if stopped_after == "partial copy":  # a torn copy: one data file cut short
            torn = max((p for p in target.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
            torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
    assert held_ids(branch / "parent-rows") == rows_read  # usable as it is
    assert main(["detach", str(branch)]) == 0
    assert json.loads((branch / "branch.json").read_text())["detached"]
    assert not (branch / "own-rows.partial").exists() and not (branch / "parent-rows" / "rows.npy").exists()
    assert held_ids(branch / "parent-rows") == rows_read
    capsys.readouterr()


def test_detach_of_what_is_no_branch_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    assert main(["detach", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "is no branch" in err and len(err.splitlines()) == 1


def test_detach_killed_mid_copy_leaves_the_branch_usable_and_finishes_when_run_again(tmp_path):
    """A real SIGKILL while ``detach`` copies: a branch whose ``parent-rows/`` names every other row of a
    parent buffer of 400,000 rows (large enough that the copy is under way when the kill lands)."""
    import numpy as np
    from helpers import kill_when

    from rlhf_pipeline.models import char_tokenizer
    from rlhf_pipeline.schema import StoreSchema
    from rlhf_pipeline.schema.synthetic import synthetic_batches
    from rlhf_pipeline.storage import create_store
    from rlhf_pipeline.storage.selection import write_selection

    parent, branch = tmp_path / "parent", tmp_path / "branch"
    store = None
    for batch in synthetic_batches(400_000, group_size=4, prompt_len=(3, 8), response_len=(1, 6), batch_size=100_000,
                                   seed=0, optional_fields=("advantage",), vocab_size=len(char_tokenizer())):
        if store is None:
            store = create_store(parent / "buffer", "memmap", schema=StoreSchema.for_batch(batch), segment_rows=65_536)
        store.append(batch)
    kept = np.arange(0, len(store), 2)
    branch.mkdir()
    write_selection(branch / "parent-rows", store, np.zeros(kept.size, dtype=np.int64), kept, where="every other row")
    store.close()
    (branch / "branch.json").write_text(json.dumps({"parent": str(parent), "step": 2, "replay_source": None}))
    with open_buffer(branch / "parent-rows") as selection:
        sample = torch.tensor([0, 1, kept.size // 2, kept.size - 1])
        expected = selection.read(sample, fields=("trajectory_id", "response_tokens"))
    parent_files = digest(parent)

    partial = branch / "own-rows.partial"
    started = preloaded.Popen([sys.executable, "-m", "rlhf_pipeline.cli.main", "detach", str(branch)], cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = kill_when(started, lambda: partial.is_dir() and sum(p.stat().st_size for p in partial.rglob("*")
                                                              if p.is_file()) > 2**20, poll_s=0.01, wait_s=60)
    assert started.returncode == -signal.SIGKILL, err[-3000:]
    assert partial.exists() and not (branch / "own-rows").exists(), "the kill came after the copy"
    assert "detached" not in json.loads((branch / "branch.json").read_text())
    with open_buffer(branch / "parent-rows") as selection:  # usable: still the parent's rows
        assert selection.read(sample, fields=("trajectory_id", "response_tokens")).equal(expected)

    assert main(["detach", str(branch)]) == 0  # re-run: removes the torn copy, copies again, switches
    assert not partial.exists() and json.loads((branch / "branch.json").read_text())["detached"]["rows_copied"] == \
        kept.size
    assert digest(parent) == parent_files
    shutil.rmtree(parent)
    with open_buffer(branch / "parent-rows") as selection:
        assert len(selection) == kept.size
        assert selection.read(sample, fields=("trajectory_id", "response_tokens")).equal(expected)
