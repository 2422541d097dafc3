"""``run``'s children forked from one importing process (``rlhf_pipeline/runs/forking.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
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

