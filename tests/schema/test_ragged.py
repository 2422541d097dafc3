"""RaggedTensor and gather_ranges against plain Python lists, including property-based checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_pipeline.schema.ragged import RaggedTensor, gather_ranges, lengths_to_offsets

sequences = st.lists(st.lists(st.integers(-1000, 1000), max_size=6), min_size=1, max_size=8)


def as_lists(ragged: RaggedTensor) -> list[list[int]]:
    return [row.tolist() for row in ragged.to_list()]


@settings(max_examples=60, deadline=None, database=None)
@given(rows=sequences, data=st.data())
def test_index_matches_python_list_indexing(rows, data):
    ragged = RaggedTensor.from_sequences(rows, dtype=torch.int64)
    idx = data.draw(st.lists(st.integers(0, len(rows) - 1), max_size=10))
    picked = ragged.index(torch.tensor(idx, dtype=torch.int64))
    assert as_lists(picked) == [rows[i] for i in idx]
    assert picked.offsets[0] == 0 and picked.offsets[-1] == picked.values.numel()


@settings(max_examples=60, deadline=None, database=None)
@given(rows=sequences, side=st.sampled_from(["left", "right"]))
def test_to_padded_and_back(rows, side):
    ragged = RaggedTensor.from_sequences(rows, dtype=torch.int64)
    padded, mask = ragged.to_padded(pad_value=-7, side=side)
    width = max(len(r) for r in rows)
    assert padded.shape == mask.shape == (len(rows), width)
    for i, row in enumerate(rows):
        expect = [-7] * (width - len(row)) + row if side == "left" else row + [-7] * (width - len(row))
        assert padded[i].tolist() == expect
        assert int(mask[i].sum()) == len(row)
    if side == "right":
        assert as_lists(RaggedTensor.from_padded(padded, mask)) == rows


@settings(max_examples=60, deadline=None, database=None)
@given(ranges=st.lists(st.tuples(st.integers(0, 50), st.integers(0, 5)), max_size=10))
def test_gather_ranges_is_concatenated_aranges(ranges):
    starts = torch.tensor([s for s, _ in ranges], dtype=torch.int64)
    lengths = torch.tensor([n for _, n in ranges], dtype=torch.int64)
    expected = [p for s, n in ranges for p in range(s, s + n)]
    assert gather_ranges(starts, lengths).tolist() == expected


def test_cat_select_and_lengths():
    a = RaggedTensor.from_sequences([[1, 2], [], [3]], dtype=torch.int32)
    b = RaggedTensor.from_sequences([[4, 5, 6]], dtype=torch.int32)
    both = RaggedTensor.cat([a, b])
    assert as_lists(both) == [[1, 2], [], [3], [4, 5, 6]]
    assert both.lengths().tolist() == [2, 0, 1, 3]
    assert both.dtype == torch.int32
    assert as_lists(both.index(slice(1, None, 2))) == [[], [4, 5, 6]]
    assert lengths_to_offsets(torch.tensor([2, 0, 1])).tolist() == [0, 2, 2, 3]


def test_invalid_construction_and_padding_length_are_refused():
    with pytest.raises(ValueError, match="values must be 1-D"):
        RaggedTensor(torch.zeros(2, 2), torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="int64"):
        RaggedTensor(torch.zeros(4), torch.tensor([0, 4], dtype=torch.int32))
    ragged = RaggedTensor.from_sequences([[1, 2, 3]])
    with pytest.raises(ValueError, match="shorter than the longest row"):
        ragged.to_padded(length=2)
    with pytest.raises(ValueError, match="side"):
        ragged.to_padded(side="middle")
