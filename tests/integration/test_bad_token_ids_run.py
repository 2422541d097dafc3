"""A run whose buffer holds a group with a token id outside its model's vocabulary goes on training
(issue 41): ``inspect --verify`` of the run reports the group, ``repair`` names the branch from the
newest checkpoint whose rows hold none of it, and that branch, continued online with the run's
command, trains past the step the parent stopped at.

The group is planted in the run's shard after the run stopped, as a broken server's answer was written
before engines' answers were checked (``tests/generation/test_engine_answers.py`` shows they no longer
are); the rows are a real collector's rows of the same shard, one token changed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import preloaded

from rlhf_pipeline.cli.main import main
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.storage import open_store

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

REPO = Path(__file__).resolve().parents[2]
DEFAULT = str(REPO / "pipelines" / "default.py")
SETTINGS = ["warm_start_steps=4", "prompts_per_round=2", "group_size=4", "learner.batch_size=8",
            "learner.sample_window=16", "learner.new_rows_per_step=8", "learner.checkpoint_every=2",
            "learner.keep_checkpoints=2"]


def _run(home: Path, name: str, steps: int) -> subprocess.CompletedProcess:
    sets = [word for item in SETTINGS for word in ("--set", item)]
    return preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--steps", str(steps),
                           "--home", str(home), "--run-name", name, *sets], cwd=REPO, capture_output=True, text=True,
                         timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_a_run_with_a_group_outside_the_vocabulary_goes_on_as_the_branch_repair_names(tmp_path, capsys):
    ran = _run(tmp_path, "run", 4)
    assert ran.returncode == 0, ran.stderr[-3000:]
    run = tmp_path / "run"
    shard = run / "buffer" / "shard-0000"
    with open_store(shard, mode="a") as store:  # a broken server's group, written after the run stopped
        first_bad = store.next_row
        group = store.read(torch.arange(len(store) - 4, len(store)))
        group["response_tokens"].values[0] = 10**6
        group["group_id"].add_(1000)  # ids of their own
        group["trajectory_id"].add_(1000)
        store.append(group)
    bad_group = int(group["group_id"][0])

    assert main(["inspect", str(run), "--verify", "--quiet"]) == 1
    out = capsys.readouterr().out
    assert f"group {bad_group}: row {first_bad} holds token ids outside the model's vocabulary of " in out
    assert main(["repair", str(run), "--quiet"]) == 1
    out = capsys.readouterr().out
    assert f"NOT RECOVERABLE: group {bad_group}: row {first_bad} holds" in out
    command = out.split("to go on without them: ")[1]
    step = int(command.split("branch the run at step ")[1].split(",")[0])
    assert step == 4 and f"rlhf-pipeline branch {run} --from-step 4 run-from-4" in command

    assert main(["branch", str(run), "--from-step", "4", "run-from-4"]) == 0
    capsys.readouterr()
    ran = _run(tmp_path, "run-from-4", 6)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert [m["step"] for m in read_metrics(tmp_path / "run-from-4" / "metrics.jsonl")][-2:] == [5, 6]
