"""Re-scoring while replaying: parity with the write-path transforms, on real stores and a tiny model."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_padded, make_batch

from rlhf_pipeline.schema.padding import pad_batch
from rlhf_pipeline.learn import rescore
from rlhf_pipeline.learn.rescore import AdvantageOptions, BatchRescorer, ReferenceRescorer, buffer_advantages
from rlhf_pipeline.models import tiny_causal_lm
from rlhf_pipeline.schema import StoreSchema, TrajectoryBatch
from rlhf_pipeline.storage import create_store, open_store
from rlhf_pipeline.transforms import GroupAdvantage, KLReward, ReferenceLogProbs

VOCAB = 64
OPTIONS = [AdvantageOptions(), AdvantageOptions(normalize=False), AdvantageOptions(leave_one_out=True),
           AdvantageOptions(normalize=False, leave_one_out=True)]


def multi_turn_rows() -> TrajectoryBatch:
    """3 groups of 3 trajectories of 1-3 steps each, rows of a trajectory contiguous, last one done."""
    steps = [1, 2, 3, 2, 1, 1, 3, 1, 2]
    n = sum(steps)
    traj = torch.arange(len(steps)).repeat_interleave(torch.tensor(steps))
    step = torch.arange(n) - torch.tensor([0, *steps]).cumsum(0)[:-1][traj]
    done = step == torch.tensor(steps)[traj] - 1
    return make_batch(1, n, seed=5, vocab_size=VOCAB).with_columns(
        group_id=(traj // 3).to(torch.int64), trajectory_id=traj.to(torch.int64) + 100, step=step.to(torch.int32),
        done=done, terminated=done, truncated=torch.zeros(n, dtype=torch.bool))


def stored(tmp_path, rows: TrajectoryBatch, name: str = "buf"):
    """``rows`` in a memmap store of 4-row segments (several units), reopened read-only."""
    store = create_store(tmp_path / name, "memmap", schema=StoreSchema.for_batch(rows), segment_rows=4)
    store.append(rows)
    store.close()
    return open_store(tmp_path / name, mode="r")


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: f"std={o.normalize},loo={o.leave_one_out}")
@pytest.mark.parametrize("which", ["single-turn", "multi-turn"])
def test_buffer_advantages_equal_the_write_path_transform(tmp_path, monkeypatch, options, which):
    rows = make_batch(6, 4, seed=1, vocab_size=VOCAB) if which == "single-turn" else multi_turn_rows()
    monkeypatch.setattr(rescore, "_READ_ROWS", 5)  # several reads of whole units, as on a big buffer
    with stored(tmp_path, rows) as store:
        got = buffer_advantages(store, len(store), options)
    group_size = 4 if which == "single-turn" else 3
    expected = GroupAdvantage(group_size, normalize=options.normalize, leave_one_out=options.leave_one_out).write(rows)
    assert torch.equal(expected["trajectory_id"], rows["trajectory_id"])  # written in the same order
    torch.testing.assert_close(got, expected["advantage"], rtol=0, atol=0)


def test_leave_one_out_names_a_group_with_one_trajectory(tmp_path):
    rows = make_batch(3, 2, seed=0, vocab_size=VOCAB)
    with stored(tmp_path, rows) as store:
        with pytest.raises(ValueError, match=r"group 2 has a single trajectory .*leave-one-out"):
            buffer_advantages(store, 5, AdvantageOptions(leave_one_out=True))  # the last group cut in half
        assert buffer_advantages(store, 5, AdvantageOptions()).shape == (5,)


def test_recomputed_advantages_give_the_batch_pad_batch_would(tmp_path):
    """A buffer recorded without advantages replays with Dr. GRPO advantages computed from its rewards."""
    rows = make_batch(5, 4, seed=2, vocab_size=VOCAB)
    positions = torch.tensor([17, 3, 8, 0, 19, 12])
    with stored(tmp_path, rows) as store:
        assert "advantage" not in store.schema.field_names
        rescorer = BatchRescorer(buffer_advantages(store, len(store), AdvantageOptions(normalize=False)))
        got = rescorer(positions, store.read_padded(positions))
    with_advantage = GroupAdvantage(4, normalize=False).write(rows)
    assert_same_padded(got, pad_batch(with_advantage.select(positions)))


def test_reference_rescoring_equals_the_write_path_transforms(tmp_path):
    model = tiny_causal_lm(VOCAB, hidden_size=32, num_layers=1, num_heads=2, seed=3)
    rows = make_batch(4, 3, seed=3, vocab_size=VOCAB, optional=("advantage", "ref_log_probs", "kl", "token_rewards"))
    positions = torch.tensor([2, 11, 5, 7, 0])
    with stored(tmp_path, rows) as store:  # holds stale reference values: they are replaced
        rescorer = BatchRescorer(reference=ReferenceRescorer(model, temperature=0.7, kl_estimator="k3", kl_coef=0.1))
        got = rescorer(positions, store.read_padded(positions))
        source_rows = store.read(torch.arange(len(store)))
    # the write path on the same rows: reference log-probs, then the KL reward
    expected_rows = KLReward(0.1, estimator="k3").write(ReferenceLogProbs(model, temperature=0.7).write(rows))
    expected = pad_batch(expected_rows.select(positions))
    assert set(got.keys(True, True)) == set(expected.keys(True, True))
    rescored = {("next", "ref_log_probs", "full"), ("ref_log_probs", "response"), ("kl", "full"),
                ("kl", "response"), ("next", "token_reward", "full"), ("next", "token_reward", "response")}
    for key in expected.keys(True, True):
        if key in rescored:  # micro-batched differently: equal to float precision
            torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(got[key], expected[key]), key
    # the stored values were different, and the store still holds them
    assert not torch.allclose(got["ref_log_probs", "response"],
                              pad_batch(rows.select(positions))["ref_log_probs", "response"])
    assert source_rows["ref_log_probs"].equal(rows["ref_log_probs"])
