"""The whole stack on a real replay buffer: group advantage -> reference log-probs -> KL reward -> memmap."""

from __future__ import annotations

import torch
from helpers import make_batch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage.memmap import MemmapTrajectoryStore
from rlhf_pipeline.storage.torchrl_glue import make_replay_buffer
from rlhf_pipeline.transforms import (
    GroupAdvantage,
    KLReward,
    ReferenceLogProbs,
    group_advantages,
    kl_token_rewards,
    reference_log_probs,
)

VOCAB = 101
FULL = StoreSchema(optional=("advantage", "ref_log_probs", "kl", "token_rewards"))


def test_stack_end_to_end_into_memmap(tmp_path):
    torch.manual_seed(0)
    ref_model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=128)).eval()
    store = MemmapTrajectoryStore.create(tmp_path / "buf", FULL, durable=False)
    ga = GroupAdvantage(4)
    kl = KLReward(0.05, estimator="k3")
    rb = make_replay_buffer(store, batch_size=5)
    # torchrl runs inverse transforms last-appended-first: append in reverse write order
    rb.append_transform(kl, invert=True)
    rb.append_transform(ReferenceLogProbs(ref_model, temperature=0.8, tokens_per_microbatch=200), invert=True)
    rb.append_transform(ga, invert=True)

    batch = make_batch(3, 4, vocab_size=VOCAB, seed=1)
    assert rb.extend(batch.select([0, 1, 4, 8])).numel() == 0  # no group complete yet
    assert store.next_row == 0
    idx = rb.extend(batch.select([2, 3, 5, 6, 7, 9, 10, 11]))
    assert idx.tolist() == list(range(12)) and store.next_row == 12

    stored = store.read_global(torch.arange(12))
    order = torch.argsort(stored["trajectory_id"])
    assert stored["trajectory_id"][order].tolist() == list(range(12))
    expected_adv, _ = group_advantages(stored["reward"], stored["group_id"], 3)
    torch.testing.assert_close(stored["advantage"], expected_adv, atol=1e-6, rtol=0)
    expected_ref = reference_log_probs(ref_model, stored["prompt_tokens"], stored["response_tokens"], temperature=0.8)
    torch.testing.assert_close(stored["ref_log_probs"].values, expected_ref.values, atol=1e-5, rtol=0)
    expected_kl, expected_tr = kl_token_rewards(stored["response_log_probs"], stored["ref_log_probs"],
                                                stored["reward"], coef=0.05, estimator="k3")
    torch.testing.assert_close(stored["kl"].values, expected_kl.values, atol=1e-6, rtol=0)
    torch.testing.assert_close(stored["token_rewards"].values, expected_tr.values, atol=1e-6, rtol=0)
    assert torch.equal(stored.select(order)["reward"], batch["reward"])  # row reward untouched

    sample = rb.sample()  # the read path passes through the stack untouched
    assert len(sample) == 5 and "advantage" in sample
    assert ga.metrics()["groups_written"] == 3 and ga.metrics()["pending_rows"] == 0
    store.close()
