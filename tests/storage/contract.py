"""The storage contract, as one test base class every backend's test file subclasses.

A backend's test file only names its entry in ``backends.BACKENDS``::

    class TestMemmapContract(StoreContractTests):
        backend = "memmap"

Hooks a subclass may override: ``segment_rows`` (rows per segment in these tests),
``optional`` (optional fields the stores hold). Everything here goes through the
public ``TrajectoryStore`` API and torchrl's ``ReplayBuffer``, with real files.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
from backends import BACKENDS
from helpers import make_batch

from rlhf_pipeline.schema import OPTIONAL_FIELDS, StoreSchema, TrajectoryBatch, TrajectoryValidationError
from rlhf_pipeline.storage import NotAStoreError, open_store
from rlhf_pipeline.storage.base import (
    ReadOnlyStoreError,
    StoreClosedError,
    StoreCorruptedError,
    StoreLockedError,
    StoreNotFoundError,
)
from rlhf_pipeline.storage.torchrl_glue import make_replay_buffer
from rlhf_pipeline.schema.synthetic import raw_payload_bytes
from torchrl_contract import TorchRLContractTests


class StoreContractTests(TorchRLContractTests):
    backend: str = ""
    segment_rows: int = 8
    optional: tuple[str, ...] = OPTIONAL_FIELDS

    # ------------------------------------------------------------------ hooks
    @pytest.fixture
    def factory(self):
        return BACKENDS[self.backend]

    @pytest.fixture
    def location(self, tmp_path):
        return str(tmp_path / "buffer")

    def new_store(self, factory, location, **options):
        options.setdefault("segment_rows", self.segment_rows)
        return factory.create(location, StoreSchema(self.optional), **options)

    def batch(self, i: int, n_groups: int = 2, group_size: int = 3) -> TrajectoryBatch:
        """The i-th batch of a test: distinct ids and contents per i."""
        return make_batch(
            n_groups, group_size, seed=i, optional=self.optional,
            first_group_id=100 * i, first_trajectory_id=1000 * i, policy_version=i % 3,
        )

    # ------------------------------------------------------------------ round trips
    def test_append_returns_positions_and_reads_back_equal(self, factory, location):
        with self.new_store(factory, location) as store:
            first, second = self.batch(0), self.batch(1, n_groups=3)
            assert store.append(first).tolist() == list(range(6))
            assert store.append(second).tolist() == list(range(6, 15))
            assert len(store) == 15 and store.next_row == 15 and store.first_row == 0
            expected = TrajectoryBatch.cat([first, second])
            assert store.read(torch.arange(15)).equal(expected)
            order = torch.tensor([14, 0, 7, 7, 3])
            assert store.read(order).equal(expected.select(order))

    def test_append_spanning_several_segments(self, factory, location):
        with self.new_store(factory, location) as store:
            big = self.batch(0, n_groups=7, group_size=4)  # 28 rows over 4 segments of 8
            store.append(big)
            store.append(self.batch(1, n_groups=1, group_size=1))
            expected = TrajectoryBatch.cat([big, self.batch(1, n_groups=1, group_size=1)])
            assert store.read(torch.arange(29)).equal(expected)

    def test_read_a_subset_of_fields(self, factory, location):
        with self.new_store(factory, location) as store:
            batch = self.batch(0)
            store.append(batch)
            got = store.read([4, 1], fields=["response_tokens", "reward"])
            assert got.field_names == ("response_tokens", "reward")
            assert got["response_tokens"].equal(batch.select([4, 1])["response_tokens"])
            with pytest.raises(KeyError, match="not stored"):
                store.read([0], fields=["no_such_field"])

    def test_read_ragged_equals_read_of_the_located_fields(self, factory, location):
        """The packed learner's read: rows end to end, no padding, exactly what ``read`` gives."""
        from rlhf_pipeline.storage.padded_rows import located_fields

        with self.new_store(factory, location) as store:
            for i in range(3):  # 21 rows over 3 segments of 8
                store.append(self.batch(i, n_groups=3 if i == 1 else 2))
            fields = located_fields(store.schema)
            assert "prompt_tokens" in fields and "policy_version" in fields and "prompt_text" not in fields
            for positions in (torch.tensor([0]), torch.tensor([20, 0, 7, 8, 8, 15]), torch.arange(21).flip(0)):
                got = store.read_ragged(positions)
                assert set(got.field_names) == set(fields)
                assert got.equal(store.read(positions, fields=fields))
            assert len(store.read_ragged(torch.zeros(0, dtype=torch.int64))) == 0
            with pytest.raises(IndexError, match=r"\[0, 21\)"):
                store.read_ragged([21])

    def test_out_of_range_positions_raise(self, factory, location):
        with self.new_store(factory, location) as store:
            store.append(self.batch(0))
            with pytest.raises(IndexError, match=r"\[0, 6\)"):
                store.read([6])

    def test_reopen_for_append_resumes_at_next_row(self, factory, location):
        store = self.new_store(factory, location)
        store.append(self.batch(0))
        store.close()
        with factory.open(location, "a") as store:
            assert store.next_row == 6
            assert store.append(self.batch(1)).tolist() == list(range(6, 12))
        with factory.open(location, "r") as reader:
            assert reader.read(torch.arange(12)).equal(TrajectoryBatch.cat([self.batch(0), self.batch(1)]))

    # ------------------------------------------------------------------ visibility and locking
    def test_reader_sees_published_rows_and_refreshes(self, factory, location):
        with self.new_store(factory, location) as writer, factory.open(location, "r") as reader:
            assert len(reader) == 0
            writer.append(self.batch(0))
            assert len(reader) == 6  # __len__ refreshes a reader
            writer.append(self.batch(1))
            assert reader.refresh() == 12
            assert reader.read(torch.arange(12)).equal(TrajectoryBatch.cat([self.batch(0), self.batch(1)]))

    def test_read_only_store_refuses_appends(self, factory, location):
        self.new_store(factory, location).close()
        with factory.open(location, "r") as reader:
            assert not reader.writable
            with pytest.raises(ReadOnlyStoreError, match="mode='a'"):
                reader.append(self.batch(0))

    def test_second_writer_gets_store_locked_error_naming_the_holder(self, factory, location):
        with self.new_store(factory, location):
            with pytest.raises(StoreLockedError, match=str(os.getpid())):
                factory.open(location, "a")
        with factory.open(location, "a") as again:  # released on close
            assert again.writable

    # ------------------------------------------------------------------ eviction
    def test_capacity_evicts_oldest_whole_segments(self, factory, location):
        seg = self.segment_rows
        with self.new_store(factory, location, capacity_rows=2 * seg) as store, \
                factory.open(location, "r") as reader:
            assert store.supports_eviction
            batches = [self.batch(i, n_groups=1, group_size=5) for i in range(8)]  # 40 rows
            for b in batches:
                positions = store.append(b)
                assert positions[-1] == len(store) - 1
                assert store.first_row % seg == 0
                assert len(store) <= 2 * seg
            everything = TrajectoryBatch.cat(batches)
            # whole segments only, and no more than needed to get back under capacity
            assert seg < len(store) <= 2 * seg and store.first_row == 40 - len(store)
            held = torch.arange(store.first_row, store.next_row)
            assert store.read_global(held).equal(everything.select(held))
            assert reader.refresh() == len(store) and reader.first_row == store.first_row
            assert reader.read(torch.arange(len(reader))).equal(everything.select(held))
            with pytest.raises(IndexError, match="evicted"):
                store.read_global([store.first_row - 1])
            with pytest.raises(IndexError, match="evicted"):
                reader.read_global([0])

    # ------------------------------------------------------------------ bad input
    def test_rejected_write_leaves_store_unchanged(self, factory, location):
        with self.new_store(factory, location) as store, factory.open(location, "r") as reader:
            store.append(self.batch(0))
            bad = self.batch(1)
            reward = bad["reward"].clone()
            reward[4] = float("nan")
            with pytest.raises(TrajectoryValidationError, match=r"row 4, field 'reward'"):
                store.append(bad.with_columns(reward=reward))
            with pytest.raises(TrajectoryValidationError, match="missing field"):
                store.append(bad.without("response_text"))
            assert len(store) == 6 and len(reader) == 6
            assert store.read(torch.arange(6)).equal(self.batch(0))
            assert store.append(self.batch(2)).tolist() == list(range(6, 12))
            assert reader.refresh() == 12
            assert reader.read(torch.arange(12)).equal(TrajectoryBatch.cat([self.batch(0), self.batch(2)]))

    # ------------------------------------------------------------------ the writer's state
    def test_writer_state_is_published_with_its_rows(self, factory, location):
        """An append's writer_state is the store's from that publish on: for the writer, a reader
        after refresh, and a reopened writer; an append without one keeps it."""
        with self.new_store(factory, location) as store, factory.open(location, "r") as reader:
            assert store.writer_state is None and reader.writer_state is None
            store.append(self.batch(0), writer_state=b"after batch 0")
            assert store.writer_state == b"after batch 0"
            assert reader.writer_state is None  # not refreshed yet: its rows and state are the old ones
            assert reader.refresh() == 6 and reader.writer_state == b"after batch 0"
            store.append(self.batch(1))
            assert store.writer_state == b"after batch 0"
            store.append(self.batch(2), writer_state=bytes(range(256)) * 40)  # any bytes, a few KB
        with factory.open(location, "a") as store:
            assert store.next_row == 18 and store.writer_state == bytes(range(256)) * 40

    def test_writer_state_alone_is_published_without_rows(self, factory, location):
        """A round whose groups were all dropped still moves the writer on: its state is published
        with no rows, and the rows stay as they were."""
        with self.new_store(factory, location) as store, factory.open(location, "r") as reader:
            store.append(self.batch(0), writer_state=b"one")
            assert store.append(None, writer_state=b"two").tolist() == []
            assert store.append(self.batch(1).select(torch.arange(0)), writer_state=b"three").tolist() == []
            assert (store.next_row, store.writer_state) == (6, b"three")
            assert (reader.refresh(), reader.writer_state) == (6, b"three")
            assert reader.read(torch.arange(6)).equal(self.batch(0))
            assert store.append(self.batch(1)).tolist() == list(range(6, 12))
        with factory.open(location, "r") as reader:
            assert (reader.next_row, reader.writer_state) == (12, b"three")

    def test_writer_state_stays_through_eviction_and_sealing(self, factory, location):
        with self.new_store(factory, location, capacity_rows=2 * self.segment_rows) as store:
            for i in range(8):
                store.append(self.batch(i), writer_state=f"after {i}".encode())
            assert store.first_row > 0  # evicted: those publishes carried no state of their own
            if hasattr(store, "flush"):
                store.flush()  # a background seal published since
            assert store.writer_state == b"after 7"
        with factory.open(location, "r") as reader:
            assert reader.writer_state == b"after 7"

    def test_rejected_write_leaves_the_writer_state_unchanged(self, factory, location):
        with self.new_store(factory, location) as store:
            store.append(self.batch(0), writer_state=b"kept")
            bad = self.batch(1)
            with pytest.raises(TrajectoryValidationError):
                store.append(bad.without("response_text"), writer_state=b"never")
            with pytest.raises(TypeError, match="writer_state must be bytes"):
                store.append(self.batch(1), writer_state={"position": 1})
            assert (store.next_row, store.writer_state) == (6, b"kept")
        with factory.open(location, "r") as reader:
            assert (reader.next_row, reader.writer_state) == (6, b"kept")

    # ------------------------------------------------------------------ torchrl
    def test_replay_buffer_extend_and_random_sample(self, factory, location):
        with self.new_store(factory, location) as store:
            rb = make_replay_buffer(store, batch_size=5, sampler="random")
            assert rb.extend(self.batch(0)).tolist() == list(range(6))
            assert rb.extend(self.batch(1)).tolist() == list(range(6, 12))
            assert len(rb) == 12
            sample, info = rb.sample(return_info=True)
            assert isinstance(sample, TrajectoryBatch) and len(sample) == 5
            expected = TrajectoryBatch.cat([self.batch(0), self.batch(1)]).select(info["index"])
            assert sample.equal(expected)

    def test_replay_buffer_without_replacement_covers_each_row_once(self, factory, location):
        with self.new_store(factory, location) as store:
            store.append(self.batch(0, n_groups=4))  # 12 rows
            rb = make_replay_buffer(store, batch_size=4, sampler="without_replacement")
            ids = torch.cat([rb.sample()["trajectory_id"] for _ in range(3)])
            assert sorted(ids.tolist()) == list(range(12))  # ids of batch(0) are 0..11

    def test_replay_buffer_extends_a_tensordict_in_torchrl_keys(self, factory, location):
        with self.new_store(factory, location) as store:
            rb = make_replay_buffer(store)
            batch = self.batch(0)
            td = batch.to_tensordict()
            assert rb.extend(td).tolist() == list(range(6))
            assert store.read(torch.arange(6)).equal(batch)

    def test_replay_buffer_state_dict_round_trip_checks_the_rows(self, factory, location, tmp_path):
        with self.new_store(factory, location) as store:
            rb = make_replay_buffer(store, batch_size=2)
            rb.extend(self.batch(0))
            state = rb.state_dict()
            rb.extend(self.batch(1))
        with factory.open(location, "r") as reader:
            make_replay_buffer(reader, batch_size=2).load_state_dict(state)  # holds more rows: fine
        other = str(tmp_path / "smaller")
        with self.new_store(factory, other) as small:
            small.append(self.batch(0, n_groups=1))
            state["_storage"]["next_row"] = 6
            with pytest.raises(StoreCorruptedError, match="saved state saw 6"):
                make_replay_buffer(small).load_state_dict(state)

    def test_dumps_writes_a_snapshot_that_reopens_equal(self, factory, location, tmp_path):
        with self.new_store(factory, location) as store:
            rb = make_replay_buffer(store, batch_size=3)
            rb.extend(self.batch(0, n_groups=5))  # spans two segments
            rb.dumps(tmp_path / "checkpoint")
            rb.extend(self.batch(1))  # after the snapshot: not in it
            with open_store(tmp_path / "checkpoint" / "storage") as snapshot:
                assert snapshot.backend_name == store.backend_name
                assert len(snapshot) == 15
                assert snapshot.read(torch.arange(15)).equal(store.read(torch.arange(15)))

    # ------------------------------------------------------------------ stats and errors
    def test_stats_count_rows_groups_tokens_and_rewards(self, factory, location):
        with self.new_store(factory, location) as store:
            batches = [self.batch(0), self.batch(1, n_groups=3), self.batch(2)]
            for b in batches:
                store.append(b)
            everything = TrajectoryBatch.cat(batches)
            stats = store.stats()
            assert stats.backend == store.backend_name
            assert (stats.rows, stats.first_row, stats.next_row) == (21, 0, 21)
            assert stats.groups == 7
            assert stats.prompt_tokens == everything["prompt_tokens"].values.numel()
            assert stats.response_tokens == everything["response_tokens"].values.numel()
            reward = everything["reward"]
            assert stats.reward_mean == pytest.approx(float(reward.mean()), rel=1e-5)
            assert stats.reward_min == pytest.approx(float(reward.min()))
            assert stats.reward_max == pytest.approx(float(reward.max()))
            assert stats.policy_versions == {0: 6, 1: 9, 2: 6}
            # one definition of the raw payload for every backend: values, row fields, UTF-8 text
            assert stats.raw_bytes == raw_payload_bytes(everything)
            assert stats.segments >= 3
            # bytes on disk as du counts the store's directory
            du = subprocess.run(["du", "-s", "--block-size=1", location], capture_output=True, text=True, check=True)
            assert stats.bytes_on_disk == int(du.stdout.split()[0])
            assert stats.optional_fields == list(StoreSchema(self.optional).optional)
            assert stats.to_json()["disk_bytes_per_raw_byte"] == pytest.approx(stats.bytes_on_disk / stats.raw_bytes)

    def test_not_a_store_gives_a_clear_error(self, factory, tmp_path):
        empty = tmp_path / "empty"
        empty.mkdir()
        with pytest.raises(NotAStoreError, match="not a"):
            open_store(empty)
        with pytest.raises(NotAStoreError):
            factory.open(str(empty), "r")
        with pytest.raises(NotAStoreError):
            open_store(tmp_path / "missing")

    def test_missing_path_says_it_does_not_exist(self, factory, tmp_path):
        missing = tmp_path / "no" / "such" / "buffer"
        for mode in ("r", "a"):
            with pytest.raises(StoreNotFoundError, match="does not exist"):
                factory.open(str(missing), mode)
            with pytest.raises(StoreNotFoundError, match="does not exist"):
                open_store(missing, mode)
        assert not missing.parent.exists()  # nothing was created on the way

    def test_failed_open_for_append_leaves_the_directory_as_it_found_it(self, factory, tmp_path):
        empty = tmp_path / "empty"
        empty.mkdir()
        with pytest.raises(NotAStoreError):
            factory.open(str(empty), "a")
        assert list(empty.iterdir()) == []
        self.new_store(factory, str(empty)).close()  # nothing left in the way of a new store

    def test_closed_store_says_it_is_closed(self, factory, location):
        store = self.new_store(factory, location)
        store.append(self.batch(0))
        store.close()
        with pytest.raises(StoreClosedError, match="was closed"):
            store.append(self.batch(1))
        with pytest.raises(StoreClosedError, match="was closed"):
            store.read([0])
        with factory.open(location, "r") as reader:
            assert len(reader) == 6  # closing published nothing more and lost nothing

    def test_durable_is_the_default_everywhere(self, factory):
        import inspect

        from rlhf_pipeline.storage import backend_class

        cls = backend_class(self.backend)
        for method in (cls.create, cls.open):
            assert inspect.signature(method).parameters["durable"].default is True, method
