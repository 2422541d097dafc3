"""A branch of a run with collectors, continued online with ``run`` (``runs/branch_online.py``).

The parent (the default pipeline, single-turn, its tiny model on CPU with a collector) trains 16
steps; it is branched at step 8. ``run`` on the branch with nothing changed trains the parent's
steps 9-16 exactly: the same rows, including those its collector generates again after step 8,
the same losses and weights. A branch with another learning rate differs from step 9 on and reads
no row the parent wrote after step 8; two branches never see each other's rows; the parent's files
stay byte-identical. A branch's ``run`` killed with SIGKILL (launcher and children at once) after
its first steps and started again ends where the uninterrupted one does.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
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
from rlhf_pipeline.learn.checkpoint import CheckpointManager
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.storage import open_buffer, open_store

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

REPO = Path(__file__).resolve().parents[2]
DEFAULT = str(REPO / "pipelines" / "default.py")
# a warm start long enough for some reward (non-zero losses); 16-row rounds, one per step
SETTINGS = ["warm_start_steps=60", "prompts_per_round=4", "group_size=4", "learner.batch_size=16",
            "learner.sample_window=32", "learner.new_rows_per_step=16", "learner.checkpoint_every=2",
            "learner.keep_checkpoints=1", "learner.checkpoint_keep_every=4"]
# timings, and how many rows the collector had written when a step was taken (it may be a round
# ahead, as pacing allows, or not yet: a race, not what was trained); the learning rate apart
NOT_COMPARED = ("time", "tokens_per_s", "_s", "learning_rate", "buffer_rows", "rows_generated")
STEPS, BRANCH_AT = 16, 8  # a multiple of checkpoint_keep_every: a kept rewind point
FIELDS = ("trajectory_id", "group_id", "policy_version", "reward", "response_tokens", "prompt_tokens")


def command(home: Path, name: str, *changes: str) -> list[str]:
    sets = [word for item in [*SETTINGS, *changes] for word in ("--set", item)]
    return [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--steps", str(STEPS), "--home", str(home),
            "--run-name", name, *sets]


def run(home: Path, name: str, *changes: str) -> str:
    ran = preloaded.run(command(home, name, *changes), cwd=REPO, capture_output=True, text=True, timeout=600,
                        env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert ran.returncode == 0, ran.stderr[-3000:]
    return ran.stderr


def digest(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(path.rglob("*"))}


def trained(run_dir: Path, after: int = 0) -> list[dict]:
    return [{k: v for k, v in m.items() if not any(t in k for t in NOT_COMPARED)}
            for m in read_metrics(run_dir / "metrics.jsonl") if m["step"] > after]


def rows(location: Path, first: int = 0, stop: int | None = None) -> list[dict]:
    """The rows at positions ``[first, stop)``, field by field as plain lists."""
    with open_buffer(location) if location.name == "buffer" else open_store(location) as store:
        positions = torch.arange(first, len(store) if stop is None else stop)
        batch = store.read(positions, fields=FIELDS)
    return [{name: (batch[name].row(i) if hasattr(batch[name], "row") else batch[name][i]).tolist()
             for name in FIELDS} for i in range(len(positions))]


def same_weights(a: Path, b: Path) -> bool:
    (left, version), (right, other) = load_weights(a), load_weights(b)
    return version == other and all(torch.equal(left[k], right[k]) for k in left)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    home = tmp_path_factory.mktemp("online")
    run(home, "parent")
    parent = home / "parent"
    before = digest(parent)
    assert main(["branch", str(parent), "--from-step", str(BRANCH_AT), "same"]) == 0
    assert main(["branch", str(parent), "--from-step", str(BRANCH_AT), "faster", "--set", "learner.lr=1e-3"]) == 0
    run(home, "same")
    run(home, "faster", "learner.lr=1e-3")
    assert digest(parent) == before  # the parent's files were only read
    return home, parent, json.loads((home / "same" / "branch.json").read_text())["buffer_rows"]


def test_a_branch_with_nothing_changed_trains_online_what_the_parent_trained_after_the_branch_step(runs):
    home, parent, at_step = runs
    same = home / "same"
    assert [m["step"] for m in read_metrics(same / "metrics.jsonl")] == list(range(1, STEPS + 1))
    assert any(m["losses/loss"] != 0 for m in trained(parent, after=BRANCH_AT))  # something to compare
    assert trained(same) == trained(parent)
    assert same_weights(same, parent)
    # the rows: the parent's up to the branch step read in place, the ones its collector wrote again after it
    assert rows(same / "buffer") == rows(parent / "buffer")
    own = rows(same / "buffer" / "shard-0000")
    assert own and own == rows(parent / "buffer", first=at_step["shard-0000"])


def test_inspect_divides_a_branchs_checkpoint_rows_into_the_parents_and_its_own(runs, capsys):
    """A continued branch's checkpoints count the parent's rows below the branch step and then its own
    shard's, while its buffer's table and retention's first row held count its own shard's ids: inspect
    printed the sum alone, which matched neither."""
    home, _, at_step = runs
    assert main(["inspect", str(home / "same"), "--json"]) == 0
    points = json.loads(capsys.readouterr().out)["run"]["rewind_points"]
    after = [p for p in points if p["step"] > BRANCH_AT]
    assert after, points
    assert main(["inspect", str(home / "same")]) == 0
    out = capsys.readouterr().out
    inherited = at_step["shard-0000"]
    for point in after:
        rows = point["buffer_rows"]["shard-0000"]
        assert rows > inherited
        assert (f"  step {point['step']}  policy version {point['policy_version']}  buffer rows shard-0000={rows} "
                f"(the parent's {inherited}, then {rows - inherited} of its own)\n") in out, out
    with open_store(home / "same" / "buffer" / "shard-0000") as own:  # its own ids: what its checkpoints add
        assert rows - inherited <= own.next_row


def test_convert_of_a_branch_continued_online_copies_the_rows_it_reads(runs, tmp_path, capsys):
    """convert copied only the branch's own shards (the rows after the branch step), saying nothing of
    the parent's that its buffer reads first: the copy now holds both, a buffer that stands alone."""
    home, parent, at_step = runs
    same, copy = home / "same", tmp_path / "copy"
    assert main(["convert", str(same), str(copy), "--to", "zarr", "--verify", "--quiet"]) == 0
    assert rows(copy / "shard-0000") == rows(same / "buffer")  # one collector: one shard
    assert len(rows(copy / "shard-0000")) > at_step["shard-0000"] > 0


