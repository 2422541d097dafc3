"""export-model on a LoRA run: the merged model any transformers user loads, or with --adapter the adapter
alone, which peft applies to the run's version 0 to the same logits; a version from weights/ and one kept
only in a checkpoint alike. The run is tests/integration/test_lora_resume.py's uninterrupted one."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import needs_peft
import torch

from rlhf_pipeline.cli.main import main
from rlhf_pipeline.coordination.weights import load_published, published_versions
from rlhf_pipeline.models.lora import canary_log_probs
from rlhf_pipeline.pipeline import RunPaths
from tests.integration.test_resume_at_every_distance import (  # noqa: F401  (fixtures)
    CHECKPOINT_EVERY,
    STEPS,
    prepared,
    uninterrupted,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread"),
              needs_peft]
NAME = "default_lora"


def test_export_model_writes_the_merged_model_or_the_adapter_alone(tmp_path, uninterrupted, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    shared = uninterrupted(NAME)
    # the learner keeps a kept checkpoint's version for its branches; in a copy of the run without it (as a
    # replay, or a run made before, prunes it) the checkpoint is its only copy
    run = RunPaths(tmp_path / NAME)
    shutil.copytree(shared.root, run.root)
    (run.root / "weights" / f"policy_{CHECKPOINT_EVERY:08d}.safetensors").unlink()
    assert CHECKPOINT_EVERY not in published_versions(run.store)
    base_dir = tmp_path / "base"
    assert main(["export-model", str(run.root), str(base_dir), "--version", "0"]) == 0
    for version in (STEPS, CHECKPOINT_EVERY):
        merged_dir, adapter_dir = tmp_path / f"merged-{version}", tmp_path / f"adapter-{version}"
        assert main(["export-model", str(run.root), str(merged_dir), "--version", str(version)]) == 0
        assert main(["export-model", str(run.root), str(adapter_dir), "--version", str(version), "--adapter"]) == 0
        assert {p.name for p in adapter_dir.iterdir()} == {"adapter_model.safetensors", "adapter_config.json",
                                                           "rlhf_pipeline_export.json"}
        assert json.loads((adapter_dir / "adapter_config.json").read_text())["r"] == 4
        merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir).eval()
        tokens = [[3, 9, 14, 27, 5, 8, 2, 11]]
        torch.testing.assert_close(torch.tensor(canary_log_probs(merged, tokens)),
                                   torch.tensor(canary_log_probs(adapted, tokens)), atol=1e-4, rtol=0)
        if version == STEPS:  # the learner's own log-probs of that version
            canary = load_published(run.store, version)[0].canary
            torch.testing.assert_close(torch.tensor(canary_log_probs(merged, canary["tokens"])),
                                       torch.tensor(canary["log_probs"]), atol=1e-4, rtol=0)
    capsys.readouterr()
    assert main(["export-model", str(run.root), str(tmp_path / "not"), "--version", "0", "--adapter"]) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "is whole weights, not an adapter" in said[0] and "without --adapter" in said[0]
