import pytest
import torch

from rlhf_pipeline.schema.ids import ID_COUNTER_BITS, MAX_COLLECTORS, collector_index_of, id_base


def test_collector_index_round_trips_through_ids():
    counters = torch.tensor([0, 1, 2**ID_COUNTER_BITS - 1])
    for index in (0, 1, 7, MAX_COLLECTORS - 1):
        ids = id_base(index) + counters
        assert bool((ids >= 0).all()), "ids must stay non-negative int64"
        assert collector_index_of(ids).tolist() == [index] * 3


@pytest.mark.parametrize("index", [-1, MAX_COLLECTORS])
def test_out_of_range_collector_index_is_rejected(index):
    with pytest.raises(ValueError, match="collector index"):
        id_base(index)
