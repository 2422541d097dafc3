"""One command at a time in a run directory: a second ``run`` (or ``replay``, ``import``) is refused
with one line naming the holder, before it changes anything; a holder killed with ``kill -9``
leaves nothing that blocks the next start, which resumes the run."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import preloaded

from rlhf_pipeline.learn.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
DEFAULT = str(REPO / "pipelines" / "default.py")
SMALL = ["--set", "warm_start_steps=5", "--set", "prompts_per_round=4", "--set", "group_size=4",
         "--set", "learner.batch_size=16", "--set", "learner.sample_window=32",
         "--set", "learner.new_rows_per_step=16", "--set", "learner.checkpoint_every=2"]
CLI = [sys.executable, "-m", "rlhf_pipeline.cli.main"]


def _run(home: Path, steps: int) -> list[str]:
    return [*CLI, "run", DEFAULT, "--home", str(home), "--run-name", "held", "--steps", str(steps), *SMALL]


def _start(command: list[str]) -> subprocess.Popen:
    # a session of its own, so that the test can kill the launcher together with its children
    return preloaded.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)


def _refusal(result: subprocess.CompletedProcess | tuple[int, str], holder_pid: int | None = None) -> str:
    code, stderr = (result.returncode, result.stderr) if hasattr(result, "returncode") else result
    assert code != 0, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr  # one line, no traceback
    assert "is in use by" in lines[0] and f"on host {socket.gethostname()}" in lines[0], lines[0]
    if holder_pid is not None:
        assert f"pid {holder_pid} " in lines[0], lines[0]
    return lines[0]


def _wait_for_steps(run: Path, process: subprocess.Popen, steps: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        if (run / "metrics.jsonl").exists() and len(read_metrics(run / "metrics.jsonl")) >= steps:
            return
        time.sleep(0.2)
    raise AssertionError(f"no {steps} steps in {timeout} s")


def _files(run: Path) -> list[str]:
    """The run directory's entries, less the temporary files of the holder's own atomic writes (its
    learner may be replacing pacing.json at the moment of either listing)."""
    return sorted(p.name for p in run.iterdir() if not p.name.endswith(".partial"))


def test_a_held_run_directory_refuses_run_replay_and_import_and_a_killed_holder_blocks_nothing(tmp_path, capsys):
    from rlhf_pipeline.cli.main import main

    run = tmp_path / "held"
    first = _start(_run(tmp_path, 400))
    try:
        # past its first checkpoint (step 2), so the holder itself adds no entry to the directory between the
        # two listings below: it logs step 2 before it makes checkpoints/, and under load a listing fell between
        _wait_for_steps(run, first, 3)
        held = json.loads((run / "run.lock").read_text())
        assert held["pid"] == first.pid and held["command"] == "run"
        files_before = _files(run)

        second = preloaded.run(_run(tmp_path, 400), cwd=REPO, capture_output=True, text=True, timeout=120)
        _refusal(second, holder_pid=first.pid)
        # replay and import are refused in this process: the holder is another process all the same, and
        # each CLI start of theirs would import torch again (seconds on a busy machine)
        capsys.readouterr()
        code = main(["replay", DEFAULT, "--home", str(tmp_path), "--run-name", "held", "--buffer", str(run / "buffer")])
        _refusal((code, capsys.readouterr().err), holder_pid=first.pid)
        rows = tmp_path / "rows.jsonl"
        rows.write_text(json.dumps({"prompt": "1+1=", "completion": "2", "reward": 1.0}) + "\n")
        code = main(["import", str(rows), str(run / "buffer")])
        _refusal((code, capsys.readouterr().err), holder_pid=first.pid)
        assert _files(run) == files_before  # the refused commands wrote nothing

        os.killpg(first.pid, signal.SIGKILL)  # the launcher and its children, at once
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    # a dead holder leaves its record in run.lock, but no lock: the same command resumes
    reached = read_metrics(run / "metrics.jsonl")[-1]["step"]
    resumed = preloaded.run(_run(tmp_path, reached + 2), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl")]
    assert steps[-1] == reached + 2 and len(steps) == len(set(steps))


def test_two_runs_started_at_once_train_one_run(tmp_path):
    run = tmp_path / "held"
    both = [_start(_run(tmp_path, 4)), _start(_run(tmp_path, 4))]
    results = [(p.wait(timeout=300), p.communicate()[1]) for p in both]
    codes = sorted(code for code, _ in results)
    assert codes[0] == 0 and codes[1] != 0, results
    _refusal(next(r for r in results if r[0] != 0))
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4]
    versions = sorted(int(p.stem.split("_")[1]) for p in (run / "weights").glob("policy_*"))
    assert versions[-1] == 4  # one learner's versions, not two interleaved


HOLD_AND_SPAWN = """
import subprocess, sys, time
from pathlib import Path
from rlhf_pipeline.pipeline import RunPaths
from rlhf_pipeline.runs.run_directory import hold_run_directory
holder = hold_run_directory(RunPaths(Path(sys.argv[1])), "run")
# a child that inherits the lock, as run's collectors and learner do
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], pass_fds=(holder.fd,))
print(child.pid, flush=True)
time.sleep(600)
"""


def test_children_keep_the_run_directory_after_their_launcher_is_killed(tmp_path, monkeypatch):
    from rlhf_pipeline.pipeline import RunPaths
    from rlhf_pipeline.runs import run_directory
    from rlhf_pipeline.runs.run_directory import RunDirectoryBusyError, hold_run_directory

    run = tmp_path / "held"
    launcher = subprocess.Popen([sys.executable, "-c", HOLD_AND_SPAWN, str(run)], stdout=subprocess.PIPE, text=True)
    child_pid = int(launcher.stdout.readline())
    try:
        launcher.kill()
        launcher.wait()
        with monkeypatch.context() as short:  # a child that does not stop is waited for this long, then refused
            short.setattr(run_directory, "ENDING_HOLDER_WAIT_S", 0.5)
            try:
                hold_run_directory(RunPaths(run), "run")
                raise AssertionError("the directory was free while the launcher's child still held it")
            except RunDirectoryBusyError as exc:
                assert f"pid {launcher.pid} " in str(exc)  # the holder the record names, then who holds the lock
                assert f"has ended while its child processes (pid {child_pid}) are still stopping" in str(exc)
    finally:
        os.kill(child_pid, signal.SIGKILL)
    # the same command right after the kill: the killed child may still be exiting (the kernel releases
    # its descriptors last); a holder that has ended leaves the lock to stopping children, so it waits
    with hold_run_directory(RunPaths(run), "run"):
        pass


@pytest.mark.parametrize("run_home", ["s3"], indirect=True)
def test_a_run_whose_lease_at_a_url_was_taken_over_stops_its_processes(run_home, tmp_path):
    """At a URL the run's lock is a lease: another command took ``run.lock`` over (as it does once a
    holder's lease runs out unrenewed); ``run`` learns it at its next renewal, stops its collector and
    learner (they checkpoint), and says so; it does not delete the other holder's lock."""
    from integration.run_location import logged

    from rlhf_pipeline.runs.lineage import run_store_at

    run_url = f"{run_home}/taken"
    first = preloaded.Popen([*CLI, "run", DEFAULT, "--home", run_home, "--run-name", "taken", "--steps", "500",
                              *SMALL, "--set", "buffer_backend=zarr"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and first.poll() is None and len(logged(run_url)) < 2:
            time.sleep(0.5)
        store = run_store_at(run_url)
        store.write("run.lock", b'{"command": "run", "pid": 1, "host": "elsewhere", "lease_s": 30}', fence=False)
        out, _ = first.communicate(timeout=120)  # the holder renews every 10 s
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 2, out[-3000:]
    assert f"{run_url} was taken over by another command" in out, out[-3000:]
    assert "[learner] stopped at step" in out, out[-3000:]
    assert b'"host": "elsewhere"' in store.read("run.lock")
