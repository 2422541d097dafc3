"""What a LoRA run asks of a vLLM server, without one (generation/vllm_adapters.py): the flags derived
once from the run's settings, and the refusals before any process starts, each naming the setting."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlhf_pipeline.generation.vllm_adapters import VLLM_LORA_RANKS, AdapterServing, served_rank
from rlhf_pipeline.learn.settings import LoraSettings
from rlhf_pipeline.models import tiny_model_and_tokenizer
from rlhf_pipeline.models.lora import canary_log_probs, canary_prompts, merged_state, zero_adapter
from rlhf_pipeline.pipeline import PipelineError, load_pipeline_module, make_settings

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("rank", "served"), [(1, 1), (4, 8), (8, 8), (9, 16), (300, 320), (512, 512)])
def test_the_server_is_started_with_the_smallest_of_vllms_ranks_at_or_above_the_runs(rank, served):
    assert served_rank(rank) == served and served in VLLM_LORA_RANKS


def test_max_loras_is_the_staleness_bound_plus_one_and_the_flags_say_so():
    lora = LoraSettings(rank=4)
    assert AdapterServing.of(lora, max_staleness=3).server_flags() == [
        "--enable-lora", "--max-loras", "4", "--max-lora-rank", "8"]
    assert AdapterServing.of(lora, max_staleness=None).max_loras == 2  # unpaced: the version and the one before


def test_a_lora_run_on_vllm_is_accepted_and_what_vllm_cannot_load_is_refused_naming_the_setting():
    module = load_pipeline_module(str(REPO / "pipelines" / "default.py"))
    for engine in (["generation.engine=vllm"], ["generation.url=http://127.0.0.1:1"]):
        assert make_settings(module, ["learner.lora.rank=8", *engine]).learner.lora.rank == 8
    with pytest.raises(PipelineError, match=r"setting 'learner.lora.rank' is 600; vLLM serves adapters up to rank 512"):
        make_settings(module, ["learner.lora.rank=600", "generation.engine=vllm"])
    with pytest.raises(PipelineError, match=r"generation.weight_transfer=nccl' with learner.lora.rank=8"):
        make_settings(module, ["learner.lora.rank=8", "generation.engine=vllm", "generation.weight_transfer=nccl"])
    assert make_settings(module, ["learner.lora.rank=600"]).learner.lora.rank == 600  # the loop merges any rank


def test_the_zero_adapter_an_engine_checks_a_server_with_is_the_base():
    model, _ = tiny_model_and_tokenizer(seed=0, hidden_size=64, num_heads=2, num_layers=2)
    zero = zero_adapter(model, 8, 16.0, ("q_proj", "down_proj"))
    assert len(zero) == 2 * 2 * 2  # A and B of two targets in two layers
    assert zero.config["r"] == 8 and zero.config["target_modules"] == ["down_proj", "q_proj"]
    merged, _ = tiny_model_and_tokenizer(seed=0, hidden_size=64, num_heads=2, num_layers=2)
    merged.load_state_dict(merged_state(model.state_dict(), zero))
    prompts = canary_prompts(model.config.vocab_size)
    assert prompts == canary_prompts(model.config.vocab_size) and len(prompts[0]) > 128  # fixed, past a CPU block
    assert canary_log_probs(merged, prompts) == canary_log_probs(model, prompts)
    assert all(torch.equal(t, torch.zeros_like(t)) for name, t in zero.items() if "lora_B" in name)
