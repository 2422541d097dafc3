"""A collector's saved position after a crash at either side of a round's append."""

from __future__ import annotations

import pytest
import torch

from rlhf_pipeline.collect import Collector, CollectorConfig, PromptSource, SamplingConfig
from rlhf_pipeline.collect.position import CollectorPosition
from rlhf_pipeline.collect.toy_task import toy_prompts, toy_reward
from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage import create_store, open_store
from rlhf_pipeline.files.atomic import save_torch_atomic


class Crash(Exception):
    """Stands for kill -9: nothing after the raise point runs."""


def make_collector(tiny, sink):
    model, tok = tiny
    config = CollectorConfig(prompts_per_batch=2, num_generations=4,
                             sampling=SamplingConfig(max_new_tokens=4, temperature=1.5))
    source = PromptSource(toy_prompts(10, seed=1), seed=0, required_fields=("answer",))
    return Collector(model, tok, source, {"toy": toy_reward}, sink, config)


def run_rounds(tiny, store, state_file, rounds, *, crash_after_append=False, crash_before_append=False):
    """Collects like ``rlhf-pipeline collect`` does; a crash flag stops inside the last round."""

    def sink(batch):
        if crash_before_append and done == rounds - 1:
            raise Crash
        store.append(batch)
        if crash_after_append and done == rounds - 1:
            raise Crash

    collector = make_collector(tiny, sink)
    position = CollectorPosition(state_file, store)
    saved = position.load()
    if saved is not None:
        collector.load_state_dict(saved)
    done = 0
    try:
        while done < rounds:
            collector.collect(before_write=position.before_write)
            position.after_write(collector.state_dict())
            done += 1
    except Crash:
        pass
    return position


def stored(store):
    return store.read(torch.arange(len(store)))


@pytest.fixture
def reference(tiny, tmp_path):
    """Rows of 4 uninterrupted rounds."""
    store = create_store(tmp_path / "reference", "memmap", schema=StoreSchema())
    run_rounds(tiny, store, tmp_path / "reference.pt", 4)
    rows = stored(store)
    store.close()
    return rows


@pytest.mark.parametrize("crash", ["after_append", "before_append"])
def test_crash_on_either_side_of_the_append_resumes_exactly(tiny, tmp_path, reference, crash):
    store = create_store(tmp_path / "buffer", "memmap", schema=StoreSchema())
    state_file = tmp_path / "collector.pt"
    run_rounds(tiny, store, state_file, 2, **{f"crash_{crash}": True})
    written = len(store)
    assert written == (16 if crash == "after_append" else 8)
    store.close()

    store = open_store(tmp_path / "buffer", mode="a")  # the restarted process
    position = run_rounds(tiny, store, state_file, 4 - written // 8)
    assert position.resumed_inflight_round == (crash == "after_append")
    rows = stored(store)
    store.close()
    # the same rows as an uninterrupted collector: no round written twice, none skipped
    assert len(rows) == 32
    assert rows["trajectory_id"].tolist() == list(range(32))
    assert rows.equal(reference)


def test_a_bare_state_file_from_an_older_run_still_loads(tiny, tmp_path):
    store = create_store(tmp_path / "buffer", "memmap", schema=StoreSchema())
    first = make_collector(tiny, store.append)
    first.collect()
    save_torch_atomic(first.state_dict(), tmp_path / "collector.pt")  # what runs saved before positions
    position = CollectorPosition(tmp_path / "collector.pt", store)
    again = make_collector(tiny, store.append)
    again.load_state_dict(position.load())
    assert int(again.collect()["trajectory_id"].min()) == 8
    assert not position.resumed_inflight_round
    store.close()
