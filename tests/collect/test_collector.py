"""The collector: valid rows, ids, groups, versions, resume, new weights, metrics."""

from __future__ import annotations

import copy

import pytest
import torch

from rlhf_pipeline.collect import Collector, CollectorConfig, PromptSource, SamplingConfig, SingleTurn
from rlhf_pipeline.schema.ids import ID_COUNTER_BITS
from rlhf_pipeline.collect.toy_task import toy_prompts, toy_reward
from rlhf_pipeline.models import tiny_model_and_tokenizer
from rlhf_pipeline.schema import StoreSchema, validate_batch
from helpers import into


def _collector(model, tok, *, sink=None, index=0, seed=0, hooks=(), prompts=None):
    config = CollectorConfig(tasks_per_round=3, group_size=4, collector_index=index, seed=seed,
                             sampling=SamplingConfig(max_new_tokens=5, temperature=1.5))
    source = PromptSource(prompts or toy_prompts(10, seed=1), seed=seed, required_fields=("answer",))
    return Collector(model, tok, source, SingleTurn({"toy": toy_reward}), sink, config, hooks=hooks)


def test_rows_are_valid_grouped_and_uniquely_identified(tiny):
    model, tok = tiny
    sunk = []
    collector = _collector(model, tok, sink=into(sunk), index=3)
    batches = [collector.collect() for _ in range(2)]
    # the sink has each round's rows in group order, whole groups a call: one call a round, or more when
    # its groups end apart (our loop answers each request once its rows stopped, so the timing decides)
    assert all(len(b) % 4 == 0 for b in sunk) and sum(len(b) for b in sunk) == 24
    assert torch.cat([b["trajectory_id"] for b in sunk]).tolist() == \
        torch.cat([b["trajectory_id"] for b in batches]).tolist()
    for batch in batches:
        validate_batch(batch, StoreSchema())  # every required field, right dtypes and lengths
    groups = torch.cat([b["group_id"] for b in batches])
    trajs = torch.cat([b["trajectory_id"] for b in batches])
    assert len(set(trajs.tolist())) == 24
    assert bool(((trajs >> ID_COUNTER_BITS) == 3).all()) and bool(((groups >> ID_COUNTER_BITS) == 3).all())
    # 6 prompts -> 6 groups of 4 rows each, contiguous
    assert groups.reshape(6, 4).unique(dim=1).shape == (6, 1) and len(set(groups.tolist())) == 6
    b = batches[0]
    assert torch.equal(b["done"], b["terminated"] | b["truncated"]) and bool(b["done"].all())
    ends_on_eos = torch.tensor([int(r[-1]) == tok.eos_token_id for r in b["response_tokens"].to_list()])
    assert torch.equal(ends_on_eos, b["terminated"])
    assert b["response_text"][0] == tok.decode(b["response_tokens"].row(0).tolist(), skip_special_tokens=True)
    assert b["prompt_text"][0].startswith("<|user|>") and b["prompt_text"][0].endswith("<|assistant|>")
    assert collector.last_metrics["rows"] == 12 and "reward/toy" in collector.last_metrics


def test_collectors_with_different_indices_never_share_ids(tiny):
    from rlhf_pipeline.schema.ids import MAX_COLLECTORS
    from rlhf_pipeline.setting_checks import SEEDS

    model, tok = tiny
    a = _collector(model, tok, index=0).collect()
    b = _collector(model, tok, index=1).collect()
    # the largest seed with the last index still seeds the collector's generator (64 bits in torch)
    last = _collector(model, tok, index=MAX_COLLECTORS - 1, seed=int(SEEDS.lt) - 1).collect()
    assert bool(((last["trajectory_id"] >> ID_COUNTER_BITS) == MAX_COLLECTORS - 1).all())
    assert not set(a["trajectory_id"].tolist()) & set(b["trajectory_id"].tolist())
    assert not set(a["group_id"].tolist()) & set(b["group_id"].tolist())


def test_restart_neither_skips_nor_repeats(tiny):
    model, tok = tiny
    straight = _collector(model, tok)
    expected = [straight.collect() for _ in range(3)]

    first = _collector(model, tok)
    first.collect()
    state = copy.deepcopy(first.state_dict())
    restarted = _collector(model, tok)
    restarted.load_state_dict(state)
    resumed = [restarted.collect() for _ in range(2)]
    for want, got in zip(expected[1:], resumed):
        assert got.equal(want)

    with pytest.raises(ValueError, match="collector_index"):
        _collector(model, tok, index=2).load_state_dict(state)


def test_new_weights_change_samples_and_version_tag(tiny):
    _, tok = tiny
    model, _ = tiny_model_and_tokenizer(hidden_size=32, num_layers=2, num_heads=4, seed=0)
    other, _ = tiny_model_and_tokenizer(hidden_size=32, num_layers=2, num_heads=4, seed=1)
    collector = _collector(model, tok)
    assert bool((collector.collect()["policy_version"] == 0).all())
    collector.set_policy_state(other.state_dict(), version=5)
    for name, value in other.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert bool((collector.collect()["policy_version"] == 5).all())
    with pytest.raises(ValueError, match="older than the current 5"):
        collector.set_policy_state(other.state_dict(), version=4)
    bad = {k: v for k, v in other.state_dict().items() if "layers.1" not in k}
    with pytest.raises(ValueError, match="missing"):
        collector.set_policy_state(bad, version=6)


def test_hooks_get_metrics_and_sink_errors_do_not_advance_ids(tiny):
    model, tok = tiny
    seen = []

    def failing_sink(batch, writer_state):
        raise OSError("disk full")

    collector = _collector(model, tok, sink=failing_sink, hooks=[seen.append])
    with pytest.raises(OSError):
        collector.collect()
    assert collector.trajectories_emitted == 0 and seen == []
    collector.sink = None
    batch = collector.collect()
    assert int(batch["trajectory_id"].min()) == 0
    assert len(seen) == 1 and seen[0]["rows_per_s"] > 0
    assert seen[0]["reward_mean"] == pytest.approx(float(batch["reward"].mean()))


def test_config_errors():
    with pytest.raises(ValueError, match="group_size"):
        CollectorConfig(group_size=0)
    with pytest.raises(ValueError, match="collector_index"):
        CollectorConfig(collector_index=-1)
    with pytest.raises(ValueError, match=r"'CollectorConfig.seed' must be in \[0, 4294967296\), got 4294967296"):
        CollectorConfig(seed=2**32)


def test_rows_round_trip_through_a_memmap_store(tiny, tmp_path):
    from rlhf_pipeline.storage import create_store

    from rlhf_pipeline.storage import make_replay_buffer
    from rlhf_pipeline.storage.writer_state import decode

    model, tok = tiny
    store = create_store(tmp_path / "buffer", "memmap", schema=StoreSchema())
    try:
        collector = _collector(model, tok, sink=make_replay_buffer(store).extend)
        written = [collector.collect() for _ in range(2)]
        assert len(store) == 24
        back = store.read(torch.arange(24))
        assert back.equal(validate_batch(type(written[0]).cat(written), StoreSchema()))
        # the state after those rows, published with them: a collector restored from it goes on as this one
        published = decode(store.writer_state, store.location)["writer"]
        assert published["groups_emitted"] == 6 and published["batches_emitted"] == 2
        restored = _collector(model, tok, sink=None)
        restored.load_state_dict(published)
        assert restored.collect().equal(collector.collect())
    finally:
        store.close()
