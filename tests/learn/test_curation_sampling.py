"""Curation in the learner: whole-group draws with zero-variance replacement, prioritized draws
with importance weights, and training over a saved selection (learn/samplers/groups.py,
learn/samplers/prioritized.py, the loss's row weights)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import make_batch
from rlhf_pipeline.learn.samplers.groups import GroupWindowSampler
from rlhf_pipeline.learn.learner import Learner
from rlhf_pipeline.learn.loss import grpo_loss
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.learn.samplers.prioritized import PrioritizedRowSampler
from rlhf_pipeline.learn.settings import PRIORITY_NAMES, GRPOLossConfig, LearnerSettings
from rlhf_pipeline.models import char_tokenizer, tiny_causal_lm
from rlhf_pipeline.pipeline import RunPaths
from rlhf_pipeline.schema import StoreSchema, TrajectoryBatch
from rlhf_pipeline.storage import create_store, open_buffer, open_store
from rlhf_pipeline.storage.filtering import filter_buffer
from rlhf_pipeline.storage.memmap import MemmapTrajectoryStore
from rlhf_pipeline.storage.prioritized import PRIORITIES
from rlhf_pipeline.coordination.weights import publish_weights

SCHEMA = StoreSchema(("advantage",))
TOKENIZER = char_tokenizer()


def groups(rewards: list[list[float]], *, first_group: int, version: int = 0, seed: int = 0) -> TrajectoryBatch:
    """One group per reward list (4 rows each), ids from ``first_group``."""
    batch = make_batch(len(rewards), 4, seed=seed + first_group, optional=("advantage",), first_group_id=first_group,
                       first_trajectory_id=4 * first_group, policy_version=version, vocab_size=len(TOKENIZER),
                       prompt_len=(3, 8), response_len=(1, 6))
    return batch.with_columns(reward=torch.tensor([r for g in rewards for r in g], dtype=torch.float32))


MIXED, EQUAL = [0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]


def group_ids_of(store, positions) -> list[int]:
    ids = store.read(positions, fields=("group_id",))["group_id"]
    return sorted(set(ids.tolist()))


# ====================================================================== whole groups
def test_a_batch_holds_whole_groups_never_the_one_cut_by_the_window(tmp_path):
    with create_store(tmp_path / "b", "memmap", SCHEMA, segment_rows=8) as store:
        store.append(groups([MIXED] * 5, first_group=0))  # groups 0..4, rows 0..19
        sampler = GroupWindowSampler(open_store(tmp_path / "b"), batch_size=8, window=10, seed=0, max_staleness=None)
        for d in range(3):
            drawn = sampler.draw(d)
            assert group_ids_of(store, drawn.positions) == [3, 4]  # group 2 has rows 8, 9 outside the window
            assert sorted(drawn.positions.tolist()) == list(range(12, 20))
            assert drawn.metrics["charts/groups_in_batch"] == 2


def test_zero_variance_groups_are_replaced_by_informative_groups_from_earlier_draws(tmp_path):
    with create_store(tmp_path / "b", "memmap", SCHEMA, segment_rows=16) as store:
        store.append(groups([MIXED, EQUAL, MIXED, EQUAL], first_group=0))
        reader = open_store(tmp_path / "b")
        sampler = GroupWindowSampler(reader, batch_size=16, window=16, seed=0, max_staleness=None,
                                     replace_zero_variance=True, pool_groups=8)
        first = sampler.draw(0)
        assert first.metrics["charts/groups_zero_variance"] == 2
        assert first.metrics["charts/groups_replaced"] == 0  # nothing kept yet
        assert first.metrics["charts/replay_pool_groups"] == 2  # groups 0 and 2 are kept
        store.append(groups([EQUAL] * 3 + [[0.0, 0.0, 0.5, 0.0]], first_group=10))
        second = sampler.draw(1)
        assert second.metrics["charts/groups_zero_variance"] == 3
        assert second.metrics["charts/groups_replaced"] == 2  # two pool groups, each at most once a batch
        rows = store.read(second.positions, fields=("group_id", "reward"))
        assert {0, 2, 13} <= set(rows["group_id"].tolist()) and len(second.positions) == 16
        kept = [g for g in set(rows["group_id"].tolist()) if g in (10, 11, 12)]
        assert len(kept) == 1  # the zero-variance group that found no replacement stays
        assert second.metrics["charts/replay_pool_groups"] == 3  # group 13 joined the pool
        reader.close()


def test_pool_drops_groups_evicted_or_too_stale(tmp_path):
    store = MemmapTrajectoryStore.create(tmp_path / "b", SCHEMA, segment_rows=8, capacity_rows=16, evict_grace_s=0)
    store.append(groups([MIXED, MIXED], first_group=0))
    reader = open_store(tmp_path / "b")
    sampler = GroupWindowSampler(reader, batch_size=8, window=8, seed=0, max_staleness=1, replace_zero_variance=True)
    assert sampler.draw(0).metrics["charts/replay_pool_groups"] == 2
    store.append(groups([EQUAL, EQUAL], first_group=5, version=1))
    sampler.current_version = 2
    drawn = sampler.draw(1)
    assert drawn.metrics["charts/groups_replaced"] == 0  # version-0 groups are 2 versions old: stale
    assert drawn.metrics["charts/replay_pool_groups"] == 0
    sampler.current_version = 1
    store.append(groups([MIXED, MIXED], first_group=8, version=1))
    sampler.draw(2)  # groups 8, 9 kept in the pool
    store.append(groups([EQUAL, EQUAL], first_group=12, version=1))
    store.append(groups([EQUAL, EQUAL], first_group=14, version=1))  # the rows of groups 8, 9 are evicted
    assert reader.refresh() == 16 and reader.first_row == 24
    drawn = sampler.draw(3)
    assert drawn.metrics["charts/groups_replaced"] == 0 and drawn.metrics["charts/replay_pool_groups"] == 0
    reader.close()
    store.close()


def test_group_sampler_state_resumes_the_same_draws(tmp_path):
    def run(path, stop_at=None, state=None, start=0):
        store = create_store(path, "memmap", SCHEMA, segment_rows=16)
        reader = open_store(path)
        sampler = GroupWindowSampler(reader, batch_size=8, window=16, seed=3, max_staleness=None,
                                     replace_zero_variance=True, pool_groups=2)
        if state is not None:
            sampler.load_state_dict(state)
        drawn = []
        for d in range(6):
            store.append(groups([MIXED if (d + k) % 3 else EQUAL for k in range(2)], first_group=2 * d, seed=d))
            if d >= start:
                drawn.append(sampler.draw(d))
            if stop_at is not None and d == stop_at:
                break
        reader.close()
        store.close()
        return drawn

    straight = run(tmp_path / "a")
    first = run(tmp_path / "b", stop_at=2)
    resumed = run(tmp_path / "c", state=first[-1].sampler_state, start=3)
    for a, b in zip(straight[3:], resumed):
        assert a.positions.tolist() == b.positions.tolist() and a.metrics == b.metrics
    assert sum(d.metrics["charts/groups_replaced"] for d in straight) > 0


# ====================================================================== prioritized in the learner
def test_prioritized_row_sampler_weights_and_staleness(tmp_path):
    with create_store(tmp_path / "b", "memmap", SCHEMA, segment_rows=16) as store:
        store.append(groups([MIXED] * 4, first_group=0, version=0))
        store.append(groups([MIXED] * 4, first_group=4, version=3))
        reader = open_store(tmp_path / "b")
        sampler = PrioritizedRowSampler(reader, batch_size=32, seed=0, priority="abs_advantage", alpha=1.0,
                                        beta=1.0, max_staleness=1, timeout_s=0.2, poll_s=0.05)
        sampler.current_version = 4
        drawn = sampler.draw(0)
        assert bool((drawn.positions >= 16).all())  # version-0 rows are 4 versions old
        assert drawn.weights.shape == (32,) and float(drawn.weights.max()) <= 1.0
        again = PrioritizedRowSampler(reader, batch_size=32, seed=0, priority="abs_advantage", alpha=1.0,
                                      beta=1.0, max_staleness=1)
        again.load_state_dict(drawn.sampler_state)
        again.current_version = 4
        assert again.draw(0).positions.tolist() == drawn.positions.tolist()
        sampler.current_version = 9
        from rlhf_pipeline.learn.samplers import DataTimeoutError

        with pytest.raises(DataTimeoutError, match="no more than 1 versions older than learner version 9"):
            sampler.draw(1)
        reader.close()


def test_row_weights_scale_each_rows_loss_terms():
    generator = torch.Generator().manual_seed(0)
    log_probs = -torch.rand(3, 5, generator=generator, requires_grad=True)
    old = log_probs.detach() - 0.1 * torch.rand(3, 5, generator=generator)
    ref = old - 0.05
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    advantages = torch.tensor([1.0, -0.5, 2.0])
    weights = torch.tensor([0.5, 1.0, 0.25])
    config = GRPOLossConfig(aggregation="sequence_mean", kl_coef=0.1)
    weighted, _ = grpo_loss(log_probs, old, advantages, mask, config, ref_log_probs=ref, row_weights=weights)
    per_row = [grpo_loss(log_probs[i:i + 1], old[i:i + 1], advantages[i:i + 1], mask[i:i + 1], config,
                         ref_log_probs=ref[i:i + 1])[0] for i in range(3)]
    expected = sum(w * loss for w, loss in zip(weights, per_row)) / 3
    torch.testing.assert_close(weighted, expected)
    plain, _ = grpo_loss(log_probs, old, advantages, mask, config, ref_log_probs=ref)
    ones, _ = grpo_loss(log_probs, old, advantages, mask, config, ref_log_probs=ref, row_weights=torch.ones(3))
    assert torch.equal(plain, ones)


def test_priority_names_in_settings_match_the_sampler():
    assert sorted(PRIORITY_NAMES) == sorted(PRIORITIES)
    with pytest.raises(ValueError, match="'learner.priority' must be one of"):
        LearnerSettings(sampler="prioritized", priority="loss")
    with pytest.raises(ValueError, match="'learner.replace_zero_variance' needs sampler='groups'"):
        LearnerSettings(replace_zero_variance=True)


# ====================================================================== the learner
def make_model():
    return tiny_causal_lm(len(TOKENIZER), hidden_size=32, num_layers=1, num_heads=2, seed=0)


def write_buffer(path) -> None:
    with create_store(path, "memmap", SCHEMA, segment_rows=32) as store:
        for i in range(4):  # 16 groups, every other one with equal rewards
            store.append(groups([MIXED, EQUAL, [1.0, 0.0, 0.0, 0.0], [0.0] * 4], first_group=4 * i, seed=i))


def make_run(tmp_path, *, selection: bool = False) -> RunPaths:
    paths = RunPaths(tmp_path / "run")
    if selection:  # the run's buffer is a selection of a recorded buffer elsewhere
        write_buffer(tmp_path / "recorded")
        filter_buffer(tmp_path / "recorded", paths.buffer, "group_reward_std > 0", selection=True)
    else:
        write_buffer(paths.buffer)
    publish_weights(paths.root, make_model().state_dict(), 0)
    return paths


SETTINGS = LearnerSettings(batch_size=16, sample_window=32, micro_batch_tokens=64, lr=1e-3, max_staleness=None,
                           checkpoint_every=2, log_every=1)
CURATED = {
    "groups": dict(sampler="groups", replace_zero_variance=True, replay_pool_groups=4),
    "prioritized": dict(sampler="prioritized", priority="group_reward_std", priority_beta=1.0),
}


def train(paths, steps, max_steps=None, **changes):
    run = Learner(dataclasses.replace(SETTINGS, **changes), paths, make_model=make_model, steps=steps, seed=1,
                  show_progress=False)
    run.setup()
    run.train(max_steps=max_steps)
    run.cleanup()
    return read_metrics(paths.metrics)


@pytest.mark.parametrize("kind", sorted(CURATED))
def test_curated_learner_steps_resume_exactly(tmp_path, kind):
    straight = train(make_run(tmp_path / "a"), 4, **CURATED[kind])
    paths = make_run(tmp_path / "b")
    train(paths, 4, max_steps=2, **CURATED[kind])
    resumed = train(paths, 4, **CURATED[kind])
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for key in ("losses/loss", "losses/grad_norm", "charts/reward_mean"):
        assert [r[key] for r in straight] == [r[key] for r in resumed], key
    if kind == "groups":
        assert sum(r["charts/groups_replaced"] for r in straight) > 0
        for r in straight:  # the sampler's count agrees with the learner's own view of the batch
            left = r["charts/groups_zero_variance"] - r["charts/groups_replaced"]
            assert left == pytest.approx(r["charts/frac_reward_zero_std"] * r["charts/groups_in_batch"])
    else:
        # normalized to mean 1 over the batch, whatever the buffer's smallest priority
        assert all(0 < r["charts/importance_weight_min"] <= 1 for r in straight)
        assert all(r["charts/importance_weight_mean"] == pytest.approx(1.0, rel=1e-5) for r in straight)


def test_the_learner_trains_on_a_saved_selection(tmp_path):
    paths = make_run(tmp_path, selection=True)
    with open_buffer(paths.buffer) as selection:
        assert selection.backend_name == "selection" and len(selection) == 32  # 8 informative groups
    records = train(paths, 2, sampler="groups")
    assert [r["charts/frac_reward_zero_std"] for r in records] == [0.0, 0.0]
    assert all(r["charts/groups_in_batch"] == 4 for r in records)
