"""``rlhf-pipeline run`` under real use: SIGTERM / SIGINT to the launcher, Ctrl-C to the whole
process group and ``kill -9`` of the launcher all end with every child stopped cleanly (the
learner's checkpoint at its last step, collectors after their round); a finished run says so
up front; OS errors on the run directory and unsafe state files are one-line errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import preloaded

from rlhf_pipeline.learn.checkpoint import CheckpointManager
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.coordination.weights import latest_version

REPO = Path(__file__).resolve().parents[2]
DEFAULT = str(REPO / "pipelines" / "default.py")
# tiny and quick: no warm start, small groups, a checkpoint only when stopping
FAST = ["--set", "warm_start_steps=0", "--set", "prompts_per_round=4", "--set", "group_size=4",
        "--set", "learner.batch_size=16", "--set", "learner.sample_window=32",
        "--set", "learner.new_rows_per_step=16", "--set", "learner.checkpoint_every=1000"]


def cli(command: str, home: Path, *extra: str, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "rlhf_pipeline.cli.main", command, DEFAULT, "--home", str(home),
         "--run-name", "r", *FAST, *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen,
    )


def start_and_train(home: Path, steps: int = 1) -> tuple[subprocess.Popen, list[int]]:
    """``run`` in its own process group, once the learner took ``steps`` steps; its children's pids."""
    launcher = cli("run", home, "--steps", "100000", start_new_session=True)
    metrics = home / "r" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while len(read_metrics(metrics)) < steps:
        if launcher.poll() is not None or time.monotonic() > deadline:
            launcher.kill()
            pytest.fail(f"the run ended or stalled before {steps} steps:\n{launcher.communicate()[0][-3000:]}")
        time.sleep(0.2)
    children = children_of(launcher.pid)
    assert len(children) == 2, children  # one collector, one learner
    return launcher, children


