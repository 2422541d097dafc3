"""A collector restarted from its store's last publish after a crash at either side of a round's
append, or of a round whose groups were all dropped: the rows of an uninterrupted collector."""

from __future__ import annotations

import pytest
import torch
from helpers import Crash, resume, store_sink

from rlhf_pipeline.collect import Collector, CollectorConfig, PromptSource, SamplingConfig, SingleTurn
from rlhf_pipeline.collect.toy_task import toy_prompts, toy_reward
from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage import create_store, open_store


def make_collector(tiny, sink, reward=toy_reward):
    model, tok = tiny
    config = CollectorConfig(tasks_per_round=2, group_size=4, max_failed_group_fraction=None,
                             sampling=SamplingConfig(max_new_tokens=4, temperature=1.5))
    source = PromptSource(toy_prompts(10, seed=1), seed=0, required_fields=("answer",))
    return Collector(model, tok, source, SingleTurn({"toy": reward}), sink, config)


def run_rounds(tiny, store, rounds, reward=toy_reward, appends=None, **crash):
    """Collects like ``rlhf-pipeline collect`` does: resumed from the store, a crash flag stops a round.
    ``appends`` gets the rows each sink call carried, the crashed call's too."""
    sink = store_sink(store, **crash)

    def counted(batch, writer_state):
        if appends is not None:
            appends.append(0 if batch is None else len(batch))
        sink(batch, writer_state=writer_state)

    collector = make_collector(tiny, counted, reward)
    resume(collector, store)
    try:
        for _ in range(rounds):
            collector.collect()
    except Crash:
        pass
    return collector


def stored(store):
    return store.read(torch.arange(len(store)))


@pytest.fixture
def reference(tiny, tmp_path):
    """Rows of 4 uninterrupted rounds."""
    store = create_store(tmp_path / "reference", "memmap", schema=StoreSchema())
    run_rounds(tiny, store, 4)
    rows = stored(store)
    store.close()
    return rows


@pytest.mark.parametrize("crash", ["crash_after", "crash_before"])
def test_crash_on_either_side_of_the_append_resumes_exactly(tiny, tmp_path, reference, crash):
    store = create_store(tmp_path / "buffer", "memmap", schema=StoreSchema())
    appends = []
    run_rounds(tiny, store, 2, appends=appends, **{crash: 2})
    written = len(store)
    # a round whose groups end apart goes to the store in several appends, as many as the timing makes
    assert len(appends) == 2
    assert written == sum(appends[:2] if crash == "crash_after" else appends[:1])
    store.close()

    store = open_store(tmp_path / "buffer", mode="a")  # the restarted process
    run_rounds(tiny, store, 4 - written // 8)
    rows = stored(store)
    store.close()
    # the same rows as an uninterrupted collector: no round written twice, none skipped
    assert len(rows) == 32
    assert rows["trajectory_id"].tolist() == list(range(32))
    assert rows.equal(reference)


def test_a_round_whose_groups_were_all_dropped_still_moves_the_collector_on(tiny, tmp_path):
    """Its state is published alone: the restarted collector goes on after it, not through it again."""
    def drop_round_2(prompts, completions, *, answer, **_):
        return [float("nan") if a in ROUND_2_ANSWERS else 0.0 for a in answer]

    store = create_store(tmp_path / "buffer", "memmap", schema=StoreSchema())
    first = run_rounds(tiny, store, 2, reward=drop_round_2)
    assert first.groups_dropped == 2 and len(store) == 8
    store.close()
    store = open_store(tmp_path / "buffer", mode="a")
    again = make_collector(tiny, store_sink(store), drop_round_2)
    assert resume(again, store)["batches_emitted"] == 2  # round 2's state, published without rows
    assert int(again.collect()["group_id"].min()) == 4
    store.close()


ROUND_2_ANSWERS = {r.fields["answer"] for r in PromptSource(toy_prompts(10, seed=1), seed=0).next_batch(4)[2:]}
