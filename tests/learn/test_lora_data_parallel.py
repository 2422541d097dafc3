"""A LoRA learner on two data-parallel ranks (a real ``torchrun``, gloo on CPU) trains like one rank:
the adapter alone, its gradients all-reduced by DDP, rank 0 alone publishing and checkpointing it; its
checkpoint resumes on one rank to the same adapter. The full fine-tuning twins: test_distributed.py."""

from __future__ import annotations

import pytest
import torch

from data_parallel_worker import LORA, SETTINGS, make_model, make_run, train
from helpers import needs_peft
from test_distributed import STEPS, final_weights, losses, torchrun
from rlhf_pipeline.coordination.weights import load_published, published_versions
from rlhf_pipeline.learn.checkpoint import CheckpointManager

pytestmark = [pytest.mark.slow, needs_peft]  # processes of their own


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The reference: the LoRA learner in this process over the whole global batch."""
    root = tmp_path_factory.mktemp("dp-lora") / "one-rank"
    make_run(root)
    train(root, STEPS, mode="lora")
    return root


def assert_same_adapter(root, reference) -> None:
    trained, expected = final_weights(root), final_weights(reference)
    assert set(trained) == set(expected) and all(".lora_" in name for name in trained)  # the adapter alone
    for key in expected:
        torch.testing.assert_close(trained[key], expected[key], rtol=1e-4, atol=1e-5, msg=key)
    assert any(float(t.abs().max()) > 0 for name, t in trained.items() if "lora_B" in name)  # it learned


def test_two_lora_ranks_train_the_adapter_like_one(one_rank, tmp_path):
    root = tmp_path / "two-ranks"
    make_run(root)
    torchrun(2, root, STEPS, "lora")
    assert len(losses(root)) == STEPS  # rank 0 alone wrote the metrics
    torch.testing.assert_close(losses(root), losses(one_rank), rtol=1e-4, atol=1e-6)
    assert_same_adapter(root, one_rank)
    assert published_versions(root) == published_versions(one_rank)
    assert published_versions(root)[0] == 0 and published_versions(root)[-1] == STEPS  # the base is kept
    published = load_published(root, STEPS)[0]
    reference = load_published(one_rank, STEPS)[0]
    assert set(published) == set(reference) and published.canary["version"] == STEPS
    torch.testing.assert_close(torch.tensor(published.canary["log_probs"]),
                               torch.tensor(reference.canary["log_probs"]), rtol=0, atol=1e-4)
    # the base stays version 0, untouched
    assert torch.equal(load_published(root, 0)[0]["model.embed_tokens.weight"],
                       make_model().state_dict()["model.embed_tokens.weight"])


def test_a_two_rank_lora_checkpoint_resumes_on_one_rank(one_rank, tmp_path):
    root = tmp_path / "resumed"
    make_run(root)
    torchrun(2, root, 2, "lora")  # checkpoint_every=2: the checkpoint at step 2
    assert CheckpointManager(root / "checkpoints").latest_step() == SETTINGS.checkpoint_every
    assert "lora" in CheckpointManager(root / "checkpoints").load()[1]
    train(root, STEPS, mode="lora")  # the same run directory, now one rank
    torch.testing.assert_close(losses(root), losses(one_rank), rtol=1e-4, atol=1e-6)
    assert_same_adapter(root, one_rank)
