"""The tests' preloaded commands (``tests/preloaded.py``) against real subprocesses: a forked command
must see what ``exec`` would have given it, or the tests that use it would test something else."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import preloaded

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="commands are forked on Linux only"),
    pytest.mark.skipif(os.environ.get(preloaded.DISABLE) == "1",
                       reason=f"{preloaded.DISABLE}=1: every command runs as a subprocess"),
]

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "rlhf_pipeline.cli.main"]
DEFAULT = str(REPO / "pipelines" / "default.py")

# a pipeline file whose loading reports what its process sees, then ends the command with code 7
REPORTING = textwrap.dedent("""
    import json, os, signal, sys
    from pathlib import Path

    def handler(sig):
        found = signal.getsignal(sig)
        return found.__name__ if callable(found) else int(found)

    words = Path("/proc/self/cmdline").read_bytes().rstrip(b"\\0").split(b"\\0")
    print(json.dumps({
        "argv": sys.argv, "cwd": os.getcwd(), "marker": os.environ.get("PRELOADED_MARKER"),
        "cmdline": [w.decode() for w in words if w], "stdin": sys.stdin.read(), "path0": sys.path[0],
        "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd") if int(fd) > 2),
        "signals": {name: handler(getattr(signal, name)) for name in ("SIGINT", "SIGTERM", "SIGCHLD", "SIGPIPE")},
        "session": os.getsid(0) == os.getpid(), "group": os.getpgid(0) == os.getpid(),
    }))
    print("a progress line\\rrewritten", file=sys.stderr)
    sys.exit(7)
""")


def report(start, folder: Path, *, new_session: bool) -> tuple[dict, str, int]:
    pipeline = folder / "reporting.py"
    pipeline.write_text(REPORTING)
    done = start([*CLI, "run", "reporting.py", "--home", str(folder / "home")], cwd=folder, input="from the test",
                 capture_output=True, text=True, timeout=300, start_new_session=new_session,
                 env={**os.environ, "PRELOADED_MARKER": str(folder)})
    return json.loads(done.stdout.splitlines()[-1]), done.stderr, done.returncode


@pytest.mark.parametrize("new_session", [False, True])
def test_a_forked_command_sees_what_a_subprocess_of_the_same_command_sees(tmp_path, new_session):
    real, real_err, real_code = report(subprocess.run, tmp_path, new_session=new_session)
    forked, forked_err, forked_code = report(preloaded.run, tmp_path, new_session=new_session)
    assert (forked_code, real_code) == (7, 7)
    assert forked == real  # fds: what the launcher opened and listdir's own, none of the preloaded process's
    assert forked["stdin"] == "from the test" and forked["marker"] == forked["cwd"] == forked["path0"] == str(tmp_path)
    assert forked["cmdline"] == [*CLI, "run", "reporting.py", "--home", str(tmp_path / "home")]
    assert forked["argv"][1:] == ["run", "reporting.py", "--home", str(tmp_path / "home")]
    assert forked["session"] is forked["group"] is new_session
    assert "a progress line\nrewritten" in forked_err and "a progress line\nrewritten" in real_err


def test_a_signal_ends_a_forked_command_as_it_ends_a_subprocess(tmp_path):
    """SIGKILL to a forked ``run`` reads as the subprocess's would; a second command from the same
    preloaded process runs on."""
    (tmp_path / "sleeping.py").write_text("import sys, time\nprint('loaded', flush=True)\ntime.sleep(600)\n")
    command = [*CLI, "run", "sleeping.py", "--home", str(tmp_path / "home")]
    codes = []
    for start in (subprocess.Popen, preloaded.Popen):
        process = start(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert process.stdout.readline() == "loaded\n"
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(timeout=0.1)
        process.kill()
        codes.append(process.wait(timeout=60))
        process.stdout.close()
    assert codes == [-signal.SIGKILL, -signal.SIGKILL]
    again = preloaded.run([*CLI, "run", str(tmp_path / "nowhere.py")], capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "nowhere.py" in again.stderr


def test_a_run_forked_from_the_preloaded_process_forks_its_children_itself(tmp_path):
    """No forking process starts between: the children show the launcher's own command line and are
    its children; the run trains its steps."""
    command = [*CLI, "run", DEFAULT, "--steps", "3", "--home", str(tmp_path), "--run-name", "forked",
               "--set", "warm_start_steps=5"]
    launcher = preloaded.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen: dict[str, tuple[int, list[str]]] = {}
    try:
        while launcher.poll() is None and len(seen) < 2:
            for entry in Path("/proc").iterdir():
                try:
                    comm = (entry / "comm").read_text().strip()
                    if comm in ("rlhf-learn", "rlhf-collect"):
                        parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                        words = (entry / "cmdline").read_bytes().rstrip(b"\0").split(b"\0")
                        if str(tmp_path).encode() in b" ".join(words):
                            seen[comm] = (parent, [w.decode() for w in words if w])
                except (OSError, IndexError):
                    continue
            time.sleep(0.02)
        _, err = launcher.communicate(timeout=300)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, err[-3000:]
    assert set(seen) == {"rlhf-learn", "rlhf-collect"}, err[-3000:]
    for parent, words in seen.values():
        assert parent == launcher.pid
        assert words == command  # the forking process would show `-m rlhf_pipeline.cli.forker`
    assert "[run] done: 3 learner steps" in err


def test_commands_it_cannot_fork_faithfully_run_as_subprocesses(tmp_path):
    assert isinstance(preloaded.Popen([sys.executable, "-c", "pass"]), subprocess.Popen)
    with_fds = preloaded.Popen([*CLI, "--help"], stdout=subprocess.DEVNULL, pass_fds=())
    other_code = preloaded.Popen([*CLI, "--help"], stdout=subprocess.DEVNULL,
                                 env={**os.environ, "PYTHONPATH": str(tmp_path)})
    for process in (with_fds, other_code):
        assert isinstance(process, subprocess.Popen)
        assert process.wait(timeout=120) == 0
