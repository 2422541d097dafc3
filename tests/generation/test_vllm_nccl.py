"""The GPU route for weights: vLLM's NCCL weight transfer behind the engine interface.

The transfer itself needs CUDA on both sides and vllm importable in this Python (its trainer-side
engine is vLLM's code): it runs where both hold and is skipped, saying so, elsewhere; so is the
restart of this route's engine (kill -9 mid-round). The refusals that keep a CPU run from choosing
it run everywhere; what a restart reloads, when it is written and removed, is the same helper as the
files route's (``ServerWeights``) and is tested on a CPU (``test_vllm_held_weights.py``).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from engine_contract import chat_prompts, max_log_prob_difference, seeds
from helpers import killed_with_next_request, process_running

from rlhf_pipeline.generation import SampleRequest, SamplingConfig, UnsupportedSetting
from rlhf_pipeline.generation.loop import teacher_forced_log_probs
from rlhf_pipeline.generation.settings import GenerationSettings, check_generation, make_engine
from rlhf_pipeline.models import tiny_model_and_tokenizer
from rlhf_pipeline.schema.ragged import RaggedTensor


def test_the_nccl_route_is_refused_on_a_cpu_before_anything_starts():
    with pytest.raises(ValueError, match="generation.weight_transfer=nccl' needs a GPU"):
        check_generation(GenerationSettings(engine="vllm", weight_transfer="nccl"), device="cpu")
    from rlhf_pipeline.generation.vllm_nccl import NCCLVLLMEngine

    model, tok = tiny_model_and_tokenizer(hidden_size=64, num_heads=2, num_layers=1)
    with pytest.raises(UnsupportedSetting, match="needs CUDA"):
        NCCLVLLMEngine.from_model(model, python="unused", stop_token_ids=[tok.eos_token_id], device="cpu")


needs_cuda_and_vllm = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
    reason="vLLM's NCCL weight transfer needs CUDA (its NCCL and IPC transfer engines are CUDA-only) and vllm "
           "importable in this Python (the sending side is vLLM's code): no GPU here")
GPU_TOLERANCE = 1e-3
"""vLLM's log-probs on the GPU against our teacher-forced recompute on the CPU, same weights."""


@needs_cuda_and_vllm
def test_weights_sent_over_nccl_are_the_ones_the_engine_samples_with():
    model, tok = tiny_model_and_tokenizer(hidden_size=64, num_heads=2, num_layers=2, seed=0)
    other, _ = tiny_model_and_tokenizer(hidden_size=64, num_heads=2, num_layers=2, seed=1)
    model, other = model.cuda(), other.cuda()
    settings = GenerationSettings(engine="vllm", weight_transfer="nccl", gpu_memory_utilization=0.2)
    engine = make_engine(settings, model, pad_token_id=tok.pad_token_id, stop_token_ids=[tok.eos_token_id],
                         device="cuda")
    try:
        engine.load_weights(other.state_dict(), 1)  # the state dict on the GPU, broadcast
        prompt = tok.apply_chat_template([{"role": "user", "content": "12+7="}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
        config = SamplingConfig(max_new_tokens=8)
        (group,) = engine.sample([SampleRequest(prompt, n=4)], [0], config)
        assert group.policy_version == 1
        recomputed = teacher_forced_log_probs(
            other, RaggedTensor.from_sequences([prompt] * 4, dtype=torch.int64),
            RaggedTensor.from_sequences([c.token_ids for c in group.completions], dtype=torch.int64), config)
        for completion, row in zip(group.completions, recomputed.to_list()):
            torch.testing.assert_close(torch.tensor(completion.log_probs), row.cpu(), atol=1e-3, rtol=0)
    finally:
        engine.close()


@needs_cuda_and_vllm
def test_an_nccl_engine_killed_mid_round_restarts_from_its_file_and_the_next_version_uses_a_new_group():
    """kill -9 of the engine's process while it samples: a new process is given the version the dead
    one held (sent over NCCL, kept as a file in the engine's work dir) and samples the round again with
    the same seeds: the same rows. The dead peer's NCCL group is dropped; the next version is sent
    over a new one, and the engine samples with it."""
    model, tok = tiny_model_and_tokenizer(hidden_size=64, num_heads=2, num_layers=2, seed=0)
    v1_model, _ = tiny_model_and_tokenizer(hidden_size=64, num_heads=2, num_layers=2, seed=1)
    v2_model, _ = tiny_model_and_tokenizer(hidden_size=64, num_heads=2, num_layers=2, seed=2)
    settings = GenerationSettings(engine="vllm", weight_transfer="nccl", gpu_memory_utilization=0.2,
                                  retries=2, backoff_s=0.1)
    engine = make_engine(settings, model.cuda(), pad_token_id=tok.pad_token_id, stop_token_ids=[tok.eos_token_id],
                         device="cuda")
    said: list[str] = []
    engine.retries.announce = said.append
    requests = [SampleRequest(prompt, n=8) for prompt in chat_prompts(tok, 6)]
    config = SamplingConfig(max_new_tokens=64)
    try:
        # version 1 over NCCL from the GPU: a restart that forgot it would sample the model directory's weights
        engine.load_weights({name: t.cuda() for name, t in v1_model.state_dict().items()}, 1)
        kept = engine.weights.path
        assert kept is not None and kept.parent == engine.weights.files.dir and kept.exists()
        plain = engine.sample(requests, seeds(3, len(requests)), config)
        first_group, pid = engine._sender, engine.pid

        with killed_with_next_request(engine) as kill_sent:
            killed = engine.sample(requests, seeds(3, len(requests)), config)
        assert kill_sent.is_set()
        assert engine.pid != pid and not process_running(pid) and engine.stats.restarts == 1
        assert len(said) == 1 and "died (its process exited (killed by SIGKILL) while sampling)" in said[0], said
        assert engine._sender_generation != engine.server.generation  # the dead peer's group is not used again
        for a, b in zip(plain, killed, strict=True):
            assert a.policy_version == b.policy_version == 1
            assert [c.token_ids for c in a.completions] == [c.token_ids for c in b.completions]
        assert max_log_prob_difference(v1_model, killed, requests, config) < GPU_TOLERANCE

        engine.load_weights({name: t.cuda() for name, t in v2_model.state_dict().items()}, 2)
        assert engine._sender is not None and engine._sender is not first_group  # a new rendezvous
        assert not kept.exists() and engine.weights.path.exists()  # one version's file at a time
        groups = engine.sample(requests, seeds(4, len(requests)), config)
        assert all(group.policy_version == 2 for group in groups)
        assert max_log_prob_difference(v2_model, groups, requests, config) < GPU_TOLERANCE
    finally:
        engine.close()
