"""The GPU route for weights: vLLM's NCCL weight transfer behind the engine interface.

The transfer itself needs CUDA on both sides and vllm importable in this Python (its trainer-side
engine is vLLM's code): it runs where both hold and is skipped, saying so, elsewhere. The refusals
that keep a CPU run from choosing it run everywhere.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from rlhf_pipeline.generation import SampleRequest, SamplingConfig, UnsupportedSetting
from rlhf_pipeline.generation.loop import teacher_forced_log_probs
from rlhf_pipeline.generation.settings import GenerationSettings, check_generation, make_engine
from rlhf_pipeline.models import tiny_model_and_tokenizer
from rlhf_pipeline.schema.ragged import RaggedTensor


def test_the_nccl_route_is_refused_on_a_cpu_before_anything_starts():
    with pytest.raises(ValueError, match="generation.weight_transfer=nccl' needs a GPU"):
        check_generation(GenerationSettings(engine="vllm", weight_transfer="nccl"), device="cpu")
    from rlhf_pipeline.generation.vllm_nccl import NCCLVLLMEngine

    with pytest.raises(UnsupportedSetting, match="needs CUDA"):
        NCCLVLLMEngine("unused", python="unused", stop_token_ids=[1], vocab_size=8, max_model_len=8, device="cpu")


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                    reason="vLLM's NCCL weight transfer needs CUDA (its NCCL and IPC transfer engines are CUDA-only) "
                           "and vllm importable in this Python (the sending side is vLLM's code): no GPU here")
def test_weights_sent_over_nccl_are_the_ones_the_engine_samples_with():
    model, tok = tiny_model_and_tokenizer(hidden_size=64, num_heads=2, num_layers=2, seed=0)
    other, _ = tiny_model_and_tokenizer(hidden_size=64, num_heads=2, num_layers=2, seed=1)
    model, other = model.cuda(), other.cuda()
    settings = GenerationSettings(engine="vllm", weight_transfer="nccl", gpu_memory_utilization=0.2)
    engine = make_engine(settings, model, pad_token_id=tok.pad_token_id, stop_token_ids=[tok.eos_token_id],
                         device="cuda")
    try:
        engine.update_weights(other.state_dict(), 1)  # the state dict on the GPU, broadcast
        prompt = tok.apply_chat_template([{"role": "user", "content": "12+7="}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
        config = SamplingConfig(max_new_tokens=8)
        (group,) = engine.sample([SampleRequest(prompt, n=4)], config, torch.Generator().manual_seed(0))
        assert group.policy_version == 1
        recomputed = teacher_forced_log_probs(
            other, RaggedTensor.from_sequences([prompt] * 4, dtype=torch.int64),
            RaggedTensor.from_sequences([c.token_ids for c in group.completions], dtype=torch.int64), config)
        for completion, row in zip(group.completions, recomputed.to_list()):
            torch.testing.assert_close(torch.tensor(completion.log_probs), row.cpu(), atol=1e-3, rtol=0)
    finally:
        engine.close()
