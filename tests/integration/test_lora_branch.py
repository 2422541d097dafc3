"""A branch of a LoRA run, continued online with ``run``, trains what its parent trained after the branch
step: the same steps, rows and weights. With the parent's version of the branch step gone (as in a run
made before the learner kept it), the branch starts from the checkpoint's adapter, which its learner
publishes again with its canary, on the parent's version 0 (the base), copied with it. The machinery is
tests/integration/test_branch_online.py's."""

from __future__ import annotations


import pytest
from helpers import needs_peft

from rlhf_pipeline.cli.main import main
from rlhf_pipeline.coordination.weights import load_published, published_versions
from rlhf_pipeline.learn.metrics import read_metrics
from tests.integration.test_branch_online import BRANCH_AT, STEPS, digest, rows, run, same_weights, trained

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread"),
              needs_peft]
LORA = ("learner.lora.rank=4", "learner.lr=3e-3")


def test_a_branch_of_a_lora_run_trains_online_what_its_parent_trained(tmp_path):
    run(tmp_path, "parent", *LORA)
    parent = tmp_path / "parent"
    # the learner keeps the versions a kept step's branch samples with, its own among them; gone, as in a
    # run made before it did, the branch starts from the checkpoint's adapter all the same
    assert BRANCH_AT in published_versions(parent)
    (parent / "weights" / f"policy_{BRANCH_AT:08d}.safetensors").unlink()
    before = digest(parent)
    assert main(["branch", str(parent), "--from-step", str(BRANCH_AT), "same"]) == 0
    run(tmp_path, "same", *LORA)
    same = tmp_path / "same"
    assert digest(parent) == before
    assert [m["step"] for m in read_metrics(same / "metrics.jsonl")] == list(range(1, STEPS + 1))
    assert trained(same) == trained(parent)
    assert same_weights(same, parent)
    assert rows(same / "buffer") == rows(parent / "buffer")
    newest = max(published_versions(same))
    assert load_published(same, newest)[0].canary == load_published(parent, newest)[0].canary