def children_of(pid: int) -> list[int]:
    """The ``collect`` / ``learn`` processes started by ``pid`` (not, e.g., multiprocessing helpers):
    forked by ``run`` (``rlhf_pipeline/runs/forking.py``, named ``rlhf-collect`` / ``rlhf-learn``) or
    started with an interpreter of their own."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            comm = (entry / "comm").read_text()
        except (OSError, ValueError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and (b"rlhf_pipeline.cli.main" in argv
                                                               or comm.startswith("rlhf-")):
            found.append(int(entry.name))
    return found


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its parent has not collected it yet


def assert_stopped_cleanly(run: Path, out: str, children: list[int]) -> None:
    assert not any(running(pid) for pid in children), out[-3000:]
    assert "[learner] stopped at step" in out and "checkpoint saved" in out, out[-3000:]
    assert "[collector] stopped after" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    last_step = read_metrics(run / "metrics.jsonl")[-1]["step"]
    assert CheckpointManager(run / "checkpoints").latest_step() == last_step  # saved at the stop
    for state_file in run.rglob("*.pt"):  # every state file of a real run loads the safe way
        torch.load(state_file, weights_only=True)


@pytest.mark.parametrize("how", ["SIGTERM to run", "Ctrl-C to the group"])
def test_a_signal_stops_every_child_cleanly(tmp_path, how):
    """SIGINT to ``run`` alone takes SIGTERM's path (``runs/stopping.py``'s ``LauncherSignals``: the
    launcher asks its children to stop) and ends as Ctrl-C does (exit code 130, SIGINT named): the two
    cells here cover it."""
    launcher, children = start_and_train(tmp_path)
    if how == "SIGTERM to run":
        os.kill(launcher.pid, signal.SIGTERM)
    else:
        os.killpg(launcher.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    out, _ = launcher.communicate(timeout=240)
    name = "SIGTERM" if how == "SIGTERM to run" else "SIGINT"
    assert launcher.returncode == (143 if name == "SIGTERM" else 130), out[-3000:]
    assert f"[run] interrupted ({name})" in out and "[run] done" not in out, out[-3000:]
    if how == "Ctrl-C to the group":
        # one Ctrl-C, never taken for two; each child says it once, in its own name (a forked collector
        # once read the forking process's command line, which names the learner too, and said "[learner]")
        assert out.count("[learner] stopping cleanly (SIGINT)") == 1, out[-3000:]
        assert out.count("[collector] stopping cleanly (SIGINT)") == 1, out[-3000:]
    else:
        assert "[learner] the launcher asked to stop" in out
    assert_stopped_cleanly(tmp_path / "r", out, children)

    if how == "SIGTERM to run":  # the run is at its last step: asking for no more does nothing, fast
        reached = CheckpointManager(tmp_path / "r" / "checkpoints").latest_step()
        again = subprocess.run(
            [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--home", str(tmp_path),
             "--run-name", "r", *FAST, "--steps", str(reached)], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert again.returncode == 0, again.stderr
        assert f"has already reached step {reached} (--steps {reached}); nothing to do" in again.stderr
        assert "raise --steps" in again.stderr and "[run] run directory" not in again.stderr


def test_children_of_a_killed_launcher_stop_cleanly(tmp_path):
    """kill -9 of run, and nobody reads its output any more (what subprocess.run(timeout=...) does
    to it): the children stop on their own, the learner with a checkpoint at its last step."""
    launcher, children = start_and_train(tmp_path)
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    launcher.stdout.close()  # the children's prints now fail with a broken pipe
    deadline = time.monotonic() + 240
    while any(running(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(running(pid) for pid in children), "children of a killed launcher kept running"
    run = tmp_path / "r"
    last_step = read_metrics(run / "metrics.jsonl")[-1]["step"]
    assert CheckpointManager(run / "checkpoints").latest_step() == last_step


def test_os_errors_on_the_run_directory_are_one_line(tmp_path):
    home_file = tmp_path / "home-is-a-file"
    home_file.write_text("")
    result = subprocess.run(
        [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--home", str(home_file), *FAST],
        cwd=REPO, capture_output=True, text=True, timeout=180)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines == [f"rlhf-pipeline run: error: the run directory {home_file}/default cannot be written: {home_file} "
                     f"is a file, not a directory; choose another --home (or $RLHF_PIPELINE_HOME) or --run-name"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through file permissions")
def test_a_read_only_home_is_one_line(tmp_path):
    home = tmp_path / "ro"
    home.mkdir(mode=0o555)
    result = subprocess.run(
        [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--home", str(home), *FAST],
        cwd=REPO, capture_output=True, text=True, timeout=180)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"rlhf-pipeline run: error: the run directory {home}/default cannot be written: nothing can be made in "
        f"{home} (Permission denied); choose another --home (or $RLHF_PIPELINE_HOME) or --run-name"]


# ---------------------------------------------------------------------- while the learner prepares
def test_run_imports_no_torch_and_reports_the_learners_check_as_its_own(tmp_path):
    """``run`` leaves build and preflight to its learner (no torch, nor numpy, in the launcher); a preflight
    error found there is ``run``'s one-line error with exit code 2, and nothing is created."""
    bad_reward = tmp_path / "bad_reward.py"
    bad_reward.write_text(Path(DEFAULT).read_text().replace(
        'rewards = {"toy": toy_reward}', 'rewards = {"toy": lambda prompts, completions, **_: [0.0]}'))
    argv = ["run", str(bad_reward), "--home", str(tmp_path), *FAST]
    script = ("import sys; from rlhf_pipeline.cli.main import main; code = main(sys.argv[1:]); "
              "print(code, sorted(m for m in ('torch', 'tensordict', 'transformers', 'numpy') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", script, *argv], cwd=REPO, capture_output=True, text=True,
                            timeout=180)
    assert result.stdout.strip() == "2 []", result.stdout + result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        "rlhf-pipeline run: error: RewardError: reward 'toy' returned 1 values for 4 completions; "
        "return one per completion"], result.stderr[-3000:]
    assert not (tmp_path / "bad_reward").exists()


def test_a_reward_that_answers_wrongly_mid_run_stops_it_in_one_line_naming_the_fix(tmp_path):
    """Past its preflight, a reward that gives one value too few: the collector stops with the reward's
    own refusal in one line (it was a traceback through the collector), and the learner checkpoints."""
    breaks = tmp_path / "breaks.py"
    breaks.write_text(Path(DEFAULT).read_text().replace(
        'rewards = {"toy": toy_reward}',
        'calls = []\n'
        '    rewards = {"toy": lambda prompts, completions, **fields: '
        'calls.append(1) or toy_reward(prompts, completions, **fields)[len(calls) > 1:]}'))
    # not about the start: forked from a preloaded process (tests/preloaded.py), as the runs of most tests are
    command = [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", str(breaks), "--home", str(tmp_path),
               "--steps", "20", *FAST]
    result = preloaded.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 2, out[-3000:]  # run's error: a child failed
    assert "Traceback" not in out, out[-3000:]
    stopped = [line for line in out.splitlines() if line.startswith("[collector] stopped: ")]
    assert len(stopped) == 1 and stopped[0].endswith(" completions; return one per completion"), out[-3000:]
    assert "reward 'toy' returned " in stopped[0]
    assert "the collector ended early" in out and "[learner] stopped at step" in out, out[-3000:]
    assert "a fix in the pipeline file is refused first" in out, out[-3000:]

    # the fix is in the pipeline file: the same command is refused as a change to what the run trains,
    # saying how to go on; done so, the run resumes from the learner's checkpoint and ends
    breaks.write_text(Path(DEFAULT).read_text())
    refused = preloaded.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    copy = tmp_path / "breaks" / "pipeline.py"
    assert refused.returncode == 2 and f"to go on with the changed files, remove {copy} and start again" in \
        refused.stderr, refused.stderr[-3000:]
    copy.unlink()
    resumed = preloaded.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0 and "[learner] resuming from " in resumed.stderr, resumed.stderr[-3000:]
    assert "[run] done: 20 learner steps" in resumed.stderr, resumed.stderr[-3000:]


