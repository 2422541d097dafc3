"""``rlhf-pipeline run pipelines/default.py --set generation.url=...`` with a server that starts answering
token ids outside the model's vocabulary mid-run (issue 41): the collector asks again, then stops the
run with one line naming the server and the fault, no row of the bad answers is stored (``inspect
--verify`` of the run finds nothing), and the same command with the server answering well again
resumes the run to its last step.

The server is ``misbehaving_vllm_server.py``: a stand-in on 127.0.0.1 that speaks the API the URL
engine uses (weights, lease and completions), sampling with our loop until its fault is switched on.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from misbehaving_vllm_server import MisbehavingVLLMServer
import preloaded

from rlhf_pipeline.cli.main import main
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.models import char_tokenizer, tiny_causal_lm

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

REPO = Path(__file__).resolve().parents[2]
DEFAULT = str(REPO / "pipelines" / "default.py")
SETTINGS = ["warm_start_steps=4", "prompts_per_round=2", "group_size=4", "learner.batch_size=8",
            "learner.sample_window=16", "learner.new_rows_per_step=8", "learner.checkpoint_every=2",
            "generation.retries=2", "generation.backoff_s=0.05"]
STEPS = 4


def _run(home: Path, url: str) -> subprocess.CompletedProcess:
    sets = [word for item in [*SETTINGS, f"generation.url={url}"] for word in ("--set", item)]
    return preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--steps", str(STEPS),
                           "--home", str(home), "--run-name", "url", *sets], cwd=REPO, capture_output=True,
                         text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_a_server_that_answers_ids_outside_the_vocabulary_stops_the_run_in_one_line_and_a_rerun_resumes(
        tmp_path, capsys):
    tok = char_tokenizer()  # the default pipeline's model shape; the run sends its own weights
    model = tiny_causal_lm(len(tok), hidden_size=64, num_layers=2, num_heads=4, pad_token_id=tok.pad_token_id,
                           eos_token_id=tok.eos_token_id, seed=1)
    server = MisbehavingVLLMServer(model, stop_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    try:
        server.fault, server.honest_for = "id-outside-vocabulary", 5  # the engine's check, then two rounds
        ran = _run(tmp_path, server.url)
        assert ran.returncode != 0
        lines = [line for line in ran.stderr.splitlines() if "outside the model's vocabulary" in line]
        assert len(lines) == 1 and server.url in lines[0] and "is 1000000" in lines[0], ran.stderr[-3000:]
        assert "the last of 3 tries" in lines[0] and "Traceback" not in ran.stderr, ran.stderr[-3000:]
        # what was stored is the honest rounds' rows only
        assert main(["inspect", str(tmp_path / "url"), "--verify", "--quiet"]) == 0, capsys.readouterr().out
        capsys.readouterr()

        server.fault = None  # answering well again, behind the same URL
        ran = _run(tmp_path, server.url)
        assert ran.returncode == 0, ran.stderr[-3000:]
        assert [m["step"] for m in read_metrics(tmp_path / "url" / "metrics.jsonl")][-1] == STEPS
    finally:
        server.stop()
