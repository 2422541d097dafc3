"""Sampling: log-probs from the sampled distribution, EOS handling, determinism."""

from __future__ import annotations

import pytest
import torch

from rlhf_pipeline.collect import SamplingConfig, generate, process_logits, teacher_forced_log_probs
from rlhf_pipeline.models import tiny_model_and_tokenizer

PROMPTS = ["1+2=", "13+4=", "hello there, add 40+2="]


def _prompt_ids(tokenizer):
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for p in PROMPTS]


CONFIGS = [
    SamplingConfig(max_new_tokens=12),
    SamplingConfig(max_new_tokens=12, temperature=0.6),
    SamplingConfig(max_new_tokens=12, temperature=1.3, top_k=7),
    SamplingConfig(max_new_tokens=12, top_p=0.8),
    SamplingConfig(max_new_tokens=12, temperature=0.8, top_k=20, top_p=0.9),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"T{c.temperature}-k{c.top_k}-p{c.top_p}")
def test_stored_log_probs_match_a_teacher_forced_recompute(tiny, config):
    model, tok = tiny
    gen = generate(model, _prompt_ids(tok), config, pad_token_id=tok.pad_token_id,
                   eos_token_id=tok.eos_token_id, num_samples=4, generator=torch.Generator().manual_seed(1))
    again = teacher_forced_log_probs(model, gen.prompt_tokens, gen.response_tokens, config,
                                     pad_token_id=tok.pad_token_id)
    assert again.offsets.tolist() == gen.response_log_probs.offsets.tolist()
    torch.testing.assert_close(gen.response_log_probs.values, again.values, atol=1e-4, rtol=0)
    assert bool(torch.isfinite(gen.response_log_probs.values).all())
    if config.top_k or config.top_p < 1 or config.temperature != 1:
        # the processing matters: the raw distribution gives different numbers
        raw = teacher_forced_log_probs(model, gen.prompt_tokens, gen.response_tokens, None)
        assert (raw.values - gen.response_log_probs.values).abs().max() > 1e-3


def test_llama_log_probs_match_too():
    model, tok = tiny_model_and_tokenizer(arch="llama", hidden_size=32, num_layers=1, seed=2)
    config = SamplingConfig(max_new_tokens=8, temperature=0.7, top_p=0.9)
    gen = generate(model, _prompt_ids(tok), config, pad_token_id=0, eos_token_id=1, num_samples=3,
                   generator=torch.Generator().manual_seed(0))
    again = teacher_forced_log_probs(model, gen.prompt_tokens, gen.response_tokens, config)
    torch.testing.assert_close(gen.response_log_probs.values, again.values, atol=1e-4, rtol=0)


def test_responses_stop_at_eos_and_nothing_follows_it(tiny):
    model, tok = tiny
    # bias the model towards EOS so both terminated and truncated rows occur
    config = SamplingConfig(max_new_tokens=6, temperature=3.0)
    gen = generate(model, _prompt_ids(tok) * 4, config, pad_token_id=0, eos_token_id=1, num_samples=8,
                   generator=torch.Generator().manual_seed(3))
    eos = tok.eos_token_id
    assert bool(gen.terminated.any()) and bool(gen.truncated.any())
    assert torch.equal(gen.terminated, ~gen.truncated)
    for i, row in enumerate(gen.response_tokens.to_list()):
        is_eos = (row == eos).tolist()
        if gen.terminated[i]:
            assert is_eos[-1] and not any(is_eos[:-1]), row
        else:
            assert len(row) == config.max_new_tokens and not any(is_eos), row


def test_groups_are_contiguous_and_prompts_kept(tiny):
    model, tok = tiny
    ids = _prompt_ids(tok)
    gen = generate(model, ids, SamplingConfig(max_new_tokens=4), pad_token_id=0, eos_token_id=1, num_samples=5,
                   generator=torch.Generator().manual_seed(0))
    assert gen.prompt_index.tolist() == [i for i in range(len(ids)) for _ in range(5)]
    for i, row in enumerate(gen.prompt_tokens.to_list()):
        assert row.tolist() == ids[int(gen.prompt_index[i])]


def test_same_generator_state_same_samples(tiny):
    model, tok = tiny
    cfg = SamplingConfig(max_new_tokens=8)
    a = generate(model, _prompt_ids(tok), cfg, pad_token_id=0, eos_token_id=1, num_samples=4,
                 generator=torch.Generator().manual_seed(5))
    b = generate(model, _prompt_ids(tok), cfg, pad_token_id=0, eos_token_id=1, num_samples=4,
                 generator=torch.Generator().manual_seed(5))
    c = generate(model, _prompt_ids(tok), cfg, pad_token_id=0, eos_token_id=1, num_samples=4,
                 generator=torch.Generator().manual_seed(6))
    assert a.response_tokens.equal(b.response_tokens)
    assert not a.response_tokens.equal(c.response_tokens)


def test_process_logits_truncation():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    top_k = process_logits(logits, SamplingConfig(top_k=2))
    assert torch.isinf(top_k).tolist() == [[False, False, True, True]]
    # 0.5 + 0.25 = 0.75 < 0.8, so the third token is needed; the fourth is not
    top_p = process_logits(logits, SamplingConfig(top_p=0.8))
    assert torch.isinf(top_p).tolist() == [[False, False, False, True]]
    tiny_p = process_logits(logits, SamplingConfig(top_p=0.01))
    assert torch.isinf(tiny_p).tolist() == [[False, True, True, True]]
    hot = process_logits(logits, SamplingConfig(temperature=2.0))
    torch.testing.assert_close(hot, logits / 2)


def test_sampling_config_errors_name_the_setting():
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingConfig(max_new_tokens=0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingConfig(top_k=-1)


def test_sampling_passes_the_kv_cache_under_the_name_transformers_takes_without_a_warning(tiny):
    """transformers 5.24 renamed ``past_key_values`` to ``cache``: the old name still works but
    printed two deprecation warnings on every collector start (issue 33)."""
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    model, tok = tiny
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    hf_logging.warning_once.cache_clear()  # an earlier test may have had it printed once already
    hf_root = logging.getLogger("transformers")
    hf_root.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gen = generate(model, _prompt_ids(tok), SamplingConfig(max_new_tokens=5), pad_token_id=0,
                           eos_token_id=1, num_samples=2, generator=torch.Generator().manual_seed(0))
    finally:
        hf_root.removeHandler(handler)
    said = [str(w.message) for w in caught] + [r.getMessage() for r in records]
    assert not [line for line in said if "past_key_values" in line or "deprecated" in line], said
    assert gen.response_tokens.lengths().max() > 1  # decoding went past the first token, through the cache