@pytest.mark.parametrize("how", ["SIGTERM to run", "Ctrl-C to the group"])
def test_a_signal_during_the_warm_start_stops_every_child(tmp_path, how):
    """The learner child warm-starts while the collectors wait for weights version 0: a signal then
    ends them all, quietly, and leaves no weights (a rerun builds the policy again)."""
    launcher = cli("run", tmp_path, "--set", "warm_start_steps=100000", "--steps", "3", start_new_session=True)
    lines = []
    for line in launcher.stdout:  # the learner says so when it starts the warm start
        lines.append(line)
        if line.startswith("[run] building the initial policy"):
            break
    children = children_of(launcher.pid)
    assert len(children) == 2, "".join(lines)
    if how == "SIGTERM to run":
        os.kill(launcher.pid, signal.SIGTERM)
    else:
        os.killpg(launcher.pid, signal.SIGINT)
    out = "".join(lines) + launcher.communicate(timeout=120)[0]
    assert launcher.returncode == (143 if how == "SIGTERM to run" else 130), out[-3000:]
    assert not any(running(pid) for pid in children), out[-3000:]
    assert "Traceback" not in out and "error" not in out, out[-3000:]
    expected = ("[run] interrupted (SIGTERM) while preparing the run" if how == "SIGTERM to run"
                else "rlhf-pipeline run: interrupted")
    assert expected in out, out[-3000:]
    run = tmp_path / "r"
    assert (run / "settings.json").exists() and latest_version(run) is None  # resumable, nothing half-made


def stuck_in_round_2(tmp_path: Path) -> str:
    """The default pipeline whose reward never returns from round 2 on; it creates ``tmp_path / "stuck"``
    as it hangs. Counted in completions, not calls: the preflight scores one group, and a round's groups
    may be scored in several calls as they finish (counting calls, a round 1 scored in two hung, and the
    learner's first step waited out its data timeout)."""
    stuck = tmp_path / "stuck.py"
    stuck.write_text(Path(DEFAULT).read_text().replace('    rewards = {"toy": toy_reward}', f'''    scored = [0]

    def reward_that_hangs_in_round_2(prompts, completions, **fields):
        if scored[0] >= settings.group_size * (1 + settings.prompts_per_round):  # the preflight's and round 1's
            import time
            open({str(tmp_path / "stuck")!r}, "w").close()
            time.sleep(3600)
        scored[0] += len(completions)
        return toy_reward(prompts, completions, **fields)

    rewards = {{"toy": reward_that_hangs_in_round_2}}'''))
    return str(stuck)


# max_lag=3: the collector starts round 2 at once, while the learner trains its one step on round 1; a
# hang in round 1 instead would end in the learner's data timeout, not in the waits these tests are about
STUCK_AFTER_ONE_STEP = ["warm_start_steps=5", "max_lag=3", "learner.data_timeout_s=60"]


def test_a_collector_stuck_in_a_round_after_the_last_step_is_stopped_then_killed(tmp_path, monkeypatch, capsys):
    """A reward that never returns, in the round the collector started ahead of the learner's last step:
    the launcher asked it to stop (STOP), then sent SIGTERM, which a collector honours only between
    rounds, and then waited for ever. It kills it now, saying so, and the run ends as done: the learner
    took every step, and only the stuck round's rows, which no step needed, are lost. The waits are
    shortened here (120 s and 30 s in a run)."""
    from rlhf_pipeline.runs import run, stopping

    monkeypatch.setattr(stopping, "COLLECTOR_FINISH_S", 2.0)
    monkeypatch.setattr(stopping, "KILLED_AFTER_S", 2.0)
    code = run.run_command("run", pipeline_path=stuck_in_round_2(tmp_path), steps=1, home=str(tmp_path),
                           run_name="r", overrides=STUCK_AFTER_ONE_STEP)
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    assert "[run] the collector did not stop within 2 s: asking it again (SIGTERM)" in err, err[-3000:]
    assert "[run] the collector did not stop within 2 s of SIGTERM: killing it (SIGKILL)" in err, err[-3000:]
    assert "[run] done: 1 learner steps" in err
    assert [m["step"] for m in read_metrics(tmp_path / "r" / "metrics.jsonl")] == [1]
    assert not children_of(os.getpid())  # nothing left running


