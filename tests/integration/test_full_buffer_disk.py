"""A run whose buffer's disk fills: the collector stops in one line naming its shard (not a traceback),
the learner saves a checkpoint, and once there is room the same command resumes and finishes. The
buffer is on a real tmpfs (``small_disk``), as a user puts a run's largest part on a disk of its own
with a link."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import fill
import preloaded

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

REPO = Path(__file__).resolve().parents[2]
SETTINGS = ["warm_start_steps=20", "learner.checkpoint_every=100"]


def run(home: Path, backend: str) -> subprocess.CompletedProcess:
    sets = [word for item in [*SETTINGS, f"buffer_backend={backend}"] for word in ("--set", item)]
    return preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", "pipelines/default.py", "--steps",
                          "40", "--home", str(home), *sets], cwd=REPO, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.mark.parametrize("backend, room", [("memmap", 256 * 1024), ("zarr", 96 * 1024)])  # Zarr compresses
def test_a_full_buffer_disk_stops_the_collector_in_one_line_and_the_same_command_resumes(tmp_path, small_disk,
                                                                                         backend, room):
    home = tmp_path / "home"
    (home / "default").mkdir(parents=True)
    (small_disk / "buffer").mkdir()
    (home / "default" / "buffer").symlink_to(small_disk / "buffer")
    filler = fill(small_disk, leave_bytes=room)  # room for a few rounds' rows only
    stopped = run(home, backend)
    assert stopped.returncode == 2, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    # the shard (memmap: writes to open files name none), or the Zarr file that did not fit in it
    shard = home / "default" / "buffer" / "shard-0000"
    said = [line for line in stopped.stderr.splitlines() if line.startswith(f"rlhf-pipeline collect: error: {shard}")]
    assert len(said) == 1 and said[0].endswith(": No space left on device; the disk is full; free space (nothing "
                                               "written so far is lost) and rerun to resume"), stopped.stderr[-3000:]
    # a Zarr writer's close could not merge its fragments either: said as what it is, not a bare "[Errno 28] ..."
    assert not [line for line in stopped.stderr.splitlines() if line.startswith("[Errno")], stopped.stderr[-3000:]
    assert "[learner] stopped at step" in stopped.stderr and "checkpoint saved" in stopped.stderr
    filler.unlink()
    resumed = run(home, backend)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "[learner] resuming from" in resumed.stderr and "[run] done: 40 learner steps" in resumed.stderr
