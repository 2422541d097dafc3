"""replay on LoRA runs: a LoRA replay of any recorded buffer trains and publishes adapters on the
recording run's version 0; a LoRA run's buffer and its newest policy (merged) start a full fine-tuning
replay. The recorded run is tests/integration/test_lora_resume.py's uninterrupted one."""

from __future__ import annotations


import pytest
from helpers import needs_peft

from rlhf_pipeline.cli.main import main
from rlhf_pipeline.coordination.weights import load_published, load_weights, published_versions
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.models.lora import PolicyAdapter
from tests.integration.test_resume_at_every_distance import REPO, STEPS, prepared, uninterrupted  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread"),
              needs_peft]
DEFAULT = str(REPO / "pipelines" / "default.py")
SMALL = ["--set", "warm_start_steps=5", "--set", "learner.batch_size=16", "--set", "learner.sample_window=32"]


def test_replay_trains_an_adapter_and_starts_from_a_lora_run(tmp_path, uninterrupted):
    recorded = uninterrupted("default_lora")
    buffer = str(recorded.root / "buffer")
    assert main(["replay", DEFAULT, "--buffer", buffer, "--steps", "4", "--home", str(tmp_path), "--run-name",
                 "adapter", *SMALL, "--set", "learner.lora.rank=4"]) == 0
    adapter = tmp_path / "adapter"
    assert [m["step"] for m in read_metrics(adapter / "metrics.jsonl")] == [1, 2, 3, 4]
    assert published_versions(adapter)[0] == 0 and isinstance(load_published(adapter, 4)[0], PolicyAdapter)

    assert main(["replay", DEFAULT, "--buffer", buffer, "--steps", "2", "--home", str(tmp_path), "--run-name",
                 "full", *SMALL, "--init-from", str(recorded.root)]) == 0
    full = tmp_path / "full"
    state, version = load_weights(full, 0)  # the recorded run's newest policy, merged, is the replay's start
    expected, _ = load_weights(recorded.root, STEPS)
    assert version == 0 and all((state[k] == expected[k]).all() for k in expected)
    assert not isinstance(load_published(full, 2)[0], PolicyAdapter)  # full fine-tuning publishes whole weights
