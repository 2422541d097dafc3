"""Reference log-probs: batched + padded equals one forward per sequence, on tiny real models."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rlhf_pipeline.schema.ragged import RaggedTensor
from rlhf_pipeline.transforms import ReferenceLogProbs, reference_log_probs
from rlhf_pipeline.transforms.ref_logprobs import microbatches

VOCAB = 97


def _tiny(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(LlamaConfig(**common)) if kind == "llama" else Qwen2ForCausalLM(Qwen2Config(**common))
    return model.eval()


def _rows(n: int, seed: int = 0) -> tuple[RaggedTensor, RaggedTensor]:
    gen = torch.Generator().manual_seed(seed)
    # a fake chat template: the same system/user header on every prompt, as templated prompts have
    header = [1, 5, 6, 7]
    prompts = [header + torch.randint(8, VOCAB, (int(k),), generator=gen).tolist()
               for k in torch.randint(1, 20, (n,), generator=gen)]
    responses = [torch.randint(0, VOCAB, (int(k),), generator=gen).tolist()
                 for k in torch.randint(1, 30, (n,), generator=gen)]
    return RaggedTensor.from_sequences(prompts, torch.int32), RaggedTensor.from_sequences(responses, torch.int32)


@torch.no_grad()
def _one_by_one(model, prompts: RaggedTensor, responses: RaggedTensor, temperature: float) -> torch.Tensor:
    out = []
    for i in range(len(prompts)):
        p, r = prompts.row(i).long(), responses.row(i).long()
        logits = model(input_ids=torch.cat([p, r])[None]).logits[0, p.numel() - 1 : -1] / temperature
        out.append(torch.log_softmax(logits.float(), -1).gather(-1, r[:, None]).squeeze(-1))
    return torch.cat(out)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_batched_equals_per_sequence(kind, temperature):
    model = _tiny(kind)
    prompts, responses = _rows(9)
    # a small budget forces several micro-batches of mixed lengths
    got = reference_log_probs(model, prompts, responses, temperature=temperature, tokens_per_microbatch=120)
    assert torch.equal(got.offsets, responses.offsets)
    expected = _one_by_one(model, prompts, responses, temperature)
    torch.testing.assert_close(got.values, expected, atol=1e-5, rtol=0)
    assert bool((got.values <= 0).all())


def test_temperature_changes_the_scores():
    model = _tiny("llama")
    prompts, responses = _rows(3)
    a = reference_log_probs(model, prompts, responses, temperature=1.0)
    b = reference_log_probs(model, prompts, responses, temperature=0.5)
    assert not torch.allclose(a.values, b.values)


def test_microbatches_respect_budget_and_cover_every_row():
    p = torch.tensor([5, 50, 3, 7, 2])
    r = torch.tensor([10, 10, 100, 1, 1])
    batches = microbatches(p, r, 64)
    assert sorted(torch.cat(batches).tolist()) == [0, 1, 2, 3, 4]
    for idx in batches:
        width = int(p[idx].max() + r[idx].max())
        assert len(idx) == 1 or len(idx) * width <= 64


def test_transform_fills_ref_log_probs():
    from helpers import make_batch

    model = _tiny("qwen2")
    batch = make_batch(2, 3, vocab_size=VOCAB)
    t = ReferenceLogProbs(model, temperature=0.9, tokens_per_microbatch=64)
    out = t.write(batch)
    expected = _one_by_one(model, batch["prompt_tokens"], batch["response_tokens"], 0.9)
    torch.testing.assert_close(out["ref_log_probs"].values, expected, atol=1e-5, rtol=0)
    assert t.write(None) is None
    assert t.metrics()["ref_tokens"] > 0
    assert not any("ref_model" in k for k in t.state_dict())  # weights stay out of the buffer state
