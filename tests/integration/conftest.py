"""Runs that several integration modules read, each made once per test session (once per pytest-xdist
worker that asks for it) instead of once per module: a run costs the start of its processes (each
imports torch) and its training. A test never changes such a run: it makes its branches beside it,
under names no other test uses, or copies it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import preloaded


@pytest.fixture(scope="session")
def online_parent(tmp_path_factory) -> Path:
    """``HOME/parent``: the default pipeline with test_branch.py's ``ONLINE`` settings trained 8 steps
    with its collector, checkpoints kept at step 4 and 8; the branches of test_branch.py and
    test_detach.py are made beside it in ``HOME``."""
    from integration.test_branch import DEFAULT, ONLINE, REPO

    home = tmp_path_factory.mktemp("online")
    sets = [arg for item in ONLINE for arg in ("--set", item)]
    ran = preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--steps", "8", "--home",
                          str(home), "--run-name", "parent", *sets], cwd=REPO, capture_output=True, text=True,
                        timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    return home / "parent"