def launcher_stuck_after_one_step(tmp_path: Path, log: Path, **command) -> tuple[int, list[int]]:
    """``run_command("run", **command)`` in a forked launcher writing to ``log``, once the learner took a
    step and the collector hangs in round 2's reward; the launcher's pid and its children's. Having preloaded
    what its children import, the launcher forks them itself: they keep what the test shortened."""
    from rlhf_pipeline.runs import launch, run

    launcher = os.fork()
    if launcher == 0:  # writing to a file the children inherit: their last words stay readable
        code = 1
        try:
            out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(out, 1)
            os.dup2(out, 2)
            sys.stdout = open(1, "w", buffering=1, closefd=False)  # not pytest's capture
            sys.stderr = open(2, "w", buffering=1, closefd=False)
            launch.preload("collect")
            launch.preload("learn")
            code = run.run_command("run", **command)
        finally:
            os._exit(code)
    deadline = time.monotonic() + 300
    while not (read_metrics(tmp_path / "r" / "metrics.jsonl") and (tmp_path / "stuck").exists()):
        if os.waitpid(launcher, os.WNOHANG) != (0, 0) or time.monotonic() > deadline:
            os.kill(launcher, signal.SIGKILL)
            pytest.fail(f"the run ended or stalled before its first step:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    children = children_of(launcher)
    assert len(children) == 2, (children, log.read_text()[-3000:])
    return launcher, children


def test_a_collector_stuck_in_a_round_when_its_launcher_is_killed_ends_itself_and_frees_the_run(
        tmp_path, monkeypatch):
    """kill -9 of ``run`` while its collector is stuck in a round: the collector saw the pipe close but
    never reached the end of its round, and held the run directory for ever, so the rerun was refused
    as "in use". Past its allowance and KILLED_AFTER_S (shortened here from 120 s and 30 s) it ends
    itself, saying so, and the same command runs again: here, with the learner's step 1 checkpointed,
    it has nothing to do."""
    from rlhf_pipeline.runs import run, stopping

    monkeypatch.setattr(stopping, "COLLECTOR_FINISH_S", 2.0)
    monkeypatch.setattr(stopping, "KILLED_AFTER_S", 2.0)
    log = tmp_path / "launcher.log"
    command = dict(pipeline_path=stuck_in_round_2(tmp_path), steps=3, home=str(tmp_path), run_name="r",
                   overrides=STUCK_AFTER_ONE_STEP)
    launcher, children = launcher_stuck_after_one_step(tmp_path, log, **command)
    os.kill(launcher, signal.SIGKILL)
    os.waitpid(launcher, 0)
    deadline = time.monotonic() + 240
    while any(running(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.5)
    out = log.read_text()
    assert not any(running(pid) for pid in children), out[-3000:]
    assert "[collector] the launcher is gone; stopping cleanly" in out, out[-3000:]
    assert "[collector] still running 4 s after its launcher ended: ending it (SIGKILL)" in out, out[-3000:]
    assert "[learner] stopped at step 1; checkpoint saved" in out, out[-3000:]
    assert run.run_command("run", **{**command, "steps": 1}) == 0  # refused as "in use" before


def test_one_sigterm_to_a_run_whose_collector_is_stuck_in_a_round_ends_it(tmp_path, monkeypatch):
    """One SIGTERM, as a scheduler or ``timeout`` sends, with the collector stuck in a round: the learner
    stopped with a checkpoint, and ``run`` then waited for the collector for ever, since only a second
    signal killed it. It now gives the collector its allowance, asks again, kills it (saying each), and
    ends as interrupted (the same bound holds when a run stops because another collector died)."""
    from rlhf_pipeline.runs import stopping

    monkeypatch.setattr(stopping, "COLLECTOR_FINISH_S", 2.0)
    monkeypatch.setattr(stopping, "KILLED_AFTER_S", 2.0)
    log = tmp_path / "launcher.log"
    launcher, children = launcher_stuck_after_one_step(
        tmp_path, log, pipeline_path=stuck_in_round_2(tmp_path), steps=3, home=str(tmp_path), run_name="r",
        overrides=STUCK_AFTER_ONE_STEP)
    os.kill(launcher, signal.SIGTERM)
    deadline = time.monotonic() + 240
    while os.waitpid(launcher, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(launcher, signal.SIGKILL)
            for pid in children:
                os.kill(pid, signal.SIGKILL)
            pytest.fail(f"run did not end within 240 s of one SIGTERM:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    out = log.read_text()
    assert "[run] the collector did not stop within 2 s: asking it again (SIGTERM)" in out, out[-3000:]
    assert "[run] the collector did not stop within 2 s of SIGTERM: killing it (SIGKILL)" in out, out[-3000:]
    assert "[learner] stopped at step 1; checkpoint saved" in out, out[-3000:]
    assert "[run] interrupted (SIGTERM)" in out, out[-3000:]
    assert not any(running(pid) for pid in children)
