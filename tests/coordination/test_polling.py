"""PollBackoff: how often a wait on the other side of the pipeline polls."""

import threading
import time

import pytest

from rlhf_pipeline.learn.learner import Prefetcher
from rlhf_pipeline.coordination.polling import PollBackoff


def intervals(backoff: PollBackoff, sleeps: int) -> list[float]:
    seen = []
    for _ in range(sleeps):
        seen.append(backoff.next_s)
        backoff.sleep()
    return seen


def test_an_unhurried_wait_polls_fast_for_fast_s_then_doubles_up_to_the_longest_interval():
    backoff = PollBackoff(max_s=0.0004, first_s=0.0001, fast_s=0.0)
    assert intervals(backoff, 5) == [0.0001, 0.0002, 0.0004, 0.0004, 0.0004]
    backoff.reset()
    assert backoff.next_s == 0.0001

    patient = PollBackoff(max_s=0.0004, first_s=0.0001, fast_s=60.0)
    assert intervals(patient, 4) == [0.0001] * 4  # still within its first minute


def test_a_hurried_wait_wakes_at_once_and_polls_fast_again():
    hurry = threading.Event()
    backoff = PollBackoff(max_s=30.0, first_s=0.001, hurry=hurry)
    backoff.next_s = 30.0  # deep into a long wait
    threading.Timer(0.05, hurry.set).start()
    started = time.monotonic()
    backoff.sleep()
    assert time.monotonic() - started < 15.0  # woken by the event, not after the 30 s interval
    assert backoff.next_s == 0.001
    assert intervals(backoff, 3) == [0.001, 0.002, 0.004]


def test_the_longest_interval_must_be_positive():
    with pytest.raises(ValueError, match="longest poll interval"):
        PollBackoff(max_s=0)


def test_the_prefetcher_says_when_its_consumer_waits():
    release = threading.Event()
    seen_waiting = []

    def produce(step):
        if step == 1:  # the second item waits until the consumer is waiting for it
            seen_waiting.append(release.wait(30.0) and prefetcher.consumer_waiting.is_set())
        return step

    prefetcher = Prefetcher(produce, 0, depth=1)
    try:
        assert prefetcher.next()[:2] == (0, 0)
        threading.Timer(0.2, release.set).start()
        assert prefetcher.next()[:2] == (1, 1)
        assert seen_waiting == [True]
        assert not prefetcher.consumer_waiting.is_set()
    finally:
        prefetcher.close()
