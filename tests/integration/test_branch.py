"""``rlhf-pipeline branch`` end to end, offline: a replay parent trained 12 steps, branched at step 6
twice (nothing changed; ``learner.lr`` changed), each branch continued with the parent's replay
command. The unchanged branch trains the parent's steps 7-12 exactly (rows, losses, weights);
the changed one trains the same rows with another learning rate; the parent's files are
byte-identical before and after; ``inspect`` shows the lineage; what cannot change is refused.

The recorded buffer is synthetic (tokens of the default pipeline's character vocabulary); every
run trains the default pipeline's tiny model on CPU.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import kill_when
import preloaded

from rlhf_pipeline.cli.main import main
from rlhf_pipeline.coordination.weights import load_weights
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.models import char_tokenizer
from rlhf_pipeline.runs.replay import ReplayOptions, replay_command
from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.schema.synthetic import synthetic_batch
from rlhf_pipeline.storage import create_store

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

REPO = Path(__file__).resolve().parents[2]
DEFAULT = str(REPO / "pipelines" / "default.py")
ROWS = 96  # 6 batches of 16: 2 epochs are 12 steps
SETTINGS = ["warm_start_steps=0", "hidden_size=32", "num_layers=1", "num_heads=2", "learner.batch_size=16",
            "learner.checkpoint_every=4", "learner.keep_checkpoints=1", "learner.checkpoint_keep_every=6",
            "learner.log_every=100"]
OPTIONS = {"epochs": 2, "seed": 3}
NOT_COMPARED = ("time", "tokens_per_s", "_s", "learning_rate")  # timings; the learning rate is compared apart


def digest(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(path.rglob("*"))}


def replay(home: Path, name: str, source: Path, *changes: str) -> Path:
    assert replay_command(DEFAULT, ReplayOptions(buffer=str(source), **OPTIONS), home=str(home), run_name=name,
                          overrides=SETTINGS + list(changes)) == 0
    return home / name


def trained(run: Path, after: int = 0) -> list[dict]:
    """Each step's metrics after ``after``, timings left out."""
    return [{k: v for k, v in m.items() if not any(t in k for t in NOT_COMPARED)}
            for m in read_metrics(run / "metrics.jsonl") if m["step"] > after]


