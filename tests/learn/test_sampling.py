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


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_every_sampler_draws_with_the_largest_seed_a_run_takes(tmp_path, name):
    """Each draw seeds a generator from the run's seed and the draw's index; with the largest seed
    ``RunSettings.seed`` takes, that stays within the 64 bits torch's generators take (a larger seed
    is refused with the setting's name before any process starts: tests/test_settings.py)."""
    from rlhf_pipeline.schema import StoreSchema
    from rlhf_pipeline.setting_checks import SEEDS

    store = create_store(tmp_path / "buf", "memmap", schema=StoreSchema(optional=("advantage",)))
    store.append(make_batch(8, 4, optional=("advantage",)))
    reader = open_store(tmp_path / "buf")
    settings = LearnerSettings(sampler=name, batch_size=8, sample_window=8, new_rows_per_step=8, max_staleness=None)
    sampler = make_sampler(settings, reader, seed=int(SEEDS.lt) - 1, stop=threading.Event(), timeout_s=1.0)
    drawn = sampler.draw(0).positions.tolist()
    assert len(drawn) == 8 and set(drawn) <= set(range(len(reader)))
    reader.close()
    store.close()


@pytest.mark.parametrize("name", ["window", "exact", "groups", "prioritized"])
def test_a_sampler_waiting_for_rows_reads_them_before_its_readers_refresh_interval_is_up(tmp_path, name):
    """A reader at a URL re-reads the buffer at most once per ``refresh_interval_s`` (1 s) however often
    it is asked. A sampler waiting for rows asks it sooner (``RowsWait``), so rows published just after
    its wait began are drawn at once. Here a reader throttled to once an hour: the rows appended once
    the sampler waits are drawn long before that hour, which its 60 s data timeout would otherwise end
    in ``DataTimeoutError``."""
    from rlhf_pipeline.schema import StoreSchema

    store = create_store(tmp_path / "buf", "zarr", schema=StoreSchema(optional=("advantage",)))
    reader = open_store(tmp_path / "buf", mode="r", refresh_interval_s=3600.0)
    assert len(reader) == 0  # read now: the throttle holds the next read off for an hour
    settings = LearnerSettings(sampler=name, batch_size=8, sample_window=8, new_rows_per_step=8,
                               max_staleness=None)
    sampler = make_sampler(settings, reader, seed=3, stop=threading.Event(), timeout_s=60.0)
    appended = threading.Timer(0.2, lambda: store.append(make_batch(2, 4, seed=2, optional=("advantage",))))
    appended.start()
    try:
        drawn = sampler.draw(0)
    finally:
        appended.join()
    assert drawn.buffer_rows == 8 and set(drawn.positions.tolist()) <= set(range(8))
    reader.close()
    store.close()


def test_a_wait_for_rows_rereads_a_throttled_buffer_every_50_ms_in_its_first_second_then_backs_off(tmp_path,
                                                                                                    monkeypatch):
    """A reader at a URL throttles its refreshes (one GET a second, here one an hour); a sampler waiting
    for rows re-reads sooner. Its gaps doubled from the first (50, 100, 200 ms), so a round written 60 ms
    into a wait was seen at 150 ms: at an s3:// URL the default pipeline's learner waited 0.14 s a step.
    Now every 50 ms for the first second, then doubling up to the throttle. On a clock of this test's own,
    one poll every 10 ms for 3 s."""
    from types import SimpleNamespace

    from rlhf_pipeline.learn.samplers import contract
    from rlhf_pipeline.learn.samplers.contract import WAITING_REFRESH_FAST_S, WAITING_REFRESH_FIRST_S, RowsWait
    from rlhf_pipeline.schema import StoreSchema

    store = create_store(tmp_path / "buf", "zarr", schema=StoreSchema())
    reader = open_store(tmp_path / "buf", mode="r", refresh_interval_s=3600.0)
    now = [1000.0]
    monkeypatch.setattr(contract, "time", SimpleNamespace(monotonic=lambda: now[0]))
    refreshed_at, refresh = [], reader.refresh
    def counted(force=False):  # a re-read asked for; len() asks the reader's own throttle (an hour) too
        if force:
            refreshed_at.append(now[0] - 1000.0)
        return refresh(force=force)

    monkeypatch.setattr(reader, "refresh", counted)
    wait = RowsWait(reader, poll_s=0.01, hurry=None)
    while now[0] < 1003.0:
        wait.rows()
        now[0] += 0.01
    first_second = [t for t in refreshed_at if t < WAITING_REFRESH_FAST_S]
    # every 50 ms, as polls every 10 ms can see it (the gaps that doubled made 4 re-reads there)
    assert len(first_second) >= 0.75 * WAITING_REFRESH_FAST_S / WAITING_REFRESH_FIRST_S, refreshed_at
    after = [t for t in refreshed_at if t >= WAITING_REFRESH_FAST_S]
    gaps = [round(b - a, 2) for a, b in zip(after, after[1:])]
    assert gaps == sorted(gaps) and len(after) <= 5, refreshed_at  # then 0.1, 0.2, 0.4, 0.8 s
    reader.close()
    store.close()
