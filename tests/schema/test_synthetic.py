"""Synthetic GRPO data: valid, deterministic, grouped as documented."""

from __future__ import annotations

import pytest
import torch

from rlhf_pipeline.schema import OPTIONAL_FIELDS, StoreSchema, validate_batch
from rlhf_pipeline.schema.synthetic import raw_payload_bytes, synthetic_batch, synthetic_batches


def test_batches_are_valid_sized_and_deterministic():
    kwargs = dict(group_size=4, prompt_len=(3, 9), response_len=(2, 12), batch_size=16,
                  optional_fields=OPTIONAL_FIELDS, seed=11)
    batches = list(synthetic_batches(40, **kwargs))
    assert [len(b) for b in batches] == [16, 16, 8]
    for batch in batches:
        validate_batch(batch, StoreSchema(tuple(OPTIONAL_FIELDS)))  # raises on any bad row
    again = list(synthetic_batches(40, **kwargs))
    assert all(a.equal(b) for a, b in zip(batches, again))
    other_seed = next(synthetic_batches(40, **{**kwargs, "seed": 12}))
    assert not batches[0].equal(other_seed)


def test_groups_share_a_prompt_and_lengths_stay_in_range():
    batch = synthetic_batch(64, group_size=8, prompt_len=(5, 7), response_len=(3, 4), optional_fields=("advantage",))
    assert torch.equal(batch["group_id"], torch.arange(64) // 8)
    prompts = batch["prompt_tokens"].to_list()
    for g in range(8):
        group = prompts[g * 8:(g + 1) * 8]
        assert all(torch.equal(p, group[0]) for p in group)
    assert int(batch["prompt_tokens"].lengths().min()) >= 5 and int(batch["prompt_tokens"].lengths().max()) <= 7
    lengths = batch["response_tokens"].lengths()
    assert torch.equal(batch["truncated"], lengths == 4)  # hit the maximum length
    advantage = batch["advantage"].reshape(8, 8)
    torch.testing.assert_close(advantage.mean(dim=1), torch.zeros(8), atol=1e-5, rtol=0)


def test_raw_payload_counts_values_and_text_but_not_offsets():
    batch = synthetic_batch(8, prompt_len=(2, 2), response_len=(3, 3))
    token_bytes = 8 * 2 * 4 + 8 * 3 * 4 + 8 * 3 * 4  # prompt ids, response ids, log-probs
    row_bytes = sum(batch[n].numel() * batch[n].element_size()
                    for n in batch.field_names if isinstance(batch[n], torch.Tensor))
    text_bytes = sum(len(t.encode()) for n in ("prompt_text", "response_text") for t in batch[n])
    assert raw_payload_bytes(batch) == token_bytes + row_bytes + text_bytes


@pytest.mark.parametrize("bad, message", [
    (dict(n_completions=0), "n_completions must be >= 1"),
    (dict(prompt_len=(5, 2)), "prompt_len must be"),
    (dict(optional_fields=("nope",)), "unknown optional field"),
])
def test_bad_arguments_name_the_problem(bad, message):
    with pytest.raises(ValueError, match=message):
        next(synthetic_batches(**{"n_completions": 8, **bad}))
