"""Packed batches made on the prefetch thread (``PackedBatch``, ``learn/batch.py``): from rows read ragged
off a real store, the same micro-batches, counts and per-row columns as packing the padded batch
of the same rows; and the learner's prefetch hands the training thread a batch packed already,
with no padded batch built on the way."""

from __future__ import annotations

import pytest
import torch
from test_trajectories import OPTIONAL, TURNS, multi_turn_rows

from rlhf_pipeline.coordination.weights import publish_weights
from rlhf_pipeline.files.run_paths import RunPaths
from rlhf_pipeline.learn import trajectories
from rlhf_pipeline.learn.batch import PackedBatch, RaggedRows, packed_micro_batches, take_rows
from rlhf_pipeline.learn.learner import Learner
from rlhf_pipeline.learn.settings import LearnerSettings
from rlhf_pipeline.learn.step import batch_counts, split_batch
from rlhf_pipeline.learn.trajectories import read_joined, read_trajectories
from rlhf_pipeline.models.tiny import tiny_causal_lm
from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.schema.padding import PaddedCollator
from rlhf_pipeline.schema.synthetic import batch_with_lengths
from rlhf_pipeline.storage import create_store
from rlhf_pipeline.storage.base import TrajectoryStore

VOCAB = 97
BUDGET = 48
MICRO_FIELDS = ("rows", "input_ids", "position_ids", "cu_seq_lens", "logit_positions", "targets", "response_mask",
                "sampler_log_probs", "advantages", "ref_log_probs")
# per-row entries the learner's bookkeeping reads from a batch (schema/padding.py's keys)
ROW_KEYS = (("next", "reward"), ("next", "done"), "group_id", "trajectory_id", "step", "policy_version",
            "sequence_advantage", "prompt_lengths", "response_lengths")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _assert_same_micro_batches(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.max_length == b.max_length
        for name in MICRO_FIELDS:
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None), name
            if x is not None:
                assert torch.equal(x, y), name


def _assert_like_padded(packed: PackedBatch, padded):
    """``packed`` trains exactly what packing the padded batch of the same rows trains."""
    _assert_same_micro_batches([micro for _, micro in packed.micro_batches()],
                               packed_micro_batches(RaggedRows.from_padded(padded), BUDGET))
    assert packed.counts() == batch_counts(padded)
    for key in ROW_KEYS:
        assert packed[key].dtype == padded[key].dtype and torch.equal(packed[key], padded[key]), key


def _single_turn_store(path):
    store = create_store(path, "memmap", schema=StoreSchema(optional=("advantage", "ref_log_probs")), segment_rows=8)
    prompts, responses = [5, 1, 12, 7, 3, 9, 2, 14, 6, 4], [9, 30, 2, 17, 1, 6, 11, 3, 8, 20]
    store.append(batch_with_lengths(prompts, responses, group_size=2, seed=4, vocab_size=VOCAB,
                                    optional_fields=("advantage", "ref_log_probs")))
    return store


def test_rows_read_ragged_pack_like_their_padded_batch(tmp_path):
    store = _single_turn_store(tmp_path / "buffer")
    positions = torch.tensor([9, 0, 3, 3, 7, 1, 5])
    packed = PackedBatch.from_stored(store.read_ragged(positions), BUDGET)
    _assert_like_padded(packed, PaddedCollator(index_dtype=torch.int32).read(store, positions))
    assert len(packed.pieces) > 1  # several micro-batches, one of them holding the 32-token row
    store.close()


@pytest.mark.parametrize("turn_advantage", ["trajectory", "turn"])
def test_trajectories_joined_ragged_pack_like_their_padded_batch(tmp_path, turn_advantage):
    store = create_store(tmp_path / "buffer", "memmap", schema=StoreSchema(optional=OPTIONAL), segment_rows=16)
    store.append(multi_turn_rows(TURNS, seed=3))
    ends = torch.nonzero(store.read(torch.arange(len(store)))["done"]).squeeze(1)
    steps = store.read(ends, fields=("step",))["step"].to(torch.int64)
    joined = read_joined(store, ends, steps, turn_advantage=turn_advantage)
    packed = PackedBatch.from_joined(joined, BUDGET)
    padded = read_trajectories(store, ends, steps, pad_token_id=0, turn_advantage=turn_advantage)
    _assert_like_padded(packed, padded)
    assert packed.rows.loss_mask is not None and not bool(packed.rows.loss_mask.values.all())
    assert torch.equal(packed["termination_reason"], padded["termination_reason"])
    store.close()


