"""``run``'s children forked from one importing process (``rlhf_pipeline/runs/forking.py``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlhf_pipeline.runs.forking import ChildSpec, can_fork_children, fork_children

REPO = Path(__file__).resolve().parents[2]
TOOL_USE = str(REPO / "pipelines" / "tool_use.py")

pytestmark = pytest.mark.skipif(not can_fork_children(), reason="forking run's children needs Linux")


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_forked_children_are_the_callers_own_and_run_their_command_lines():
    waiting = ChildSpec(["collect", TOOL_USE, "--wait-for-launcher"])  # waits for "go" on its stdin
    ranked = ChildSpec(["learn", TOOL_USE, "--wait-for-launcher"], env={**os.environ, "RANK": "1"})
    bad = ChildSpec(["collect", TOOL_USE, "--collector-index", "not-a-number"])  # argparse: exit code 2
    children = fork_children([waiting, ranked, bad])
    try:
        collector, learner, broken = children
        assert broken.wait(timeout=120) == 2
        for child in (collector, learner):
            assert parent_of(child.pid) == os.getpid()  # adopted: run waits for them and gets their codes
            assert child.poll() is None
        assert Path(f"/proc/{collector.pid}/comm").read_text().strip() == "rlhf-collect"
        assert Path(f"/proc/{learner.pid}/comm").read_text().strip() == "rlhf-learn-1"  # its own environment
        with pytest.raises(subprocess.TimeoutExpired):
            collector.wait(timeout=0.2)
        collector.stdin.close()  # no "go": the launcher gave up, and the child exits quietly
        assert collector.wait(timeout=120) == 0
        learner.terminate()
        assert learner.wait(timeout=120) == -signal.SIGTERM
        learner.kill()  # reaped already: nothing to signal, the pid may be another process's now
        assert learner.returncode == -signal.SIGTERM
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()



# A launcher that imported what the children need and runs one thread forks them itself: each keeps
# only its own descriptors, so closing one child's stdin reaches that child alone
FROM_HERE = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    from rlhf_pipeline.runs.forking import ChildSpec, fork_children
    from rlhf_pipeline.runs.launch import holds_preloaded, preload

    preload("collect"); preload("learn")
    kept_read, kept_write = os.pipe()
    specs = [ChildSpec(["collect", sys.argv[1], "--wait-for-launcher"], keep_fds=(kept_read,)),
             ChildSpec(["learn", sys.argv[1], "--wait-for-launcher"])]
    first, second = fork_children(specs, pass_fds=(kept_read,), holds_imports=holds_preloaded())
    parents = [int(Path(f"/proc/{c.pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) for c in (first, second)]
    first.stdin.close()  # no "go": it exits quietly, though the second child still waits on its own stdin
    codes = [first.wait(timeout=120), second.poll()]
    second.stdin.close()
    codes.append(second.wait(timeout=120))
    print(json.dumps({"me": os.getpid(), "parents": parents, "codes": codes}))
""")


def test_a_launcher_that_holds_the_imports_forks_its_children_itself_each_with_only_its_own_pipes():
    done = subprocess.run([sys.executable, "-c", FROM_HERE, TOOL_USE], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["parents"] == [seen["me"], seen["me"]]  # no forking process between
    # the first ended on its stdin's end of file while the second ran: the second held no copy of it
    assert seen["codes"] == [0, None, 0]
