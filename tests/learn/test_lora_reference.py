"""A LoRA policy is its own reference: ReferenceLogProbs given a peft model scores its base with the
adapter disabled, exactly as the base model alone scores, while holding no copy of the base. A real tiny
model, a real peft adapter trained away from zero, the real write-path transform."""

from __future__ import annotations

import copy

import pytest
import torch

from rlhf_pipeline.models.lora import with_lora
from rlhf_pipeline.schema.ragged import RaggedTensor
from rlhf_pipeline.transforms import KLReward, ReferenceLogProbs
from tests.helpers import make_batch, needs_peft
from tests.transforms.test_ref_logprobs import VOCAB, _one_by_one, _tiny

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              needs_peft]


def test_the_reference_of_a_lora_policy_is_its_base_with_no_copy_held():
    base = _tiny("qwen2")
    alone = copy.deepcopy(base)  # the base as a second model: what a full fine-tuning run would hold
    policy = with_lora(base, 4, 8.0, 0.0, ("q_proj", "v_proj", "up_proj")).eval()
    with torch.no_grad():  # an adapter that has learned something: B away from zero
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.5)
    batch = make_batch(2, 3, vocab_size=VOCAB)
    prompts, responses = batch["prompt_tokens"], batch["response_tokens"]

    transform = ReferenceLogProbs(policy, temperature=0.9, tokens_per_microbatch=64)
    scored = transform.write(batch)["ref_log_probs"].values
    torch.testing.assert_close(scored, _one_by_one(alone, prompts, responses, 0.9), atol=1e-5, rtol=0)
    with_adapter = _one_by_one(policy, prompts, responses, 0.9)  # the adapter is back on after the write
    assert float((with_adapter - scored).abs().max()) > 1e-2
    # the transform holds the policy itself: every tensor it can reach is one of the policy's
    held = {p.data_ptr() for p in transform._ref_model.parameters()}
    assert held == {p.data_ptr() for p in policy.parameters()}

    # the KL reward of rows the policy sampled measures how far the adapter moved it from its base
    sampled = transform.write(batch)
    sampled = sampled.with_columns(response_log_probs=RaggedTensor(with_adapter, responses.offsets))
    kl = KLReward(0.1, estimator="k1").write(sampled)["kl"].values
    torch.testing.assert_close(kl, with_adapter - scored, atol=1e-6, rtol=0)
