"""``run --ray`` of a LoRA run (``learner.lora.rank=4``) on a local 2-CPU Ray cluster: the learner actor
puts each adapter it publishes in the object store, the collector actors take it from there (the base
from the run's version 0, as a collector of ``run`` does), check it with the served-policy canary and
sample it; a second start resumes the run, its driver offering the newest adapter as published. With
our loop (two collectors) and with the vLLM server a collector actor starts (one collector: each start
of a server is tens of seconds), which loads each adapter by its version's name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import needs_peft
from rlhf_pipeline.cluster.driver import ray_launcher
from rlhf_pipeline.coordination.weights import load_published, published_versions
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.models.lora import PolicyAdapter
from rlhf_pipeline.runs.run import run_command
from rlhf_pipeline.storage import open_buffer

ray = pytest.importorskip("ray", reason="the Ray tests need the ray extra: pip install -e '.[ray]'")
pytestmark = [pytest.mark.slow, needs_peft, pytest.mark.usefixtures("one_torch_thread")]

REPO = Path(__file__).resolve().parents[2]
DEFAULT = str(REPO / "pipelines" / "default.py")
LORA_ON_RAY = ["warm_start_steps=5", "prompts_per_round=4", "group_size=4", "learner.batch_size=16",
               "learner.sample_window=32", "learner.new_rows_per_step=16", "learner.checkpoint_every=2",
               "learner.log_every=1", "learner.lora.rank=4", "learner.lr=3e-3"]


ENGINES = {"loop": ([], 2), "vllm": (["generation.engine=vllm", "num_heads=2"], 1)}
"""engine -> (its settings, collectors); num_heads=2: a head size of 32, which vLLM's CPU attention takes."""


def run_on_ray(home: Path, steps: int, engine: str) -> int:
    settings, collectors = ENGINES[engine]
    return run_command("run", pipeline_path=DEFAULT, steps=steps, home=str(home), run_name="lora",
                       overrides=LORA_ON_RAY + settings, on_ray=ray_launcher("run", address=""),
                       collectors=collectors)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_lora_run_on_ray_samples_each_adapter_it_publishes_and_resumes(ray_cluster, engine, tmp_path, request):
    if engine == "vllm":
        request.getfixturevalue("vllm_python")  # skips, saying how to get it, without the vLLM environment
    run = tmp_path / "lora"
    assert run_on_ray(tmp_path, steps=4, engine=engine) == 0
    assert run_on_ray(tmp_path, steps=7, engine=engine) == 0  # a second start: the driver offers version 4
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 8))
    assert isinstance(load_published(run, max(published_versions(run)))[0], PolicyAdapter)
    with open_buffer(run / "buffer", mode="r") as union:
        versions = union.read(torch.arange(len(union)), fields=("policy_version",))["policy_version"]
    # rows of adapter versions, each passed the canary before it was sampled (else the collector
    # stops and the run fails), the resumed start's included: step 7 (rows at most one version behind
    # the learner's 6) trains rows of version 5 at least, published by the second start
    assert int(versions.max()) >= 5, versions.tolist()
    own = [r.get("losses/sampler_logprob_diff_max/staleness_0") for r in records]
    assert all(gap < 1e-4 for gap in own if gap is not None), own
