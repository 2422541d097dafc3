"""GPU paths: pinned batches and non-blocking copies, bf16 autocast in the learner, generation and
reference scoring on the device. Skipped where torch sees no GPU (CI has none)."""

from __future__ import annotations

import pytest
import torch

from rlhf_pipeline.schema.padding import PaddedCollator, pad_batch, padded_fields
from rlhf_pipeline.collect import SamplingConfig, generate
from rlhf_pipeline.learn.learner import Learner
from rlhf_pipeline.learn.settings import LearnerSettings
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.models import char_tokenizer, tiny_causal_lm
from rlhf_pipeline.pipeline import RunPaths
from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage import create_store
from rlhf_pipeline.schema.synthetic import synthetic_batch
from rlhf_pipeline.transforms.ref_logprobs import reference_log_probs
from rlhf_pipeline.coordination.weights import publish_weights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; CI has none")

TOKENIZER = char_tokenizer()
SCHEMA = StoreSchema(optional=("advantage",))


def make_model():
    return tiny_causal_lm(len(TOKENIZER), hidden_size=32, num_layers=1, num_heads=2, seed=0)


def rows(n: int, seed: int = 0):
    return synthetic_batch(n, group_size=4, prompt_len=(3, 8), response_len=(1, 6), seed=seed,
                           optional_fields=("advantage",), vocab_size=len(TOKENIZER))


def test_padded_batches_come_pinned_and_land_on_the_gpu_unchanged(tmp_path):
    batch = rows(32)
    store = create_store(tmp_path / "buffer", "memmap", schema=SCHEMA)
    store.append(batch)
    positions = torch.tensor([3, 0, 31, 7, 7])
    expected = pad_batch(store.read(positions, fields=padded_fields(SCHEMA)))
    pinned = PaddedCollator(pin_memory=True).read(store, positions)
    on_gpu = PaddedCollator(device="cuda").read(store, positions)
    torch.cuda.synchronize()
    store.close()
    for key in expected.keys(True, True):
        assert pinned[key].is_pinned(), key
        assert on_gpu[key].device.type == "cuda", key
        assert torch.equal(on_gpu[key].cpu(), expected[key]), key


def test_learner_trains_under_bf16_autocast_on_the_gpu(tmp_path):
    paths = RunPaths(tmp_path / "run")
    store = create_store(paths.buffer, "memmap", schema=SCHEMA, segment_rows=32)
    store.append(rows(64))
    store.close()
    publish_weights(paths.root, make_model().state_dict(), 0)
    settings = LearnerSettings(batch_size=16, sample_window=64, micro_batch_tokens=64, lr=1e-3,
                               max_staleness=None, checkpoint_every=2, log_every=1)
    learner = Learner(settings, paths, make_model=make_model, steps=3, seed=1, device="cuda", show_progress=False)
    learner.setup()
    before = {k: v.detach().clone() for k, v in learner.model.state_dict().items()}
    assert learner.train() is True
    # parameters stay float32 (autocast computes in bf16), moved, and finite
    for name, value in learner.model.state_dict().items():
        assert value.device.type == "cuda" and value.dtype == torch.float32, name
        assert torch.isfinite(value).all(), name
    assert any(not torch.equal(before[k], v) for k, v in learner.model.state_dict().items())
    learner.cleanup()
    records = read_metrics(paths.metrics)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(r["losses/loss"])) for r in records)


def test_generation_and_reference_scores_on_the_gpu_match_the_cpu():
    model = make_model().eval()
    prompts = [TOKENIZER.encode("12+7="), TOKENIZER.encode("3+4=")]
    config = SamplingConfig(max_new_tokens=5, temperature=1.0)
    gen = generate(model.to("cuda"), prompts, config, pad_token_id=TOKENIZER.pad_token_id,
                   eos_token_id=TOKENIZER.eos_token_id, num_samples=3,
                   generator=torch.Generator(device="cuda").manual_seed(0))
    assert gen.response_tokens.values.device.type == "cpu"  # rows leave the device before storage
    on_gpu = reference_log_probs(model, gen.prompt_tokens, gen.response_tokens, device="cuda")
    on_cpu = reference_log_probs(model.to("cpu"), gen.prompt_tokens, gen.response_tokens, device="cpu")
    assert torch.allclose(on_gpu.values, on_cpu.values, atol=1e-4)
    # the sampler's own log-probs are those of the distribution it sampled from
    assert torch.allclose(gen.response_log_probs.values, on_cpu.values, atol=1e-4)