def test_dropped_rows_are_packed_afresh_as_if_only_they_were_drawn(tmp_path):
    """Stale or masked rows leave the batch on the training thread: what remains trains exactly
    as a draw of only those rows would, importance weights included."""
    store = _single_turn_store(tmp_path / "buffer")
    positions = torch.arange(10)
    packed = PackedBatch.from_stored(store.read_ragged(positions), BUDGET)
    packed["sample_weight"] = torch.linspace(0.5, 1.5, 10)
    kept = torch.tensor([1, 2, 6, 8, 9])
    narrowed = take_rows(packed, kept)  # what batch.drop_stale and data-parallel fillers call
    alone = PackedBatch.from_stored(store.read_ragged(positions[kept]), BUDGET)
    _assert_same_micro_batches([m for _, m in narrowed.micro_batches()], [m for _, m in alone.micro_batches()])
    for (rows, micro), want in zip(narrowed.micro_batches(), narrowed.pieces):
        assert torch.equal(rows, want[0])
        assert torch.equal(micro.sample_weight, torch.linspace(0.5, 1.5, 10)[kept][rows])
    assert len(narrowed) == 5 and narrowed.counts() == alone.counts()
    store.close()


# ====================================================================== the learner's prefetch thread
def _run(tmp_path) -> RunPaths:
    paths = RunPaths(tmp_path / "run")
    _single_turn_store(paths.buffer).close()
    publish_weights(paths.root, _model().state_dict(), 0)
    return paths


def _model():
    return tiny_causal_lm(VOCAB, hidden_size=32, num_layers=1, num_heads=2, pad_token_id=0, eos_token_id=1, seed=0)


def test_the_prefetch_thread_hands_over_batches_packed_with_no_padded_batch_built(tmp_path, monkeypatch):
    made_padded = []
    for owner, name in ((TrajectoryStore, "read_padded"), (trajectories, "pad_trajectories")):
        real = getattr(owner, name)

        def counted(*args, _real=real, _name=name, **kwargs):  # the real function, its calls recorded
            made_padded.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)
    settings = LearnerSettings(batch_size=6, sample_window=10, micro_batch_tokens=BUDGET, max_staleness=None,
                               checkpoint_every=10, log_every=1)
    learner = Learner(settings, _run(tmp_path / "a"), make_model=_model, steps=2, seed=1, show_progress=False)
    learner.setup()
    try:
        _, (sampled, batch, _, _), _ = learner._prefetcher.next()
        assert isinstance(batch, PackedBatch)
        # the training thread's split is the prefetch thread's micro-batches themselves: nothing re-packed
        pieces = split_batch(batch, settings)
        assert len(pieces) == len(batch.pieces) >= 1
        assert all(a is b for (_, a), (_, b) in zip(pieces, batch.pieces))
        assert torch.equal(batch["trajectory_id"], learner._store.read(sampled.positions)["trajectory_id"])
    finally:
        learner.cleanup()
    trained = []
    learner = Learner(settings, _run(tmp_path / "b"), make_model=_model, steps=2, seed=1, show_progress=False,
                      on_step=lambda step, sampled, batch, metrics: trained.append(type(batch)))
    learner.setup()
    try:
        assert learner.train()
    finally:
        learner.cleanup()
    assert trained == [PackedBatch, PackedBatch]
    assert made_padded == []


def test_a_packed_batch_reads_like_a_padded_one_for_the_learners_bookkeeping(tmp_path):
    store = _single_turn_store(tmp_path / "buffer")
    packed = PackedBatch.from_stored(store.read_ragged(torch.arange(4)), BUDGET)
    assert packed.batch_size == torch.Size([4]) and len(packed) == 4
    assert "policy_version" in packed and ("next", "reward") in packed and "sample_weight" not in packed
    assert packed.to("cpu") is packed  # on the CPU nothing moves
    packed["sample_weight"] = torch.ones(4)
    assert "sample_weight" in packed and packed["sample_weight"].shape == (4,)
    store.close()