def rows(run: Path) -> list[list[int]]:
    return [r["trajectory_ids"] for r in read_metrics(run / "batches.jsonl")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    data = tmp_path_factory.mktemp("recorded")
    recorded = synthetic_batch(ROWS, group_size=4, prompt_len=(3, 8), response_len=(1, 6), seed=0,
                               optional_fields=("advantage",), vocab_size=len(char_tokenizer()))
    recorded = recorded.with_columns(trajectory_id=torch.arange(ROWS), group_id=torch.arange(ROWS) // 4)
    source = data / "buffer"
    with create_store(source, "memmap", schema=StoreSchema.for_batch(recorded), segment_rows=32) as store:
        store.append(recorded)
    home = tmp_path_factory.mktemp("home")
    parent = replay(home, "parent", source)
    before = digest(parent)
    assert main(["branch", str(parent), "--from-step", "6", "same"]) == 0
    assert main(["branch", str(parent), "--from-step", "6", "faster", "--set", "learner.lr=1e-3"]) == 0
    assert digest(parent) == before  # branching only reads the parent
    same = replay(home, "same", source)
    faster = replay(home, "faster", source, "learner.lr=1e-3")
    assert digest(parent) == before  # nor does training a branch write to it
    return parent, same, faster


def test_a_branch_with_nothing_changed_trains_what_the_parent_trained_after_the_branch_step(runs):
    parent, same, _ = runs
    assert [m["step"] for m in read_metrics(same / "metrics.jsonl")] == list(range(1, 13))
    assert trained(same) == trained(parent)  # steps 1-6 copied, 7-12 trained again: the same
    assert rows(same) == rows(parent)
    parent_weights, version = load_weights(parent)
    same_weights, same_version = load_weights(same)
    assert version == same_version == 12
    assert all(torch.equal(parent_weights[k], same_weights[k]) for k in parent_weights)


def test_a_branch_with_another_learning_rate_trains_the_same_rows_otherwise(runs):
    parent, _, faster = runs
    assert rows(faster) == rows(parent)  # the same rows in the same order: the sampler resumed
    assert trained(faster, after=6) != trained(parent, after=6)
    lr = {m["step"]: m["charts/learning_rate"] for m in read_metrics(faster / "metrics.jsonl")}
    parent_lr = {m["step"]: m["charts/learning_rate"] for m in read_metrics(parent / "metrics.jsonl")}
    assert all(lr[s] == parent_lr[s] for s in range(1, 7))  # the parent's steps, kept
    # past its warm-up the default pipeline's schedule is constant: the parent's 3e-4, the branch's 1e-3
    assert {parent_lr[s] for s in range(7, 13)} == {3e-4} and {lr[s] for s in range(7, 13)} == {1e-3}
    # step 7 trains the branch point's weights on the same rows: the same loss; the update differs
    assert read_metrics(faster / "metrics.jsonl")[6]["losses/loss"] == read_metrics(parent / "metrics.jsonl")[6][
        "losses/loss"]
    parent_weights, _ = load_weights(parent)
    faster_weights, _ = load_weights(faster)
    assert any(not torch.equal(parent_weights[k], faster_weights[k]) for k in parent_weights)


def test_a_branch_of_a_parent_resumed_with_another_learning_rate_continues_with_it(runs, capfd):
    """A resume may change ``learner.*``; ``settings.json`` keeps the first start's settings, and a branch
    past the change took those: it trained its steps at a learning rate its parent had left. The resume
    records its change (``settings_history.json``): a branch past it continues with it and trains what
    the parent trained; a branch before it keeps the first one."""
    parent = runs[0]
    home, source = parent.parent, json.loads((parent / "settings.json").read_text())["replay"]["buffer"]
    keep_all = SETTINGS + ["learner.checkpoint_keep_every=2"]
    for steps, changes in ((4, []), (12, ["learner.lr=1e-3"])):
        assert replay_command(DEFAULT, ReplayOptions(buffer=source, steps=steps, seed=3), home=str(home),
                              run_name="changed", overrides=keep_all + changes) == 0
    assert "[replay] note: settings changed since step 4: learner.lr: was 0.0003, now 0.001" in capfd.readouterr().err
    changed = home / "changed"
    assert [m["charts/learning_rate"] for m in read_metrics(changed / "metrics.jsonl")][4:] == [1e-3] * 8

    assert main(["branch", str(changed), "--from-step", "6", "past-the-change"]) == 0
    err = capfd.readouterr().err
    assert "learner.lr: was 0.0003, now 0.001: the parent was resumed with it" in err, err
    assert "--steps: was 4, now 12: the parent's newest step" in err, err  # its record keeps the first --steps
    assert main(printed_command(err, "replay")[3:]) == 0
    assert "changed" not in capfd.readouterr().err
    past = home / "past-the-change"
    assert json.loads((past / "settings.json").read_text())["learner"]["lr"] == 1e-3
    assert trained(past) == trained(changed) and rows(past) == rows(changed)

    assert main(["branch", str(changed), "--from-step", "2", "before-the-change"]) == 0
    assert "resumed with it" not in capfd.readouterr().err
    assert json.loads((home / "before-the-change" / "settings.json").read_text())["learner"]["lr"] == 3e-4


def test_inspect_shows_the_lineage_and_the_rewind_points(runs, capsys):
    parent, same, faster = runs
    assert main(["inspect", str(parent), "--json"]) == 0
    lineage = json.loads(capsys.readouterr().out)["run"]
    # checkpoint_keep_every=6 saves step 6 too, between checkpoint_every=4's; keep_checkpoints=1
    assert [p["step"] for p in lineage["rewind_points"]] == [6, 12]
    # the module's later tests branch the parent again: under --dist worksteal one may run before this
    ours = [b for b in lineage["branches"] if b["run"] in (str(same), str(faster))]
    assert [(b["run"], b["step"]) for b in ours] == [(str(faster), 6), (str(same), 6)]
    assert [b["parent_rows"] for b in ours] == [None, None]  # a replay's branch reads its source
    assert main(["inspect", str(faster)]) == 0
    out = capsys.readouterr().out
    assert f"branched from  {parent} at step 6 (learner.lr: was 0.0003, now 0.001)" in out
    assert "buffer rows store=" in out and "of its own" not in out  # a replay's branch counts its source's rows


def test_plot_draws_each_branch_from_its_branch_step_beside_its_parent(runs):
    from rlhf_pipeline.dataio.plots import load_runs

    parent, same, faster = runs
    drawn = load_runs([parent, same, faster])
    assert list(drawn) == ["parent", "same (branch at step 6)", "faster (branch at step 6)"]
    assert [r["step"] for r in drawn["parent"].records] == list(range(1, 13))
    # with the parent plotted, a branch leaves its curve at the branch step (its earlier lines are the parent's)
    assert [r["step"] for r in drawn["faster (branch at step 6)"].records] == list(range(6, 13))
    assert drawn["faster (branch at step 6)"].branch_step == 6 and drawn["parent"].branch_step is None
    alone = load_runs([faster])  # without its parent: the whole curve, the branch step still marked
    assert [r["step"] for r in alone["faster (branch at step 6)"].records] == list(range(1, 13))


def test_a_branch_killed_mid_run_resumes_to_what_it_trains_uninterrupted(runs, capfd):
    """Two more branches at step 6, both trained to 4 epochs (24 steps): one in this process, one
    as the CLI runs it, killed with SIGKILL after its first steps and started again (the same command,
    in this process: the kill is what matters, and a process of its own would import torch again)."""
    parent, _, _ = runs
    home, source = parent.parent, Path(json.loads((parent / "settings.json").read_text())["replay"]["buffer"])
    assert main(["branch", str(parent), "--from-step", "6", "long"]) == 0
    assert main(["branch", str(parent), "--from-step", "6", "long-killed"]) == 0
    assert replay_command(DEFAULT, ReplayOptions(buffer=str(source), epochs=4, seed=3), home=str(home),
                          run_name="long", overrides=SETTINGS) == 0
    command = [sys.executable, "-m", "rlhf_pipeline.cli.main", "replay", DEFAULT, "--buffer", str(source),
               "--epochs", "4", "--seed", "3", "--home", str(home), "--run-name", "long-killed",
               *[word for setting in SETTINGS for word in ("--set", setting)]]
    env = dict(os.environ, OMP_NUM_THREADS="1")  # the in-process branch ran on one thread
    metrics = home / "long-killed" / "metrics.jsonl"
    first = preloaded.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    # whole lines only: the branch starts with the parent's 6; kill once it trained 3 of its own
    err = kill_when(first, lambda: metrics.read_text().count("\n") >= 9, timeout=240, poll_s=0.01, wait_s=60)
    assert first.returncode == -signal.SIGKILL, err[-3000:]
    assert 9 <= len(read_metrics(metrics)) < 24, "the kill came after the branch had finished; nothing was resumed"
    capfd.readouterr()
    assert main(command[3:]) == 0
    assert "resuming from" in capfd.readouterr().err
    killed, plain = home / "long-killed", home / "long"
    assert [m["step"] for m in read_metrics(metrics)] == list(range(1, 25))
    assert trained(killed) == trained(plain) and rows(killed) == rows(plain)
    killed_weights, version = load_weights(killed)
    plain_weights, _ = load_weights(plain)
    assert version == 24 and all(torch.equal(killed_weights[k], plain_weights[k]) for k in plain_weights)


def test_what_cannot_change_or_is_not_kept_is_refused_in_one_line(runs, capsys, tmp_path):
    parent, _, _ = runs
    assert main(["branch", str(parent), "--from-step", "6", str(tmp_path / "b"), "--set", "hidden_size=64"]) == 2
    err = capsys.readouterr().err
    assert "--set hidden_size: cannot change at a branch point" in err and len(err.strip().splitlines()) == 1
    assert main(["branch", str(parent), "--from-step", "4", str(tmp_path / "b")]) == 2
    assert "keeps no checkpoint of step 4 (kept: 6, 12)" in capsys.readouterr().err
    assert main(["branch", str(parent), "--from-step", "0", str(tmp_path / "b")]) == 2  # a replay starts over by its own
    assert "Step 0 is the initial policy" in (err := capsys.readouterr().err) and "give its replay command again" in err
    assert main(["branch", str(parent), "--from-step", "6", str(tmp_path / "b"), "--set", "learner.lr=fast"]) == 2
    assert "learner.lr" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()  # a refused branch leaves nothing behind
    # how far a collector may run ahead is the branch's to choose, as a resume's
    assert main(["branch", str(parent), "--from-step", "6", str(tmp_path / "paced"), "--set", "max_lag=0"]) == 0
    assert "max_lag: was 1, now 0" in capsys.readouterr().err
    assert json.loads((tmp_path / "paced" / "settings.json").read_text())["max_lag"] == 0
    # and whatever else a resume may change: evaluation, Ray's reservations, how the engine is reached, but
    # never the engine itself (a server address where the parent's own loop sampled)
    assert main(["branch", str(parent), "--from-step", "6", str(tmp_path / "evaluated"), "--set", "eval.every_steps=2",
                 "--set", "ray.max_restarts=5"]) == 0
    err = capsys.readouterr().err
    assert "eval.every_steps: was 0, now 2" in err and "ray.max_restarts: was 3, now 5" in err, err
    branch_settings = json.loads((tmp_path / "evaluated" / "settings.json").read_text())
    assert branch_settings["eval"]["every_steps"] == 2 and branch_settings["ray"]["max_restarts"] == 5
    assert main(["branch", str(parent), "--from-step", "6", str(tmp_path / "served"),
                 "--set", "generation.url=http://127.0.0.1:8000"]) == 2
    assert "--set generation.url: cannot change at a branch point" in capsys.readouterr().err
    assert not (tmp_path / "served").exists()


def test_a_branch_whose_parent_is_gone_is_refused_online_in_one_line(tmp_path, capsys):
    branch = tmp_path / "b"
    branch.mkdir()
    (branch / "branch.json").write_text(json.dumps({"parent": str(tmp_path / "a"), "step": 2}))
    assert main(["learn", DEFAULT, "--home", str(tmp_path), "--run-name", "b"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is a branch of" in err and "cannot continue online" in err and "replay" in err
    assert len(err.splitlines()) == 1
    (branch / "branch.json").write_text("{}")  # damaged: one line too
    assert main(["learn", DEFAULT, "--home", str(tmp_path), "--run-name", "b"]) == 2
    err = capsys.readouterr().err.strip()
    assert "branch.json is damaged" in err and len(err.splitlines()) == 1


# ============================================================ a parent with a collector
ONLINE = ["warm_start_steps=5", "prompts_per_round=4", "group_size=4", "learner.batch_size=16",
          "learner.sample_window=32", "learner.new_rows_per_step=16", "learner.checkpoint_every=2",
          "learner.keep_checkpoints=1", "learner.checkpoint_keep_every=4"]


def test_a_branch_of_a_run_with_collectors_replays_the_parents_rows_up_to_the_branch_step_only(online_parent,
                                                                                              capsys):
    from rlhf_pipeline.storage import open_buffer

    parent = online_parent  # tests/integration/conftest.py
    home = parent.parent  # where its branches are made
    before = digest(parent)
    assert main(["branch", str(parent), "--from-step", "4", "offline", "--set", "learner.lr=1e-3"]) == 0
    branch = home / "offline"
    assert f"rlhf-pipeline replay {branch / 'pipeline.py'} --buffer {branch / 'parent-rows'}" in capsys.readouterr().err
    record = json.loads((branch / "branch.json").read_text())
    with open_buffer(parent / "buffer") as whole, open_buffer(branch / "parent-rows") as at_step:
        published = sum(record["buffer_rows"].values())
        assert len(at_step) == published < len(whole)  # the parent wrote more rows after step 4
        everything = whole.read(torch.arange(len(whole)), fields=("trajectory_id",))["trajectory_id"].tolist()
        readable = set(at_step.read(torch.arange(len(at_step)), fields=("trajectory_id",))["trajectory_id"].tolist())
    later = set(everything) - readable
    assert later and readable < set(everything)
    # open_store opens one store: of a run's buffer or a branch's parent-rows it names open_buffer, which
    # reads them (it said "not a replay buffer ... a buffer is ... a run's buffer/", refusing one: issue 41)
    from rlhf_pipeline.storage import open_store
    from rlhf_pipeline.storage.errors import NotAStoreError

    for location in (parent / "buffer", branch / "parent-rows"):
        with pytest.raises(NotAStoreError, match=r"open_buffer\("):
            open_store(location)
    # what a branch reads verifies: the parent's shard its parent-rows/ reads, checked byte by byte
    assert main(["inspect", str(branch / "parent-rows"), "--verify", "--quiet"]) == 0
    verified = capsys.readouterr().out
    assert str(parent / "buffer" / "shard-0000") in verified and "no damage found" in verified, verified
    # a branch of a branch never continued reads the same rows, through its own copy of the selection
    assert main(["branch", str(branch), "--from-step", "4", "again"]) == 0
    with open_buffer(home / "again" / "parent-rows") as again:
        assert len(again) == published
    # offline it continues over those rows only (online: tests/integration/test_branch_online.py)
    assert replay_command(DEFAULT, ReplayOptions(buffer=str(branch / "parent-rows"), steps=8), home=str(home),
                          run_name="offline", overrides=ONLINE + ["learner.lr=1e-3"]) == 0
    metrics = read_metrics(branch / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 9))
    assert [m["charts/learning_rate"] for m in metrics[4:]] == [1e-3] * 4
    trained_ids = {i for r in read_metrics(branch / "batches.jsonl") for i in r["trajectory_ids"]}
    assert trained_ids and trained_ids <= readable and not trained_ids & later
    assert digest(parent) == before  # the parent's files were only read
    assert main(["learn", DEFAULT, "--home", str(home), "--run-name", "offline"]) == 2  # no longer online
    err = capsys.readouterr().err
    assert "it was continued offline already (it has a checkpoint of step 8)" in err
    # the command it names is the one branch printed: the branch's pipeline copy and every --set
    assert (f"continue it offline with rlhf-pipeline replay {branch / 'pipeline.py'} --buffer "
            f"{branch / 'parent-rows'} --home {home} --run-name offline --set group_size=4") in err, err
    assert "--set learner.lr=0.001" in err, err
    assert main(["inspect", str(branch)]) == 0
    assert f"branched from  {parent} at step 4" in capsys.readouterr().out
    assert main(["inspect", str(parent)]) == 0  # which of its rows each branch holds
    shards = ", ".join(f"{name}={n}" for name, n in sorted(record["buffer_rows"].items()))
    assert f"{branch} (from step 4; reads the parent's rows below {shards})" in capsys.readouterr().out
    # once replayed, the branch is a replay: its branches continue with replay over the same rows
    assert main(["branch", str(branch), "--from-step", "8", "later"]) == 0
    assert json.loads((home / "later" / "branch.json").read_text())["replay_source"] == str(
        branch / "parent-rows")


def test_a_parent_that_would_evict_rows_a_branch_reads_is_refused(tmp_path, capsys):
    from helpers import make_batch

    from rlhf_pipeline.storage.memmap import MemmapTrajectoryStore

    with MemmapTrajectoryStore.create(tmp_path / "parent" / "buffer" / "shard-0000", segment_rows=8,
                                      capacity_rows=16) as store:
        store.append(make_batch(2, 4))
    (tmp_path / "b" / "parent-rows").mkdir(parents=True)
    (tmp_path / "b" / "branch.json").write_text(json.dumps({"parent": str(tmp_path / "parent"), "step": 2}))
    assert main(["learn", DEFAULT, "--home", str(tmp_path), "--run-name", "parent"]) == 2
    err = capsys.readouterr().err.strip()
    assert "evicts its oldest rows" in err and str(tmp_path / "b") in err and len(err.splitlines()) == 1
    from rlhf_pipeline.runs.branch import refuse_evicting_parent

    (tmp_path / "b" / "parent-rows").rmdir()  # a branch that reads none of its rows does not hold it back
    refuse_evicting_parent(tmp_path / "parent")


def test_a_running_parent_whose_buffer_evicts_is_not_branched_and_a_stopped_one_cannot_start_meanwhile(
        tmp_path, capsys):
    """``branch`` holds the parent's run.lock while it makes a branch of a parent whose buffer evicts:
    a running parent is refused by name (its evictions could take the rows being named), and a
    parent started once the branch exists refuses to evict them."""
    from helpers import make_batch

    from rlhf_pipeline.learn.checkpoint import CheckpointManager, Progress
    from rlhf_pipeline.pipeline import RunPaths
    from rlhf_pipeline.runs.run_directory import hold_run_directory
    from rlhf_pipeline.storage.memmap import MemmapTrajectoryStore

    parent = tmp_path / "parent"
    with MemmapTrajectoryStore.create(parent / "buffer" / "shard-0000", segment_rows=8, capacity_rows=16) as store:
        store.append(make_batch(2, 4))
    (parent / "settings.json").write_text("{}")
    CheckpointManager(parent / "checkpoints", keep_last=3).save(
        Progress(seed=0, step=2), {"model": {"weight": torch.zeros(2)}},
        record={"buffer_rows": {"shard-0000": 8}, "policy_version": 2})
    with hold_run_directory(RunPaths(parent), "run"):  # the parent running
        assert main(["branch", str(parent), "--from-step", "2", "b"]) == 2
        err = capsys.readouterr().err.strip()
        assert "is running" in err and "evicts its oldest rows" in err and len(err.splitlines()) == 1, err
        assert not (tmp_path / "b").exists()
    assert main(["branch", str(parent), "--from-step", "2", str(tmp_path / "b")]) == 0  # stopped: branched
    assert main(["learn", DEFAULT, "--home", str(tmp_path), "--run-name", "parent"]) == 2
    assert "evicts its oldest rows" in capsys.readouterr().err


# ============================================================ the command branch prints
def printed_command(err: str, kind: str) -> list[str]:
    """The continuation command ``branch`` printed (``kind``: run or replay), as words to run."""
    import re
    import shlex

    line = next(line for line in err.splitlines() if "continue it" in line)
    found = re.search(rf"rlhf-pipeline {kind} .*?(?= \(or offline|$)", line)
    assert found, line
    words = shlex.split(found.group(0))
    return [sys.executable, "-m", "rlhf_pipeline.cli.main", *words[1:]]


def test_the_printed_replay_command_continues_the_branch_with_the_parents_settings(runs, capfd):
    """``branch`` printed ``replay PIPELINE.py ...`` with only the branch's --set: pasted, it was no
    command, and given the pipeline without the parent's other --sets the learner settings changed
    with only a note (issue 41). Now it is the parent's command, run here verbatim (its words, in this
    process: the online one, test_the_printed_run_command_..., is run as a command)."""
    parent, _, faster = runs
    assert main(["branch", str(parent), "--from-step", "6", "pasted", "--set", "learner.lr=1e-3"]) == 0
    command = printed_command(capfd.readouterr().err, "replay")
    assert command[:3] == [sys.executable, "-m", "rlhf_pipeline.cli.main"]
    assert main(command[3:]) == 0
    err = capfd.readouterr().err
    assert "resuming from" in err and "changed" not in err, err[-3000:]
    pasted = parent.parent / "pasted"
    assert json.loads((pasted / "settings.json").read_text()) == json.loads((faster / "settings.json").read_text())
    assert trained(pasted) == trained(faster) and rows(pasted) == rows(faster)


def test_the_printed_run_command_continues_a_branch_online_with_the_parents_settings(online_parent, tmp_path,
                                                                                     capsys):
    assert main(["branch", str(online_parent), "--from-step", "4", "online", "--set", "learner.lr=1e-3"]) == 0
    err = capsys.readouterr().err
    branch = online_parent.parent / "online"
    made_with = (branch / "settings.json").read_text()
    ran = preloaded.run(printed_command(err, "run"), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "resuming from" in ran.stderr and "changed" not in ran.stderr, ran.stderr[-3000:]
    assert (branch / "settings.json").read_text() == made_with
    metrics = read_metrics(branch / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 9))
    assert [m["charts/learning_rate"] for m in metrics[4:]] == [1e-3] * 4


def test_a_branch_of_a_parent_resumed_past_its_recorded_steps_trains_with_the_printed_command(online_parent,
                                                                                                tmp_path, capsys):
    """A parent started with ``--steps 4`` and resumed with ``--steps 8`` records ``steps: 4`` (a resume may
    raise it): its branches at step 4 or 8 take ``steps`` beyond their step, and the command printed
    trains there (it said "nothing to do" with ``--set steps=4``)."""
    import shutil

    resumed = tmp_path / "resumed"
    shutil.copytree(online_parent, resumed, ignore=shutil.ignore_patterns("tensorboard"))
    settings = json.loads((resumed / "settings.json").read_text())
    (resumed / "settings.json").write_text(json.dumps({**settings, "steps": 4}, indent=2, sort_keys=True))
    expected = {"to-newest": ("4", 8, "steps: was 4, now 8: the parent's newest step"),
                "further": ("8", 12, "steps: was 4, now 12: 4 past the branch point"),
                "chosen": ("4", 6, "steps: was 4, now 6")}
    for name, (step, steps, line) in expected.items():
        chosen = ["--set", "steps=6"] if name == "chosen" else []
        assert main(["branch", str(resumed), "--from-step", step, name, *chosen]) == 0
        err = capsys.readouterr().err
        assert f"({line}" in err and f"--set steps={steps} " in err, err
        assert json.loads((tmp_path / name / "settings.json").read_text())["steps"] == steps
    ran = preloaded.run(printed_command(err, "run"), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert [m["step"] for m in read_metrics(tmp_path / "chosen" / "metrics.jsonl")] == list(range(1, 7))


def test_a_run_resumed_with_another_learning_rate_records_it_once_for_its_branches(online_parent, tmp_path,
                                                                                    capsys):
    """The run side of the test above (``run`` prepares its directory as ``replay`` does): a resume from the
    checkpoint of step 8 with another ``learner.lr`` notes it against the steps before, records it from
    step 8, and a branch at 8 prints a command that continues with it; a resume with the same one notes
    nothing more."""
    import shutil

    resumed = tmp_path / "resumed"
    shutil.copytree(online_parent, resumed, ignore=shutil.ignore_patterns("tensorboard"))
    sets = [arg for item in ONLINE for arg in ("--set", item)]
    base = [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--home", str(tmp_path), "--run-name",
            "resumed", *sets, "--set", "learner.lr=0.001"]
    for steps, note in ((10, True), (12, False)):
        ran = preloaded.run([*base, "--steps", str(steps)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert ran.returncode == 0, ran.stderr[-3000:]
        noted = f"[run] note: settings changed since step {steps - 2}: learner.lr: was 0.0003, now 0.001"
        assert (noted in ran.stderr) is note and ("note: settings changed" in ran.stderr) is note, ran.stderr[-3000:]
    history = json.loads((resumed / "settings_history.json").read_text())
    assert history["entries"] == [{"after_step": 8, "settings": {"learner.lr": 0.001}}]
    assert json.loads((resumed / "settings.json").read_text())["learner"]["lr"] == 3e-4  # the first start's
    assert main(["inspect", str(resumed)]) == 0
    assert "resumed with other training settings  1" in (out := capsys.readouterr().out), out
    assert "  after step 8: learner.lr=0.001\n" in out
    assert main(["branch", str(resumed), "--from-step", "8", "continued"]) == 0
    assert json.loads((tmp_path / "continued" / "settings.json").read_text())["learner"]["lr"] == 0.001
    # damaged: inspect says so in its place and shows the rest; a branch, which needs it, is refused
    (resumed / "settings_history.json").write_text('{"entries": 3}')
    assert main(["inspect", str(resumed)]) == 0
    out = capsys.readouterr().out
    assert "resumed with other training settings  unknown: " in out and "rewind points" in out, out
    assert main(["branch", str(resumed), "--from-step", "8", "refused"]) == 2
    assert "settings_history.json is damaged" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()


def test_a_damaged_rewind_record_or_collector_state_is_refused_in_one_line_naming_it(online_parent, tmp_path, capsys):
    """The two files a branch continued online starts from, damaged: a checkpoint's rewind record (it read
    as "no rewind record (a run made before records)") and the collector's state kept for the step's
    rows (a struct.error traceback from `run`). Each is refused in one line naming the file."""
    import shutil

    parent = tmp_path / "parent"
    shutil.copytree(online_parent, parent, ignore=shutil.ignore_patterns("tensorboard", "run.lock"))
    record = parent / "checkpoints" / "step_00000004.json"
    rows = json.loads(record.read_text())["buffer_rows"]["shard-0000"]
    kept = record.read_bytes()
    record.write_text('{"step": 4, ')
    assert main(["branch", str(parent), "--from-step", "4", "refused"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"the rewind record of the checkpoint of step 4 of {parent} ({record}) is damaged" in err, err
    assert len(err.splitlines()) == 1 and not (tmp_path / "refused").exists()

    record.write_bytes(kept)
    state = parent / "collector" / "shard-0000.history" / f"row_{rows:012d}.pt"
    state.write_bytes(state.read_bytes()[:-100])
    assert main(["branch", str(parent), "--from-step", "4", "online"]) == 0
    capsys.readouterr()
    branch = tmp_path / "online"
    assert main(["run", str(branch / "pipeline.py"), "--home", str(tmp_path), "--run-name", "online",
                 "--steps", "6"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"cannot read the writer state {state}: " in err and "branch from another kept step" in err, err
    assert "Traceback" not in err and len([line for line in err.splitlines() if not line.startswith("[")]) == 1


def test_a_run_is_named_by_its_name_under_the_home_from_any_directory(online_parent, tmp_path, monkeypatch,
                                                                      capsys):
    """What ``run pipelines/default.py`` made is ``default`` to every command that takes a run (only
    ``branch`` took a name, and ``inspect default`` said "default does not exist" outside the home)."""
    import shutil

    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    shutil.copytree(online_parent, home / "parent", ignore=shutil.ignore_patterns("tensorboard"))
    elsewhere.mkdir()
    monkeypatch.setenv("RLHF_PIPELINE_HOME", str(home))
    monkeypatch.chdir(elsewhere)
    assert main(["inspect", "parent"]) == 0
    assert f"run  {home / 'parent'}" in capsys.readouterr().out
    assert main(["export-model", "parent", "--list-versions"]) == 0
    assert "v8 " in capsys.readouterr().out
    assert main(["show", "parent", "--row", "0"]) == 0
    assert "trained" in capsys.readouterr().out
    assert main(["branch", "parent", "--from-step", "4", "by-name", "--home", str(home)]) == 0
    assert (home / "by-name" / "branch.json").is_file() and "by-name: from" in capsys.readouterr().err
    # "NAME/" is a name as RUN takes one, not a directory of the working directory
    assert main(["branch", "parent/", "--from-step", "4", "by-name-2/", "--home", str(home)]) == 0
    assert (home / "by-name-2" / "branch.json").is_file() and not any(elsewhere.iterdir()), capsys.readouterr().err
    assert main(["replay", DEFAULT, "--buffer", str(home / "parent" / "buffer"), "--init-from", "parent", "--steps",
                 "1", "--run-name", "from-parent"]) == 0
    assert "[replay] done: 1 steps" in capsys.readouterr().err
    newest, _ = load_weights(home / "parent", 8)
    started, _ = load_weights(home / "from-parent", 0)
    assert all(torch.equal(started[k], newest[k]) for k in newest)
    assert main(["replay", DEFAULT, "--buffer", str(home / "parent" / "buffer"), "--init-from", "nosuch",
                 "--run-name", "refused"]) == 2
    assert capsys.readouterr().err.startswith("rlhf-pipeline replay: error: --init-from nosuch does not exist, and no "
                                              "run of that name is under")
    for argv in (["inspect", "nosuch"], ["eval", "nosuch"], ["detach", "nosuch"], ["repair", "nosuch"],
                 ["plot", "parent", "nosuch", "--out", "charts"], ["branch", "nosuch", "--from-step", "4", "b"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err == (f"rlhf-pipeline {argv[0]}: error: nosuch does not exist, and no run of that name is under "
                       f"{home} ($RLHF_PIPELINE_HOME or storage/)\n"), err
    assert not any(elsewhere.iterdir())  # nothing was made where the commands ran

    # --home names the home as `run --home` did, before or after the name, for every command taking a run
    monkeypatch.delenv("RLHF_PIPELINE_HOME")
    for argv in (["inspect", "parent", "--home", str(home)], ["export-model", "--home", str(home), "parent",
                                                               "--list-versions"],
                 ["show", "--home", str(home), "parent", "--row", "0"]):
        assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert f"run  {home / 'parent'}" in out and "v8 " in out and "trained" in out
    # an option between two positionals (plain argparse took OUT for an unrecognized argument)
    assert main(["export-model", "parent", "--home", str(home), str(tmp_path / "exported")]) == 0
    assert (tmp_path / "exported" / "config.json").is_file(), capsys.readouterr().err
    assert main(["inspect", "nosuch", "--home", str(home)]) == 2
    assert capsys.readouterr().err == (f"rlhf-pipeline inspect: error: nosuch does not exist, and no run of that name "
                                       f"is under {home} (--home {home})\n")


# ============================================================ a branch killed midway
def test_a_branch_killed_midway_whose_step_is_pruned_is_listed_then_removed_by_its_refused_rerun(tmp_path, capsys):
    """``branch`` killed with SIGKILL while it copies left ``NAME/`` with its ``branch.making`` and no
    ``branch.json``; the parent then pruned the step, so the rerun is refused, and nothing removed or
    listed it any more (issue 41). Now the parent's ``inspect`` lists it with what to do, ``replay``
    refuses it, and the refused rerun removes it, saying so."""
    from rlhf_pipeline.learn.checkpoint import CheckpointManager, Progress

    parent = tmp_path / "parent"
    parent.mkdir()
    (parent / "settings.json").write_text(json.dumps({"replay": {"buffer": str(tmp_path / "source")}}))
    CheckpointManager(parent / "checkpoints", keep_last=3).save(
        Progress(seed=0, step=2), {"model": {"weight": torch.zeros(2)}}, record={"policy_version": 2})
    modules = parent / "pipeline_modules"  # many files to copy: the kill comes while they are copied
    modules.mkdir()
    for i in range(20_000):
        (modules / f"m{i}.py").write_text("")
    making = tmp_path / "cut"
    branching = preloaded.Popen([sys.executable, "-m", "rlhf_pipeline.cli.main", "branch", str(parent),
                                  "--from-step", "2", "cut"], cwd=REPO, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
    err = kill_when(branching, lambda: (making / "pipeline_modules").is_dir(), timeout=240, poll_s=0.01, wait_s=60)
    assert branching.returncode == -signal.SIGKILL, err[-3000:]
    assert (making / "branch.making").is_file() and not (making / "branch.json").exists(), \
        "the kill came after the branch was made"
    (parent / "checkpoints" / "step_00000002.pt").unlink()  # the parent ran on and pruned step 2
    (parent / "checkpoints" / "step_00000002.json").unlink()
    assert main(["inspect", str(parent), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run"]["half_made"] == [{"run": str(making), "step": 2}]
    assert main(["inspect", str(parent)]) == 0
    assert f"{making} (from step 2; run the same `rlhf-pipeline branch` again" in capsys.readouterr().out
    assert main(["branch", str(parent), "--from-step", "2", "cut"]) == 2
    err = capsys.readouterr().err.strip()
    assert "keeps no checkpoint of step 2" in err and f"Removed {making}" in err and len(err.splitlines()) == 1, err
    assert not making.exists()
    assert main(["inspect", str(parent), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run"]["half_made"] == []


# ============================================================ per location: a directory, S3, Azure
def hand_made_parent(run_home: str) -> str:
    """A run with a checkpoint of step 2 only (what a parent that pruned step 4 keeps), in ``run_home``."""
    from rlhf_pipeline.files.run_paths import RunPaths
    from rlhf_pipeline.learn.checkpoint import Progress, run_checkpoints

    paths = RunPaths.at(f"{run_home}/parent")
    paths.store.write("settings.json", b"{}")
    run_checkpoints(paths, keep_last=3).save(Progress(seed=0, step=2), {"model": {"weight": torch.zeros(2)}},
                                             record={"policy_version": 2})
    return paths.location


def test_a_half_made_branch_whose_step_is_no_longer_kept_is_listed_then_removed_by_its_refused_rerun(
        run_home, capsys):
    """A `branch` killed midway (its ``branch.making``, what it copied, no ``branch.json``) whose step the
    parent pruned since: ``replay`` and the parent's ``inspect`` say so, and its rerun, refused (the step
    is not kept), removes it in the same line; no rerun would remove it otherwise."""
    from rlhf_pipeline.runs.lineage import run_store_at

    parent = hand_made_parent(run_home)
    gone = run_store_at(f"{run_home}/gone")
    gone.write("branch.making", json.dumps({"parent": parent, "step": 4}).encode())
    gone.write("pipeline.py", b"# copied before the kill")
    where = f"{run_home}/gone" if "://" in run_home else str(Path(run_home, "gone").resolve())
    assert main(["inspect", parent, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run"]["half_made"] == [{"run": where, "step": 4}]
    assert main(["inspect", parent]) == 0
    assert f"{where} (from step 4; run the same `rlhf-pipeline branch` again" in capsys.readouterr().out
    assert main(["replay", DEFAULT, "--buffer", parent, "--home", run_home, "--run-name", "gone"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is a branch left half-made" in err and len(err.splitlines()) == 1, err
    assert main(["branch", parent, "--from-step", "4", "gone"]) == 2  # kept: 2
    err = capsys.readouterr().err.strip()
    assert "keeps no checkpoint of step 4 (kept: 2)" in err and f"Removed {where}" in err, err
    assert len(err.splitlines()) == 1, err
    assert gone.walk() == []
    assert main(["inspect", parent, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run"]["half_made"] == []


def test_what_a_branch_cannot_be_is_refused_by_name_and_leaves_nothing(run_home, tmp_path, capsys):
    from rlhf_pipeline.runs.lineage import run_store_at

    parent = hand_made_parent(run_home)
    elsewhere = str(tmp_path / "local") if "://" in run_home else "s3://bucket/runs/b"
    assert main(["branch", parent, "--from-step", "2", elsewhere]) == 2
    err = capsys.readouterr().err.strip()
    assert "must both be local directories or both URLs" in err and len(err.splitlines()) == 1
    assert main(["branch", parent, "--from-step", "4", "b"]) == 2
    assert "keeps no checkpoint of step 4 (kept: 2)" in capsys.readouterr().err
    assert main(["branch", f"{run_home}/nothing", "--from-step", "2", "b"]) == 2
    assert "is not a run (no settings.json or checkpoints/)" in capsys.readouterr().err
    assert main(["branch", parent, "--from-step", "2", "parent"]) == 2
    assert "a branch is a new run" in capsys.readouterr().err
    run_store_at(f"{run_home}/taken").write("settings.json", b"{}")  # another run's name
    assert main(["branch", parent, "--from-step", "2", "taken"]) == 2
    assert "holds objects already" in capsys.readouterr().err
    assert run_store_at(f"{run_home}/b").walk() == []  # a refused branch leaves nothing behind


def replay_at(home: str, name: str, source: str) -> int:
    return replay_command(DEFAULT, ReplayOptions(buffer=source, **OPTIONS), home=home, run_name=name,
                          overrides=SETTINGS)


@pytest.mark.parametrize("run_home", ["s3", "azure"], indirect=True)
def test_a_branch_at_a_url_continues_with_replay_as_the_parent_trained(run_home, request, tmp_path, monkeypatch,
                                                                       capsys):
    """A replay parent at the URL trains 12 steps from a recorded source at a URL (a Zarr store); its
    branch at step 6 continues with the printed ``replay`` command and trains the parent's steps 7-12
    exactly; the parent's objects keep their bytes. On S3 the checkpoint and weights are copied on the
    server (no GET of them, the copy keeps its etag); on Azure they go through the client. A branch
    stopped before ``branch.json`` is refused by ``replay`` in one line and made again by ``branch``."""
    from integration.run_location import digest, logged, same_weights
    from integration.run_location import trained as trained_steps
    from integration.test_replay import ROWS as RECORDED, record, recorded_rows

    from rlhf_pipeline.runs.lineage import run_store_at

    monkeypatch.chdir(tmp_path)
    source = f"{run_home.rsplit('/', 1)[0]}/recorded"
    record(source, recorded_rows(RECORDED), backend="zarr")
    home, parent_url = run_home, f"{run_home}/parent"
    assert replay_at(home, "parent", source) == 0
    before = digest(parent_url)
    on_s3 = home.startswith("s3://")
    if on_s3:
        requests = request.getfixturevalue("s3_server").requests
        with requests.recording() as made_requests:
            assert main(["branch", parent_url, "--from-step", "6", "same"]) == 0
        # the checkpoint and the weights were copied on the server: this process never read them
        reads = [path for method, path in made_requests if method == "GET"]
        assert not any("/parent/checkpoints/step_00000006.pt" in p or "/parent/weights/" in p for p in reads), reads
        etags = run_store_at(f"{home}/same").list_etags("checkpoints")
        assert etags["step_00000006.pt"] == run_store_at(parent_url).list_etags("checkpoints")["step_00000006.pt"]
    else:
        assert main(["branch", parent_url, "--from-step", "6", "same"]) == 0
    err = capsys.readouterr().err
    assert f"[branch] {home}/same: from {parent_url} at step 6 (no setting changed)" in err
    # the parent's replay command: its flags and every --set it was given, under the branch's name
    assert f"rlhf-pipeline replay PIPELINE.py --buffer {source} --epochs 2 --order shuffle --seed 3" in err, err
    assert f"--home {home} --run-name same --set hidden_size=32" in err, err
    made = digest(f"{home}/same")
    assert "branch.json" in made and "branch.making" not in made
    assert made["checkpoints/step_00000006.pt"] == before["checkpoints/step_00000006.pt"]  # the same bytes
    assert digest(parent_url) == before  # branching only read the parent

    assert replay_at(home, "same", source) == 0
    assert digest(parent_url) == before  # nor did training the branch write to it
    branch, whole = logged(f"{home}/same"), logged(parent_url)
    assert [m["step"] for m in branch] == list(range(1, 13))
    # steps 7-12 trained again: the same
    assert trained_steps(branch, ("learning_rate",)) == trained_steps(whole, ("learning_rate",))
    assert [r["trajectory_ids"] for r in logged(f"{home}/same", "batches.jsonl")] == \
        [r["trajectory_ids"] for r in logged(parent_url, "batches.jsonl")]
    assert same_weights(f"{home}/same", parent_url)

    assert main(["inspect", parent_url, "--json"]) == 0
    lineage = json.loads(capsys.readouterr().out)["run"]
    assert lineage["branches"] == [{"run": f"{home}/same", "step": 6, "parent_rows": None, "reads": None,
                                    "detached": False}]
    assert [p["step"] for p in lineage["rewind_points"]] == [6, 12]
    assert main(["inspect", f"{home}/same"]) == 0
    assert f"branched from  {parent_url} at step 6 (no setting changed)" in capsys.readouterr().out

    from rlhf_pipeline.dataio.plots import load_runs
    from rlhf_pipeline.files.run_cache import local_copy

    drawn = load_runs([local_copy(parent_url), local_copy(f"{home}/same")])  # what plot draws, from the cache
    assert list(drawn) == ["parent", "same (branch at step 6)"]
    assert [r["step"] for r in drawn["same (branch at step 6)"].records] == list(range(6, 13))

    # a branch of a replay reads none of its parent's rows: detach records it, and the lineage stays
    assert main(["detach", f"{home}/same"]) == 0
    assert "it read no parent rows" in capsys.readouterr().err
    assert json.loads(run_store_at(f"{home}/same").read("branch.json"))["detached"]["rows_copied"] == 0
    assert main(["inspect", parent_url]) == 0
    assert f"{home}/same (from step 6; detached)" in capsys.readouterr().out
    assert digest(parent_url) == before

    # a branch stopped before its last object: the marker, no branch.json
    assert main(["branch", parent_url, "--from-step", "6", "cut", "--set", "learner.lr=1e-3"]) == 0
    cut = run_store_at(f"{home}/cut")
    cut.delete("branch.json")
    cut.write("branch.making", b"{}", fence=False)
    capsys.readouterr()
    assert main(["replay", DEFAULT, "--buffer", source, "--home", home, "--run-name", "cut",
                 *[w for s in SETTINGS for w in ("--set", s)], "--epochs", "2", "--seed", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is a branch left half-made" in err and len(err.splitlines()) == 1, err
    assert main(["inspect", parent_url, "--json"]) == 0  # not a branch yet: the parent does not list it
    assert [b["run"] for b in json.loads(capsys.readouterr().out)["run"]["branches"]] == [f"{home}/same"]
    assert main(["branch", parent_url, "--from-step", "6", "cut", "--set", "learner.lr=1e-3"]) == 0
    assert "left half-made" in capsys.readouterr().err
    made = digest(f"{home}/cut")
    assert "branch.json" in made and "branch.making" not in made
    assert json.loads(cut.read("settings.json"))["learner"]["lr"] == 1e-3
    # a branch that is whole is a run: another branch of that name is refused
    assert main(["branch", parent_url, "--from-step", "6", "cut"]) == 2
    assert "holds objects already" in capsys.readouterr().err


@pytest.mark.parametrize("run_home", ["s3"], indirect=True)
def test_a_branch_at_a_url_of_a_run_with_collectors_replays_the_parents_rows_up_to_the_step(run_home, tmp_path,
                                                                                            capsys):
    """A parent with collectors at the URL (a Zarr buffer there) branches with its ``parent-rows/``
    selection at the branch's URL, naming the parent's shards in place (per-shard ranges, no per-row
    ids object), and the branch replays only rows the parent had published by the branch step; then
    detached (over what a detach killed while copying left), it outlives its parent's objects."""
    from integration.run_location import digest

    from rlhf_pipeline.runs.lineage import run_store_at
    from rlhf_pipeline.storage import open_buffer

    home = run_home
    sets = [arg for item in ONLINE for arg in ("--set", item)]  # a Zarr buffer: the one a run at a URL takes
    ran = preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--steps", "8", "--home",
                          home, "--run-name", "parent", *sets], cwd=tmp_path, capture_output=True, text=True,
                        timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert ran.returncode == 0, ran.stderr[-3000:]
    parent_url = f"{home}/parent"
    before = digest(parent_url)
    assert main(["branch", parent_url, "--from-step", "4", "offline", "--set", "learner.lr=1e-3"]) == 0
    err = capsys.readouterr().err
    # the printed commands need not say buffer_backend=zarr there, and as printed they run (below)
    assert f"--buffer {home}/offline/parent-rows --home {home} --run-name offline" in err and "buffer_backend" not in err
    branch = f"{home}/offline"
    keys = set(run_store_at(branch).walk())  # per-shard ranges in selection.json: no per-row ids file
    assert {"parent-rows/selection.json", "branch.json"} <= keys and "parent-rows/rows.npy" not in keys
    record = json.loads(run_store_at(branch).read("branch.json"))
    with open_buffer(f"{parent_url}/buffer") as whole, open_buffer(f"{branch}/parent-rows") as at_step:
        assert len(at_step) == sum(record["buffer_rows"].values()) < len(whole)
        everything = set(whole.read(torch.arange(len(whole)), fields=("trajectory_id",))["trajectory_id"].tolist())
        readable = set(at_step.read(torch.arange(len(at_step)), fields=("trajectory_id",))["trajectory_id"].tolist())
    later = everything - readable
    assert later and readable < everything
    # offline it continues over those rows only (online: test_branch_online.py)
    assert replay_command(DEFAULT, ReplayOptions(buffer=f"{branch}/parent-rows", steps=8), home=home,
                          run_name="offline", overrides=ONLINE + ["learner.lr=1e-3"]) == 0
    capsys.readouterr()
    # once continued offline it cannot go on online (its learner is past the collectors' states): one line
    assert main(["learn", DEFAULT, "--home", home, "--run-name", "offline"]) == 2
    err = capsys.readouterr().err.strip()
    assert "it was continued offline already (it has a checkpoint of step 8)" in err, err
    assert "continue it offline with rlhf-pipeline replay" in err and len(err.splitlines()) == 1, err
    metrics = read_metrics("metrics.jsonl", store=run_store_at(branch))
    assert [m["step"] for m in metrics] == list(range(1, 9))
    assert [m["charts/learning_rate"] for m in metrics[4:]] == [1e-3] * 4
    trained_ids = {i for r in read_metrics("batches.jsonl", store=run_store_at(branch)) for i in r["trajectory_ids"]}
    assert trained_ids and trained_ids <= readable and not trained_ids & later
    assert digest(parent_url) == before  # the parent's objects were only read
    assert main(["inspect", parent_url]) == 0
    assert f"{branch} (from step 4;" in capsys.readouterr().out

    # detached, the branch outlives its parent: its own copy of the rows (a Zarr store at its URL)
    with open_buffer(f"{branch}/parent-rows") as at_step:
        held = at_step.read(torch.arange(len(at_step)), fields=("trajectory_id",))["trajectory_id"].tolist()
    # what a detach killed while copying leaves: part of a store at own-rows/, the selection not switched
    run_store_at(branch).write("own-rows/zarr.json", b"{", fence=False)
    assert main(["detach", branch]) == 0
    assert f"{len(held)} parent rows copied into {branch}/own-rows" in capsys.readouterr().err
    assert digest(parent_url) == before
    run_store_at(parent_url).delete_prefix()
    with open_buffer(f"{branch}/parent-rows") as own:
        assert own.read(torch.arange(len(own)), fields=("trajectory_id",))["trajectory_id"].tolist() == held
    assert replay_command(DEFAULT, ReplayOptions(buffer=f"{branch}/parent-rows", steps=10), home=home,
                          run_name="offline", overrides=ONLINE + ["learner.lr=1e-3"]) == 0
    metrics = read_metrics("metrics.jsonl", store=run_store_at(branch))
    assert [m["step"] for m in metrics] == list(range(1, 11))  # resumed at step 8, over its own rows
    assert main(["inspect", branch]) == 0
    assert f"branched from  {parent_url} at step 4" in capsys.readouterr().out
