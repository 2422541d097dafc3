"""The ``exact`` learner sampler on real stores: every fresh row in exactly k draws."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from helpers import make_batch
from rlhf_pipeline.learn.samplers.exact import ExactUseSampler
from rlhf_pipeline.learn.samplers import DataTimeoutError, make_sampler
from rlhf_pipeline.learn.settings import LearnerSettings
from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage import create_store, open_buffer
from rlhf_pipeline.storage.sharded import shard_path

SCHEMA = StoreSchema(optional=("advantage",))


class Shards:
    """Collector ``k`` appends whole groups of 4 to shard ``k``; ids carry ``k`` and count from 0."""

    def __init__(self, buffer, count: int, **options) -> None:
        self.writers = [create_store(shard_path(buffer, k), "memmap", schema=SCHEMA, segment_rows=8, **options)
                        for k in range(count)]
        self.groups = [0] * count

    def append(self, shard: int, groups: int, version: int = 0) -> None:
        base, start = shard << 40, self.groups[shard]
        self.writers[shard].append(make_batch(groups, 4, seed=100 * shard + start, optional=("advantage",),
                                              first_group_id=base + start, first_trajectory_id=base + 4 * start,
                                              policy_version=version))
        self.groups[shard] += groups

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


def used_ids(reader, sampled) -> list[int]:
    return reader.read(sampled.positions, fields=("trajectory_id",))["trajectory_id"].tolist()


def run_draws(buffer, shards: Shards, uses: int, draws: int, *, resume_at: int | None = None) -> Counter:
    """Draws from a buffer written while it is read (uneven shard sizes, a late shard); returns
    how many times each trajectory was used. ``resume_at``: a new sampler and reader take over
    from the state after that draw, as a resumed learner would."""
    reader = open_buffer(buffer)
    sampler = ExactUseSampler(reader, batch_size=8, uses=uses, timeout_s=5)
    uses_of: Counter = Counter()
    for d in range(draws):
        shards.append(0, 1)  # 4 rows a draw to shard 0, 8 rows every other draw to shard 1
        if d % 2 and len(shards.writers) > 1:
            shards.append(1, 2)
        sampled = sampler.draw(d)
        assert sampled.positions.numel() == 8
        uses_of.update(used_ids(reader, sampled))
        if d == resume_at:
            state = sampled.sampler_state
            reader.close()
            reader = open_buffer(buffer)
            sampler = ExactUseSampler(reader, batch_size=8, uses=uses, timeout_s=5)
            sampler.load_state_dict(state)
    reader.close()
    return uses_of


@pytest.mark.parametrize("uses", [1, 3])
def test_every_row_is_used_exactly_k_times_across_shards(tmp_path, uses):
    shards = Shards(tmp_path / "buffer", 2)
    shards.append(0, 2)
    try:
        draws = 6 * uses  # whole blocks
        uses_of = run_draws(tmp_path / "buffer", shards, uses, draws)
    finally:
        shards.close()
    assert sum(uses_of.values()) == draws * 8
    assert set(uses_of.values()) == {uses}  # no row drawn twice by chance, none short of k
    from_shard = Counter(tid >> 40 for tid in uses_of)
    assert from_shard[0] and from_shard[1]  # both collectors' rows were trained on
    # each shard's rows are taken oldest first: the used ids of a shard have no gap
    for shard in (0, 1):
        local = sorted(tid - (shard << 40) for tid in uses_of if tid >> 40 == shard)
        assert local == list(range(len(local)))


def test_a_resumed_sampler_continues_the_block_and_the_order(tmp_path):
    straight = Shards(tmp_path / "a", 2)
    resumed = Shards(tmp_path / "b", 2)
    for s in (straight, resumed):
        s.append(0, 2)
    try:
        a = run_draws(tmp_path / "a", straight, uses=2, draws=8)
        b = run_draws(tmp_path / "b", resumed, uses=2, draws=8, resume_at=2)  # mid-block: pass 1 of 2 done
    finally:
        straight.close()
        resumed.close()
    assert a == b and set(b.values()) == {2}


def test_waits_for_a_whole_block_then_says_why_it_gave_up(tmp_path):
    shards = Shards(tmp_path / "buffer", 1)
    shards.append(0, 1)  # 4 rows: half a block
    reader = open_buffer(tmp_path / "buffer")
    stop = threading.Event()
    sampler = ExactUseSampler(reader, batch_size=8, timeout_s=0.3, poll_s=0.02, stop=stop)
    try:
        with pytest.raises(DataTimeoutError, match="8 rows not yet trained on .* holds 4"):
            sampler.draw(0)
        timer = threading.Timer(0.2, lambda: shards.append(0, 1))
        timer.start()
        sampler.timeout_s = 10
        first = sampler.draw(0)  # the other half arrives while it waits
        assert first.positions.tolist() == list(range(8))
        # what the learner publishes for collectors: rows taken in, and what the next draw needs
        assert first.consumed == {"shard-0000": 8} and first.next_draw_rows == 8
        stop.set()
        with pytest.raises(InterruptedError):
            sampler.draw(1)
    finally:
        reader.close()
        shards.close()


def test_rows_too_stale_when_their_block_forms_are_skipped_and_counted(tmp_path):
    shards = Shards(tmp_path / "buffer", 1)
    shards.append(0, 1, version=0)
    shards.append(0, 2, version=5)
    reader = open_buffer(tmp_path / "buffer")
    sampler = ExactUseSampler(reader, batch_size=8, max_staleness=1, timeout_s=5)
    sampler.current_version = 6
    try:
        drawn = sampler.draw(0)
        versions = reader.read(drawn.positions, fields=("policy_version",))["policy_version"]
        assert drawn.dropped_stale == 4 and versions.eq(5).all()
        assert drawn.consumed == {"shard-0000": 12}  # the skipped rows are behind the cursor for good
        shards.append(0, 2, version=0)  # only stale rows come: the give-up says so ("holds 0" alone read as none came)
        sampler.timeout_s = 0.3
        with pytest.raises(DataTimeoutError, match=r"8 rows not yet trained on .* \(it holds 0 past the rows already "
                                                   r"used; 8 more were too stale to train on\)"):
            sampler.draw(1)
    finally:
        reader.close()
        shards.close()


def test_a_block_waiting_for_rows_says_what_it_lacks_past_the_stale_ones(tmp_path):
    """What the learner tells the collectors while it waits (``pacing.json``'s ``lacking``): the rows
    its intake counted on were stale, so the block lacks 4 more than the intake said."""
    shards = Shards(tmp_path / "buffer", 1)
    shards.append(0, 1, version=0)  # 4 stale rows
    shards.append(0, 1, version=5)
    reader = open_buffer(tmp_path / "buffer")
    sampler = ExactUseSampler(reader, batch_size=8, max_staleness=1, timeout_s=60, poll_s=0.01)
    sampler.current_version = 6
    drawn: list = []
    drawing = threading.Thread(target=lambda: drawn.append(sampler.draw(0)))
    assert sampler.lacking == (0, 0, {})
    drawing.start()
    try:
        deadline = time.monotonic() + 60
        while sampler.lacking[1] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sampler.lacking == (6, 4, {"shard-0000": 8})  # the version the block trains with
        # and what the learner's wait line adds to "the buffer holds 8 past the rows taken in", which
        # read as rows it could have trained on (a buffer recorded by `collect` alone, then `learn`)
        assert sampler.why_rows_held_wait() == ("4 of them were sampled more than learner.max_staleness=1 (from "
                                                "max_lag) versions before version 6, which this draw trains with: "
                                                "passed over, never trained")
        shards.append(0, 1, version=6)
        drawing.join(60)
        assert drawn[0].dropped_stale == 4 and drawn[0].consumed == {"shard-0000": 12}
        assert sampler.lacking == (0, 0, {}) and sampler.why_rows_held_wait() is None  # the block is whole
    finally:
        sampler.stop.set()
        drawing.join(60)
        reader.close()
        shards.close()


def test_rows_evicted_before_their_last_pass_are_left_out(tmp_path):
    shards = Shards(tmp_path / "buffer", 1, capacity_rows=16)
    shards.append(0, 2)
    reader = open_buffer(tmp_path / "buffer")
    sampler = ExactUseSampler(reader, batch_size=8, uses=2, timeout_s=5)
    try:
        assert used_ids(reader, sampler.draw(0)) == list(range(8))
        shards.append(0, 4)  # 16 new rows: the store keeps 16, so the block's rows are evicted
        second = sampler.draw(1)  # its second pass finds none of them: a new block instead
        assert second.dropped_stale == 8 and used_ids(reader, second) == list(range(8, 16))
        assert used_ids(reader, sampler.draw(2)) == list(range(8, 16))  # that block's second pass
    finally:
        reader.close()
        shards.close()


def test_blocks_a_killed_learner_took_are_taken_again_as_recorded_not_as_the_shards_now_stand(tmp_path, capsys):
    """Beside several collectors, which rows of each shard a block takes is what the shards held as it
    was drawn: a learner resumed from the state of draw 0 finds both shards fuller than the killed one
    did, and takes the killed learner's blocks again only from its record (``consumed`` of each draw)."""
    shards = Shards(tmp_path / "buffer", 2)
    reader = open_buffer(tmp_path / "buffer")
    killed = ExactUseSampler(reader, batch_size=8, uses=1, max_staleness=2, timeout_s=5)
    try:
        shards.append(0, 2)  # draw 0: shard 0 alone has rows
        first = killed.draw(0)
        shards.append(1, 2)  # draw 1: shard 1 alone past the cursor
        second = killed.draw(1)
        taken = [used_ids(reader, second)]  # (positions name rows until the next refresh)
        shards.append(0, 1)
        shards.append(1, 1)  # draw 2: half of each
        third = killed.draw(2)
        taken.append(used_ids(reader, third))
        record = {1: second.consumed, 2: third.consumed}
        shards.append(0, 4)
        shards.append(1, 4)  # what the collectors wrote on while the learner was dead

        def resumed(retake) -> ExactUseSampler:
            sampler = ExactUseSampler(open_buffer(tmp_path / "buffer"), batch_size=8, uses=1, max_staleness=2,
                                      timeout_s=5)
            sampler.load_state_dict(first.sampler_state)
            if retake is not None:
                sampler.retake(retake)
            return sampler

        redrawn = resumed(None)  # no record: an even share of shards that both hold plenty
        assert [used_ids(redrawn.store, redrawn.draw(d)) for d in (1, 2)] != taken
        again = resumed(record)
        assert [used_ids(again.store, again.draw(d)) for d in (1, 2)] == taken
        assert [sorted({i >> 40 for i in ids}) for ids in taken] == [[1], [0, 1]]
        assert again.state_dict() == third.sampler_state
        fourth = again.draw(3)  # past the record: from the shards as they stand, 4 rows of each
        assert {i >> 40 for i in used_ids(again.store, fourth)} == {0, 1}

        changed = ExactUseSampler(open_buffer(tmp_path / "buffer"), batch_size=4, uses=1, timeout_s=5)
        changed.load_state_dict(first.sampler_state)
        changed.retake(record)  # learner.batch_size changed on resume: the recorded block is not one
        assert changed.draw(1).positions.numel() == 4
        assert "draw 2, taken in before the learner was stopped, took rows this learner cannot take again" \
            in capsys.readouterr().err
        for sampler in (redrawn, again, changed):
            sampler.store.close()
    finally:
        reader.close()
        shards.close()


def test_the_learner_setting_picks_it_and_checks_k(tmp_path):
    shards = Shards(tmp_path / "buffer", 1)
    shards.append(0, 2)
    reader = open_buffer(tmp_path / "buffer")
    try:
        settings = LearnerSettings(batch_size=8, sampler="exact", uses_per_row=2, max_staleness=None)
        sampler = make_sampler(settings, reader, seed=0, stop=threading.Event())
        assert isinstance(sampler, ExactUseSampler) and sampler.uses == 2
        # a checkpoint of the window sampler (the run switched samplers): start from the rows written now
        sampler.load_state_dict({"min_next_row": 4})
        shards.append(0, 2)
        assert used_ids(reader, sampler.draw(0)) == list(range(8, 16))
    finally:
        reader.close()
        shards.close()
    with pytest.raises(ValueError, match="'learner.uses_per_row' must be >= 1"):
        LearnerSettings(sampler="exact", uses_per_row=0)
