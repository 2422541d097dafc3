"""The vLLM engine's scratch directories: a collector killed with SIGKILL cannot remove its own, so the
next engine started on the machine removes those whose process is gone (no vLLM needed here)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from rlhf_pipeline.generation.vllm_process import SCRATCH_PREFIX, make_scratch_dir


def test_a_new_scratch_directory_removes_those_of_processes_that_are_gone():
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)  # exited and reaped: nothing runs under this pid (unless reused since)
    tmp = Path(tempfile.gettempdir())
    dead = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{dead_pid}-", dir=tmp))
    (dead / "model").mkdir()
    (dead / "model" / "weights.safetensors").write_bytes(b"x" * 1000)
    alive = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getppid()}-", dir=tmp))  # our parent runs
    foreign = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}url-", dir=tmp))  # not an engine's: not ours to judge
    made = None
    try:
        made = make_scratch_dir()
        assert made.is_dir() and made.name.startswith(f"{SCRATCH_PREFIX}{os.getpid()}-")
        assert not dead.exists()
        assert alive.is_dir() and foreign.is_dir()
    finally:
        for path in (dead, alive, foreign, made):
            if path is not None:
                shutil.rmtree(path, ignore_errors=True)
