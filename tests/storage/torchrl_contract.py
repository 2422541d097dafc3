"""The torchrl part of the storage contract: writers, item access, counters and priorities.

A mixin of :class:`contract.StoreContractTests`, so every backend runs it. Positions are
logical: position ``p`` is the ``p``-th row of the live window, global row ``first_row + p``;
what ``extend`` returns must read back (``rb[p]``, ``store.read(p)``) as the rows written,
on a store that already held rows and after eviction.
"""

from __future__ import annotations

import pytest
import torch
from torchrl.data import ReplayBuffer, TensorDictReplayBuffer
from torchrl.data.replay_buffers.writers import (
    RoundRobinWriter,
    TensorDictMaxValueWriter,
    TensorDictRoundRobinWriter,
)

from rlhf_pipeline.schema import TrajectoryBatch
from rlhf_pipeline.storage.prioritized import PrioritizedSampler
from rlhf_pipeline.storage.torchrl_glue import AppendWriter


def _ids(rows: TrajectoryBatch) -> list[int]:
    return rows["trajectory_id"].tolist()


def _keep_rows(rows):
    return rows


class TorchRLContractTests:
    """Needs ``new_store(factory, location, **options)``, ``batch(i, ...)`` and ``segment_rows``."""

    # ------------------------------------------------------------------ writers
    @pytest.mark.parametrize("writer", [RoundRobinWriter(), TensorDictRoundRobinWriter(), RoundRobinWriter,
                                        lambda: TensorDictMaxValueWriter(rank_key="reward")],
                             ids=["round_robin", "tensordict_round_robin", "a_writer_class", "max_value_factory"])
    @pytest.mark.parametrize("buffer_class", [ReplayBuffer, TensorDictReplayBuffer])
    def test_writers_that_choose_positions_are_refused_at_construction(self, factory, location, writer,
                                                                       buffer_class):
        with self.new_store(factory, location) as store:
            store.append(self.batch(0))
            with pytest.raises(TypeError, match="AppendWriter"):
                buffer_class(storage=store, writer=writer)
            assert store.next_row == 6 and _ids(store.read(torch.arange(6))) == _ids(self.batch(0))

    def test_a_writer_set_later_fails_at_its_first_write_storing_nothing(self, factory, location):
        with self.new_store(factory, location) as store:
            store.append(self.batch(0))
            rb = ReplayBuffer(storage=store, collate_fn=_keep_rows)
            rb.set_writer(RoundRobinWriter())
            with pytest.raises(TypeError, match="AppendWriter"):
                rb.extend(self.batch(1))
            with pytest.raises(NotImplementedError, match="append-only"):
                ReplayBuffer(storage=store).empty()
            assert store.next_row == 6

    @pytest.mark.parametrize("buffer_class", [ReplayBuffer, TensorDictReplayBuffer])
    def test_extend_returns_the_positions_rows_landed_at_on_a_filled_store_and_after_eviction(
            self, factory, location, buffer_class):
        seg = self.segment_rows
        with self.new_store(factory, location, capacity_rows=2 * seg) as store:
            store.append(self.batch(0, n_groups=2, group_size=5))  # 10 rows before the buffer exists
            rb = buffer_class(storage=store, collate_fn=_keep_rows)
            assert isinstance(rb.writer, AppendWriter)
            for i in range(1, 8):
                written = self.batch(i, n_groups=1, group_size=4)
                data = written.to_tensordict() if buffer_class is TensorDictReplayBuffer else written
                index = rb.extend(data)
                assert _ids(store.read(index)) == _ids(written)
                assert _ids(rb[index]) == _ids(written)
                assert (index + store.first_row).tolist() == list(range(store.next_row - 4, store.next_row))
            assert store.first_row > 0  # rows were evicted: positions are not global row ids

    @pytest.mark.parametrize("buffer_class", [ReplayBuffer, TensorDictReplayBuffer])
    def test_add_one_row_as_a_trajectory_or_a_0_dim_tensordict(self, factory, location, buffer_class):
        with self.new_store(factory, location) as store:
            store.append(self.batch(0))
            rb = buffer_class(storage=store, collate_fn=_keep_rows)
            rows = self.batch(1, n_groups=1, group_size=2)
            one_td = rows.to_tensordict()[0]
            assert one_td.batch_dims == 0
            assert rb.add(one_td) == 6
            if buffer_class is ReplayBuffer:  # TensorDictReplayBuffer takes TensorDicts only
                assert rb.add(rows.row(1)) == 7
                assert _ids(store.read([6, 7])) == _ids(rows)
            else:
                assert _ids(store.read([6])) == _ids(rows)[:1]

    # ------------------------------------------------------------------ item access
    def test_item_assignment_is_refused_and_changes_nothing(self, factory, location):
        with self.new_store(factory, location) as store:
            store.append(self.batch(0, n_groups=2, group_size=5))
            rb = ReplayBuffer(storage=store, collate_fn=_keep_rows)
            before = _ids(store.read(torch.arange(10)))
            with pytest.raises(TypeError, match="append-only"):
                rb[3] = self.batch(1, n_groups=1, group_size=1)
            with pytest.raises(TypeError, match="append-only"):
                rb[torch.tensor([3, 4])] = self.batch(1, n_groups=1, group_size=2).to_tensordict()
            assert len(rb) == 10 and _ids(store.read(torch.arange(10))) == before

    def test_slices_negative_positions_and_field_names_read_as_a_python_sequence(self, factory, location):
        with self.new_store(factory, location) as store:
            everything = self.batch(0, n_groups=2, group_size=5)
            store.append(everything)
            rb = ReplayBuffer(storage=store, collate_fn=_keep_rows)
            ids = _ids(everything)
            assert _ids(rb[2:5]) == ids[2:5]
            assert _ids(rb[:]) == ids
            assert _ids(rb[-3:]) == ids[-3:]
            assert _ids(rb[::-2]) == ids[::-2]
            assert _ids(rb[-1]) == ids[-1:]
            assert _ids(rb[torch.tensor([-1, 0, -10])]) == [ids[-1], ids[0], ids[0]]
            assert rb["trajectory_id"].tolist() == ids
            with pytest.raises(IndexError, match="out of range"):
                rb[10]
            with pytest.raises(IndexError, match="out of range"):
                rb[-11]

    # ------------------------------------------------------------------ counters
    @pytest.mark.parametrize("buffer_class", [ReplayBuffer, TensorDictReplayBuffer])
    def test_write_count_and_stats_count_the_rows_written(self, factory, location, buffer_class):
        with self.new_store(factory, location) as store:
            rb = buffer_class(storage=store, collate_fn=_keep_rows)
            assert rb.write_count == 0
            rb.extend(self.batch(0).to_tensordict())
            rb.extend(self.batch(1).to_tensordict())
            assert rb.write_count == 12
            stats = rb.stats()
            assert stats["write_count"] == 12 and stats["size"] == 12

    # ------------------------------------------------------------------ priorities
    def _dominant_share(self, rb, trajectory_id: int, draws: int = 4) -> float:
        hits = [rb.sample(64)["trajectory_id"] == trajectory_id for _ in range(draws)]
        return float(torch.cat(hits).float().mean())

    def test_rows_just_extended_take_a_priority_at_once(self, factory, location):
        with self.new_store(factory, location) as store:
            store.append(self.batch(0, n_groups=2, group_size=5))
            rb = ReplayBuffer(storage=store, sampler=PrioritizedSampler(), batch_size=64, collate_fn=_keep_rows)
            rb.sample()  # the sampler has seen 10 rows
            written = self.batch(1, n_groups=1, group_size=2)
            index = rb.extend(written)
            rb.update_priority(index, torch.tensor([1e6, 0.0]))
            assert self._dominant_share(rb, _ids(written)[0]) > 0.95

    def test_tensordict_buffer_takes_priorities_from_the_extended_rows(self, factory, location):
        with self.new_store(factory, location) as store:
            store.append(self.batch(0, n_groups=2, group_size=5))
            rb = TensorDictReplayBuffer(storage=store, sampler=PrioritizedSampler(), batch_size=64,
                                        priority_key="td_error")
            rb.sample()
            written = self.batch(1, n_groups=1, group_size=2)
            data = written.to_tensordict()
            data["td_error"] = torch.tensor([1e6, 0.0])
            index = rb.extend(data)
            assert _ids(store.read(index)) == _ids(written)
            assert self._dominant_share(rb, _ids(written)[0]) > 0.95

    def test_update_tensordict_priority_sets_the_sampled_rows_priorities(self, factory, location):
        with self.new_store(factory, location) as store:
            store.append(self.batch(0, n_groups=2, group_size=5))
            rb = TensorDictReplayBuffer(storage=store, sampler=PrioritizedSampler(), batch_size=8,
                                        priority_key="td_error")
            sample = rb.sample()
            chosen = sample["index"] == sample["index"][0]  # a row drawn twice takes its last value
            sample["td_error"] = torch.where(chosen, 1e6, 0.0)
            rb.update_tensordict_priority(sample)
            assert self._dominant_share(rb, int(sample["trajectory_id"][0])) > 0.95

    def test_positions_made_ambiguous_by_eviction_are_refused(self, factory, location):
        seg = self.segment_rows
        with self.new_store(factory, location, capacity_rows=2 * seg) as store:
            store.append(self.batch(0, n_groups=2, group_size=seg))  # full
            rb = ReplayBuffer(storage=store, sampler=PrioritizedSampler(), batch_size=4, collate_fn=_keep_rows)
            _, info = rb.sample(return_info=True)
            sampler = rb.sampler
            parts, rows = sampler.keys_of(info["index"])
            rb.extend(self.batch(1, n_groups=1, group_size=2))  # evicts a segment: positions shift
            assert store.first_row == seg
            with pytest.raises(ValueError, match="keys_of"):
                rb.update_priority(info["index"], torch.ones(4))
            sampler.update_priority_by_key(parts, rows, torch.ones(4))  # the way the message names