def test_the_parent_keeps_the_weights_its_kept_steps_branches_sample_with_and_no_more(runs):
    """Beside its newest three versions the learner keeps, for each kept checkpoint, those from the one
    its collector held at the checkpoint's rows up to the checkpoint's own: what the branch above sampled
    with, long after the parent's learner moved on. Nothing else is kept, and the collector's history
    keeps no weights."""
    home, parent, _ = runs
    records = [json.loads(p.read_text()) for p in sorted((parent / "checkpoints").glob("step_*.json"))]
    assert [r["step"] for r in records] == [4, 8, 12, 16]
    pinned = {v for r in records for v in range(min(r["held_versions"].values()), r["policy_version"] + 1)}
    newest = set(range(STEPS - 2, STEPS + 1))
    assert {int(p.name[len("policy_"):][:8]) for p in (parent / "weights").iterdir()} == pinned | newest
    assert BRANCH_AT - 1 in pinned - newest  # the version the branch's collector held, long pruned otherwise
    assert not [p for p in (parent / "collector").rglob("policy_*")]


def test_a_branch_continued_online_is_not_branched_again_yet(runs, capsys):
    home, _, _ = runs
    assert main(["branch", str(home / "same"), "--from-step", str(STEPS), str(home / "again")]) == 2
    err = capsys.readouterr().err.strip()
    assert "is a branch continued online" in err and len(err.splitlines()) == 1
    assert not (home / "again").exists()


