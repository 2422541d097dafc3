import threading

import pytest

from rlhf_pipeline.learn.settings import LearnerSettings
from rlhf_pipeline.learn.samplers import SAMPLERS, make_sampler
from rlhf_pipeline.learn.samplers.window import FreshRowSampler
from rlhf_pipeline.storage import create_store, open_store
from tests.helpers import make_batch


def test_unknown_sampler_is_named_with_the_choices():
    with pytest.raises(ValueError, match=r"'learner.sampler' must be one of \[.*'window'.*\], got 'nope'"):
        LearnerSettings(sampler="nope")


def test_make_sampler_builds_the_named_sampler_from_the_settings(tmp_path):
    assert "window" in SAMPLERS
    store = create_store(tmp_path / "buf", "memmap")
    store.append(make_batch(8, 4))
    reader = open_store(tmp_path / "buf")
    settings = LearnerSettings(batch_size=8, sample_window=16, new_rows_per_step=4, max_staleness=None)
    sampler = make_sampler(settings, reader, seed=3, stop=threading.Event(), timeout_s=1.0)
    assert isinstance(sampler, FreshRowSampler)
    first = sampler.draw(0)
    # the state carried by a draw is the state right after it: what a checkpoint must resume from
    assert first.sampler_state == sampler.state_dict() == {"min_next_row": 36}
    again = make_sampler(settings, reader, seed=3, stop=threading.Event(), timeout_s=1.0)
    assert again.draw(0).positions.tolist() == first.positions.tolist()
    reader.close()
    store.close()
