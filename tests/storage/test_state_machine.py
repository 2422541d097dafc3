"""Each backend against a plain Python model, through random sequences of operations.

The model is the list of every row ever appended plus the first row still held, and the last
writer state an append published.
Eviction in the model is the contract's rule: the smallest multiple of
``segment_rows`` that brings the rows held to at most ``capacity_rows``.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from backends import BACKENDS
from helpers import assert_same_padded, make_batch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rlhf_pipeline.schema.padding import pad_batch
from rlhf_pipeline.schema import StoreSchema, TrajectoryBatch

SEGMENT_ROWS = 4
OPTIONAL = ("advantage", "kl")


def make_machine(backend_name: str) -> type[RuleBasedStateMachine]:
    class StoreMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.tmp = Path(tempfile.mkdtemp(prefix="store-machine-"))
            self.path = str(self.tmp / "buffer")
            self.backend = BACKENDS[backend_name]
            self.capacity = None
            self.store = None
            self.reader = None
            self.rows: list[TrajectoryBatch] = []  # one batch per append, in order
            self.first_row = 0
            self.appends = 0
            self.writer_state = None  # the last one an append published

        # ------------------------------------------------------------ model
        def model_rows(self) -> TrajectoryBatch:
            return TrajectoryBatch.cat(self.rows)

        @property
        def next_row(self) -> int:
            return sum(len(b) for b in self.rows)

        # ------------------------------------------------------------ rules
        @precondition(lambda self: self.store is None)
        @rule(capacity_segments=st.one_of(st.none(), st.integers(1, 4)))
        def create(self, capacity_segments):
            self.capacity = None if capacity_segments is None else capacity_segments * SEGMENT_ROWS
            self.store = self.backend.create(
                self.path, StoreSchema(OPTIONAL), segment_rows=SEGMENT_ROWS, capacity_rows=self.capacity
            )
            self.reader = self.backend.open(self.path, "r")

        @precondition(lambda self: self.store is not None)
        @rule(n_groups=st.integers(1, 3), group_size=st.integers(1, 3), with_state=st.booleans())
        def append(self, n_groups, group_size, with_state):
            self.appends += 1
            batch = make_batch(
                n_groups, group_size, seed=self.appends, optional=OPTIONAL,
                first_group_id=10 * self.appends, first_trajectory_id=self.next_row,
            )
            start = self.next_row
            state = f"after append {self.appends}".encode() if with_state else None
            positions = self.store.append(batch, writer_state=state)
            self.rows.append(batch)
            self.writer_state = state if with_state else self.writer_state
            if self.capacity is not None and self.next_row - self.first_row > self.capacity:
                over = self.next_row - self.capacity
                self.first_row = -(-over // SEGMENT_ROWS) * SEGMENT_ROWS
            assert positions.tolist() == list(range(start - self.first_row, self.next_row - self.first_row))

        @precondition(lambda self: self.store is not None)
        @rule()
        def publish_writer_state_alone(self):
            self.appends += 1
            self.writer_state = f"no rows at {self.appends}".encode()
            assert self.store.append(None, writer_state=self.writer_state).tolist() == []

        @precondition(lambda self: self.store is not None and self.next_row > 0)
        @rule(data=st.data())
        def read_random_positions(self, data):
            held = self.next_row - self.first_row
            positions = data.draw(st.lists(st.integers(0, held - 1), min_size=1, max_size=8))
            expected = self.model_rows().select(torch.tensor(positions) + self.first_row)
            assert self.store.read(positions).equal(expected)

        @precondition(lambda self: self.store is not None and self.next_row > 0)
        @rule(data=st.data(), pad_token_id=st.sampled_from([0, 7]))
        def padded_reads_match_the_model(self, data, pad_token_id):
            """The fused read_padded of the writer and of a long-lived reader (row index kept
            across appends, seals, evictions and reopens) equals pad_batch of the model's rows."""
            held = self.reader.refresh()
            positions = data.draw(st.lists(st.integers(0, held - 1), min_size=1, max_size=8))
            rows = self.model_rows().select(torch.tensor(positions) + self.first_row)
            expected = pad_batch(rows, pad_token_id=pad_token_id)
            for handle in (self.store, self.reader):
                assert_same_padded(handle.read_padded(positions, pad_token_id=pad_token_id), expected)

        @precondition(lambda self: self.store is not None)
        @rule()
        def close_and_reopen(self):
            self.store.close()
            self.store = self.backend.open(self.path, "a")

        @precondition(lambda self: self.store is not None and self.next_row > 0)
        @rule(data=st.data())
        def reader_refreshes_and_compares(self, data):
            held = self.reader.refresh()
            assert (held, self.reader.first_row) == (self.next_row - self.first_row, self.first_row)
            assert self.reader.writer_state == self.writer_state
            positions = data.draw(st.lists(st.integers(0, held - 1), min_size=1, max_size=8))
            expected = self.model_rows().select(torch.tensor(positions) + self.first_row)
            assert self.reader.read(positions).equal(expected)

        @precondition(lambda self: self.store is not None and self.next_row > 0)
        @rule()
        def new_reader_sees_everything_held(self):
            with self.backend.open(self.path, "r") as fresh:
                held = torch.arange(self.first_row, self.next_row)
                assert fresh.read(torch.arange(len(fresh))).equal(self.model_rows().select(held))

        # ------------------------------------------------------------ invariants
        @invariant()
        def lengths_match_the_model(self):
            if self.store is not None:
                assert (self.store.first_row, self.store.next_row) == (self.first_row, self.next_row)
                assert len(self.store) == self.next_row - self.first_row
                assert self.store.writer_state == self.writer_state
                if self.capacity is not None:
                    assert len(self.store) <= max(self.capacity, SEGMENT_ROWS)

        def teardown(self):
            for handle in (self.reader, self.store):
                if handle is not None:
                    handle.close()
            shutil.rmtree(self.tmp, ignore_errors=True)

    StoreMachine.__name__ = f"{backend_name.title()}StoreMachine"
    return StoreMachine


_SETTINGS = settings(
    max_examples=12, stateful_step_count=14, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
for _name in BACKENDS:
    _machine = make_machine(_name)
    _machine.TestCase.settings = _SETTINGS
    globals()[f"Test{_name.title()}StateMachine"] = _machine.TestCase