def test_a_branch_from_step_0_names_the_command_that_starts_over_and_it_trains_what_the_parent_trained(runs, capsys):
    """Step 0 is no checkpoint: the initial policy, which the parent's pipeline builds again from its seed and
    settings. The refusal gives the parent's command under a new name, with every setting the run recorded."""
    home, parent, _ = runs
    assert main(["branch", str(parent), "--from-step", "0", str(home / "zero")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Step 0 is the initial policy" in err, err
    given = shlex.split(err.split("to start over from it, run ", 1)[1].removesuffix(" with the --set values of yours"))
    assert given[:3] == ["rlhf-pipeline", "run", str(parent / "pipeline.py")] and "NAME" in given
    assert all(f"--set {item}" in err for item in SETTINGS if not item.startswith("learner.checkpoint"))
    argv = ["over" if word == "NAME" else word for word in given[1:]]
    ran = preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", *argv, "--set", "steps=4"], cwd=REPO,
                        capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert trained(home / "over") == [m for m in trained(parent) if m["step"] <= 4]
    assert not (home / "zero").exists()


def test_a_branch_with_another_learning_rate_differs_from_the_next_step_and_reads_no_later_parent_row(runs):
    home, parent, at_step = runs
    faster, same = home / "faster", home / "same"
    lr, parent_lr = trained(faster), trained(parent)
    assert lr[:BRANCH_AT] == parent_lr[:BRANCH_AT]  # the parent's steps, kept
    assert lr[BRANCH_AT]["losses/loss"] == parent_lr[BRANCH_AT]["losses/loss"]  # its first: the checkpoint's weights
    assert not same_weights(faster, parent)
    assert [m["charts/learning_rate"] for m in read_metrics(faster / "metrics.jsonl")[BRANCH_AT:]] == [1e-3] * (STEPS - BRANCH_AT)
    inherited = at_step["shard-0000"]
    with open_buffer(faster / "buffer") as union:
        shard = union.shards[0]
        assert (shard.parent_rows, shard.own.location) == (inherited, str(faster / "buffer" / "shard-0000"))
    assert rows(faster / "buffer", stop=inherited) == rows(parent / "buffer", stop=inherited)
    # after the branch step its rows are its own shard's: sampled with its own weights once it published one
    mine, theirs = rows(faster / "buffer", first=inherited), rows(parent / "buffer", first=inherited)
    assert mine == rows(faster / "buffer" / "shard-0000")
    assert any(r["policy_version"] > BRANCH_AT + 1 for r in mine) and mine != theirs
    # two branches of one parent never see each other's rows
    assert rows(same / "buffer" / "shard-0000") != rows(faster / "buffer" / "shard-0000")


def same_rows(mine: list[dict], theirs: list[dict]) -> bool:
    """The same rows in the same places; the last round may or may not have been written before the
    stop (pacing lets a collector write a round ahead of the learner: a race, not what was trained)."""
    shorter, longer = sorted((mine, theirs), key=len)
    return bool(shorter) and shorter == longer[:len(shorter)] and len(longer) - len(shorter) <= 16


def test_a_branch_killed_mid_run_resumes_online_to_what_it_trains_uninterrupted(runs):
    home, parent, _ = runs
    assert main(["branch", str(parent), "--from-step", str(BRANCH_AT), "killed"]) == 0
    killed = home / "killed"
    metrics = killed / "metrics.jsonl"
    first = preloaded.Popen(command(home, "killed"), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    # whole lines only: the branch starts with the parent's steps; killed once it trained 2 of its own
    kill_when(first, lambda: metrics.is_file() and metrics.read_text().count("\n") >= BRANCH_AT + 2, whole_group=True,
              poll_s=0.01, wait_s=60)
    assert first.returncode == -signal.SIGKILL
    assert BRANCH_AT + 2 <= len(read_metrics(metrics)) < STEPS, "the kill came after the branch had finished; nothing was resumed"
    resumed = run(home, "killed")
    assert "resuming from" in resumed
    assert trained(killed) == trained(parent) and same_weights(killed, parent)
    assert same_rows(rows(killed / "buffer"), rows(parent / "buffer"))


def test_a_branch_of_a_run_with_imported_rows_continues_online_reading_them(tmp_path, capsys):
    """The shard an ``import`` wrote (shard-9000) was taken for a collector's: the branch's command said
    ``--collectors 2`` for the parent's one, and online the branch was refused ("the parent keeps no state
    of its collector 9000"). Now the branch reads the parent's imported rows through an empty shard of its
    own of that name, and trains on as the parent did."""
    home, parent = tmp_path, tmp_path / "parent"
    first_part = command(home, "parent")
    first_part[first_part.index("--steps") + 1] = "6"
    ran = preloaded.run(first_part, cwd=REPO, capture_output=True, text=True, timeout=600,
                        env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert main(["export", str(parent), str(tmp_path / "rows.jsonl"), "--quiet"]) == 0
    assert main(["import", str(tmp_path / "rows.jsonl"), str(parent), "--quiet"]) == 0
    run(home, "parent")  # on to step 16, the imported shard beside the collector's
    capsys.readouterr()
    assert main(["branch", str(parent), "--from-step", str(BRANCH_AT), "same"]) == 0
    said = capsys.readouterr().err
    assert "--collectors" not in said and "collectors each continue" not in said, said
    run(home, "same")
    same = home / "same"
    assert sorted(p.name for p in (same / "buffer").iterdir() if p.is_dir()) == ["shard-0000", "shard-9000"]
    assert rows(same / "buffer") == rows(parent / "buffer")  # the imported rows among them, read in place
    assert not rows(same / "buffer" / "shard-9000")  # and none of its own
    assert trained(same) == trained(parent)


def test_a_branch_of_a_parent_without_collector_histories_is_refused_online_in_one_line(tmp_path, capsys):
    home, parent, branch = tmp_path, tmp_path / "old", tmp_path / "b"
    (parent / "buffer" / "shard-0000").mkdir(parents=True)
    branch.mkdir()
    (branch / "branch.json").write_text(json.dumps({"parent": str(parent), "step": 2, "replay_source": None,
                                                    "buffer_rows": {"shard-0000": 32}}))
    assert main(["learn", DEFAULT, "--home", str(home), "--run-name", "b"]) == 2
    err = capsys.readouterr().err.strip()
    assert "keeps no state of its collector 0 at row 32" in err and "continue it offline with" in err
    assert len(err.splitlines()) == 1
    assert not (branch / "collector").exists() and not (home / "b" / "buffer.continues.json").exists()


def test_a_collector_with_groups_pending_at_the_branch_rows_is_refused_online_by_name(run_home, capsys):
    """A collector that had rows of groups not whole yet at those rows (their other rows come in
    later rounds) cannot restart exactly without them: refused in one line, not continued short. The
    position history keeps the shard's writer state whole, its write path's pending groups too."""
    from helpers import make_batch

    from rlhf_pipeline.collect.position_history import PositionHistory, history_key
    from rlhf_pipeline.files.run_paths import RunPaths
    from rlhf_pipeline.runs.lineage import run_store_at
    from rlhf_pipeline.storage.writer_state import encode
    from rlhf_pipeline.transforms.pending_groups import PendingGroups

    parent = RunPaths.at(f"{run_home}/parent")
    parent.store.write("settings.json", b"{}")
    pending = PendingGroups()
    pending.add(make_batch(1, 2))  # half a group of 4
    history = PositionHistory(parent.store, history_key("collector/shard-0000.pt"))
    history.record(32, encode({"policy_version": 2}, [pending.to_payload()]))
    branch = run_store_at(f"{run_home}/b")
    branch.write("branch.json", json.dumps({"parent": parent.location, "step": 2, "replay_source": None,
                                            "buffer_rows": {"shard-0000": 32}, "policy_version": 2}).encode())
    assert main(["learn", DEFAULT, "--home", run_home, "--run-name", "b", "--set", "buffer_backend=zarr"]) == 2
    err = capsys.readouterr().err.strip()
    assert "had rows of groups not whole yet pending at row 32 of shard-0000" in err, err
    assert len(err.splitlines()) == 1, err
    assert not any(key.startswith("collector/") for key in branch.walk())


TOOL_USE = str(REPO / "pipelines" / "tool_use.py")
AGENT = ["warm_start_steps=20", "warm_start_check_tasks=0", "learner.batch_size=16", "learner.new_rows_per_step=16",
         "learner.sample_window=32", "learner.checkpoint_every=2", "learner.keep_checkpoints=1",
         "learner.checkpoint_keep_every=4"]


def test_an_agent_branch_continues_online_as_its_parent_did(tmp_path):
    """The tool-use pipeline's multi-turn collector: its rounds end with whole groups, so a branch at
    step 4 continues online exactly (rows, losses, weights)."""
    def agent_run(name: str) -> None:
        sets = [word for item in AGENT for word in ("--set", item)]
        ran = preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", TOOL_USE, "--steps", "8",
                              "--home", str(tmp_path), "--run-name", name, *sets], cwd=REPO, capture_output=True,
                            text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert ran.returncode == 0, ran.stderr[-3000:]

    agent_run("parent")
    parent = tmp_path / "parent"
    before = digest(parent)
    assert main(["branch", str(parent), "--from-step", "4", "same"]) == 0
    agent_run("same")
    same = tmp_path / "same"
    assert trained(same) == trained(parent) and same_weights(same, parent)
    assert rows(same / "buffer") == rows(parent / "buffer")
    assert digest(parent) == before


def test_retention_in_a_branch_continued_online_drops_only_its_own_rows_never_past_a_floor(tmp_path):
    """The branch's checkpoints and learner count the shard's rows from the parent's count N, its own
    store from 0: the floors are translated, whole own segments go, the parent's rows stay its own."""
    bound = ["segment_rows=16", "retention.max_rows=48"]
    # the branch keeps only its newest checkpoint: the step-4 one it starts from would hold every own row
    newest_only = "learner.checkpoint_keep_every=0"

    def bounded_run(name: str, steps: int, *changes: str) -> None:
        sets = [word for item in [*SETTINGS, *bound, *changes] for word in ("--set", item)]
        ran = preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--steps", str(steps),
                              "--home", str(tmp_path), "--run-name", name, *sets], cwd=REPO, capture_output=True,
                            text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert ran.returncode == 0, ran.stderr[-3000:]
        assert "retention.* is off" not in ran.stderr

    bounded_run("parent", 8)
    parent = tmp_path / "parent"
    before = digest(parent)
    assert main(["branch", str(parent), "--from-step", "4", "kept", "--set", newest_only]) == 0
    inherited = json.loads((tmp_path / "kept" / "branch.json").read_text())["buffer_rows"]["shard-0000"]
    bounded_run("kept", 16, newest_only)
    kept = tmp_path / "kept"
    assert digest(parent) == before  # the parent's rows were read in place, none dropped by the branch
    assert [m["step"] for m in read_metrics(kept / "metrics.jsonl")] == list(range(1, 17))
    dropped = sum(r.get("retention/rows_dropped", 0) for r in read_metrics(kept / "collector" / "metrics-0000.jsonl"))
    with open_store(kept / "buffer" / "shard-0000") as own:
        first, written = own.first_row, own.next_row
        held = own.read_global(list(range(first, written)), fields=list(FIELDS))
    assert dropped > 0 and first == dropped and first % 16 == 0  # whole own segments only
    # never past a floor: the newest checkpoint's position (in the parent's numbering) less the reach
    newest = CheckpointManager(kept / "checkpoints").rewind_points()[-1]
    assert inherited + first <= int(newest["buffer_rows"]["shard-0000"]) - 32
    # the union starts at the branch's first own row held, with the same global ids as before the drop
    with open_buffer(kept / "buffer") as union:
        shard = union.shards[0]
        assert (shard.first_row, shard.next_row) == (inherited + first, inherited + written)
        again = shard.read_global(list(range(inherited + first, inherited + written)), fields=list(FIELDS))
    assert torch.equal(again.group_id, held.group_id) and torch.equal(again.reward, held.reward)


# ============================================================ at a URL
# the shortest writer-lock lease: a collector killed with SIGKILL holds its shard's lock at the URL
# until the lease runs out
AT_URL = [*SETTINGS, "buffer_backend=zarr", "buffer_lock_lease_s=3"]


def command_at(home: str, name: str) -> list[str]:
    sets = [word for item in AT_URL for word in ("--set", item)]
    return [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--steps", "8", "--home", home,
            "--run-name", name, *sets]


def run_at(cwd, home: str, name: str) -> str:
    ran = preloaded.run(command_at(home, name), cwd=cwd, capture_output=True, text=True, timeout=600,
                        env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert ran.returncode == 0, ran.stderr[-3000:]
    return ran.stderr


def trained_at(run: str) -> list[dict]:
    from integration.run_location import logged

    return [{k: v for k, v in m.items() if not any(t in k for t in NOT_COMPARED)} for m in logged(run)]


def rows_at(location: str, first: int = 0) -> list[dict]:
    with open_buffer(location) if location.endswith("/buffer") else open_store(location) as store:
        count = len(store) - first
        batch = store.read(torch.arange(first, first + count), fields=FIELDS)
    return [{name: (batch[name].row(i) if hasattr(batch[name], "row") else batch[name][i]).tolist()
             for name in FIELDS} for i in range(count)]


@pytest.fixture()
def parent_at_url(run_home, tmp_path):
    """The parent (one collector, a Zarr buffer at the URL) after 8 steps: (home, its URL)."""
    run_at(tmp_path, run_home, "parent")
    return run_home, f"{run_home}/parent"


@pytest.mark.parametrize("run_home", ["s3"], indirect=True)
def test_a_branch_at_a_url_with_nothing_changed_trains_online_what_the_parent_trained(parent_at_url, tmp_path,
                                                                                     capsys):
    """Branched at step 4 and run as ``branch`` printed it: the parent's steps 5-8 exactly (the parent's
    rows up to the branch rows read in place at the parent's URL, then those its collector writes again
    into the branch's own shard at the branch's URL), the same losses and weights; the parent's objects
    keep their bytes."""
    from integration.run_location import digest, logged, same_weights
    from integration.test_branch import printed_command

    from rlhf_pipeline.runs.lineage import run_store_at

    home, parent = parent_at_url
    before = digest(parent)
    # the collector's states at the parent's URL; the weights versions they held, in the parent's weights/
    assert any(key.startswith("collector/shard-0000.history/row_") for key in before)
    assert not any(key.startswith("collector/shard-0000.history/policy_") for key in before)
    record = json.loads(run_store_at(parent).read("checkpoints/step_00000004.json"))
    held = min(record["held_versions"].values())
    assert held < 6 and all(f"weights/policy_{v:08d}.safetensors" in before for v in range(held, 5))
    assert main(["branch", parent, "--from-step", "4", "same"]) == 0
    # the parent's command with every --set it was given, the pipeline file as PIPELINE.py: run as printed
    printed = printed_command(capsys.readouterr().err, "run")
    assert printed[3:8] == ["run", "PIPELINE.py", "--home", home, "--run-name"]
    same = f"{home}/same"
    inherited = json.loads(run_store_at(same).read("branch.json"))["buffer_rows"]
    ran = preloaded.run([DEFAULT if word == "PIPELINE.py" else word for word in printed], cwd=tmp_path,
                        capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "changed" not in ran.stderr, ran.stderr[-3000:]  # no setting left out of the printed command
    assert digest(parent) == before  # the parent's objects were only read
    # a branch continued online is not branched again yet: one line naming its parent
    assert main(["branch", same, "--from-step", "8", "again"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is a branch continued online" in err and parent in err and len(err.splitlines()) == 1, err
    assert run_store_at(f"{home}/again").walk() == []
    assert [m["step"] for m in logged(same)] == list(range(1, 9))
    assert any(m["losses/loss"] != 0 for m in logged(parent)[4:])  # something to compare
    assert trained_at(same) == trained_at(parent)
    assert same_weights(same, parent)
    (name, count), = inherited.items()
    with open_buffer(f"{same}/buffer") as union:  # the parent's shard read in place below the branch rows
        shard = union.shards[0]
        assert (shard.parent.location, shard.parent_rows) == (f"{parent}/buffer/{name}", count)
        assert shard.own.location == f"{same}/buffer/{name}"
    assert same_rows(rows_at(f"{same}/buffer"), rows_at(f"{parent}/buffer"))
    assert same_rows(rows_at(f"{same}/buffer/{name}"), rows_at(f"{parent}/buffer", first=count))


@pytest.mark.parametrize("run_home", ["s3"], indirect=True)
def test_a_branch_at_a_url_killed_mid_run_resumes_online_to_what_the_parent_trained(parent_at_url, tmp_path):
    """The branch's ``run`` killed with SIGKILL (launcher and children at once; its collector's writer
    lock at the URL held until its lease runs out) after its first steps, started again, ends where the
    parent does."""
    from integration.run_location import digest, logged, same_weights

    home, parent = parent_at_url
    before = digest(parent)
    assert main(["branch", parent, "--from-step", "4", "killed"]) == 0
    killed = f"{home}/killed"
    first = preloaded.Popen(command_at(home, "killed"), cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    # the branch starts with the parent's 4 steps; killed once it trained 2 of its own
    kill_when(first, lambda: len(logged(killed)) >= 6, whole_group=True, poll_s=0.1, wait_s=60)
    assert first.returncode == -signal.SIGKILL
    assert 6 <= len(logged(killed)) < 8, "the kill came after the branch had finished; nothing was resumed"
    assert "resuming from" in run_at(tmp_path, home, "killed")
    assert trained_at(killed) == trained_at(parent)
    assert same_weights(killed, parent)
    assert same_rows(rows_at(f"{killed}/buffer"), rows_at(f"{parent}/buffer"))
    assert digest(parent) == before
