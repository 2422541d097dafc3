"""The shared server's weights lease (``generation/vllm_lease.py``): the table itself, on a clock the
test moves. The real server with two collectors is ``tests/integration/test_vllm_url_collectors.py``."""

from __future__ import annotations

import pytest

from rlhf_pipeline.generation.vllm_lease import WeightsLeases

TTL = 10.0


def _load(leases: WeightsLeases, holder: str, key: str, version: int, now: float) -> dict:
    """What a round told to load does: its upload (the worker's ``loaded``), then ``ready``."""
    leases.loaded(holder, key, version)
    return leases.mark_ready(holder, now)


def test_the_first_round_loads_and_rounds_on_the_held_weights_join_it():
    leases = WeightsLeases()
    assert leases.acquire("a1", "k7", 7, TTL, now=0)["state"] == "loading"
    assert leases.acquire("b1", "k7", 7, TTL, now=0)["state"] == "waiting"  # not before the cache is reset
    granted = _load(leases, "a1", "k7", 7, now=1)
    assert granted["state"] == "granted" and granted["epoch"] == 1
    assert leases.acquire("b1", "k7", 7, TTL, now=1)["state"] == "granted"  # joined: no second load
    assert leases.call({"op": "describe"}, now=1)["rounds_in_flight"] == 2


def test_newer_weights_wait_for_the_held_ones_to_drain_and_later_joiners_queue_behind():
    leases = WeightsLeases()
    leases.acquire("a1", "k7", 7, TTL, now=0)
    _load(leases, "a1", "k7", 7, now=0)
    assert leases.acquire("b1", "k8", 8, TTL, now=1)["state"] == "waiting"  # a1 still samples on k7
    # a1's collector asks again for k7 after b1 asked for k8: first come, first served, so it waits
    assert leases.acquire("a2", "k7", 7, TTL, now=2)["state"] == "waiting"
    leases.release("a1", now=3)
    assert leases.acquire("a2", "k7", 7, TTL, now=3)["state"] == "waiting"
    assert leases.acquire("b1", "k8", 8, TTL, now=3)["state"] == "loading"
    assert _load(leases, "b1", "k8", 8, now=4)["epoch"] == 2
    leases.release("b1", now=5)
    # an older version than held: loaded again (a lagging or resumed collector's rows need its weights)
    assert leases.acquire("a2", "k7", 7, TTL, now=5)["state"] == "loading"
    assert _load(leases, "a2", "k7", 7, now=5)["state"] == "granted" and leases.held_version == 7


def test_ready_grants_every_waiting_round_on_the_loaded_weights_up_to_one_waiting_for_others():
    leases = WeightsLeases()
    for holder, key in (("a", "k1"), ("b", "k1"), ("c", "k2"), ("d", "k1")):
        leases.acquire(holder, key, int(key[1]), TTL, now=0)
    _load(leases, "a", "k1", 1, now=0)
    assert [leases.tickets[h].state for h in "abcd"] == ["granted", "granted", "waiting", "waiting"]


def test_a_collector_killed_mid_round_holds_the_others_up_for_its_lease_only():
    leases = WeightsLeases()
    leases.acquire("dead", "k1", 1, TTL, now=0)
    _load(leases, "dead", "k1", 1, now=0)
    assert leases.renew("dead", TTL, now=5)["state"] == "granted"  # renewed while its round ran
    assert leases.acquire("alive", "k2", 2, TTL, now=6)["state"] == "waiting"
    assert leases.acquire("alive", "k2", 2, TTL, now=15)["state"] == "waiting"  # 5 + TTL not yet past
    assert leases.acquire("alive", "k2", 2, TTL, now=15.5)["state"] == "loading"
    assert leases.renew("dead", TTL, now=16)["state"] == "lost"


def test_a_loader_that_dies_before_ready_makes_the_next_round_load_again():
    leases = WeightsLeases()
    leases.acquire("dies", "k1", 1, TTL, now=0)
    leases.loaded("dies", "k1", 1)  # loaded, prefix cache maybe not reset
    assert leases.acquire("next", "k1", 1, TTL, now=1)["state"] == "waiting"
    assert leases.acquire("next", "k1", 1, TTL, now=11)["state"] == "loading"
    assert leases.held_key is None


def test_a_failed_load_given_up_leaves_no_weights_held():
    leases = WeightsLeases()
    leases.acquire("a", "k1", 1, TTL, now=0)
    _load(leases, "a", "k1", 1, now=0)
    leases.release("a", now=1)
    assert leases.acquire("b", "k2", 2, TTL, now=1)["state"] == "loading"
    leases.release("b", now=2)  # its upload failed (a file the server cannot read)
    assert leases.held_key is None and leases.acquire("c", "k1", 1, TTL, now=2)["state"] == "loading"


def test_every_load_moves_the_epoch_a_round_checks_its_replies_against():
    leases = WeightsLeases()
    leases.acquire("a", "k1", 1, TTL, now=0)
    epoch = _load(leases, "a", "k1", 1, now=0)["epoch"]
    leases.loaded(None, None, None)  # a load outside any lease (an old client): ready, unknown weights
    assert leases.renew("a", TTL, now=1)["epoch"] == epoch + 1
    assert leases.acquire("b", "k1", 1, TTL, now=1)["state"] == "waiting"  # not the weights it needs


def test_one_round_asks_for_one_set_of_weights_and_unknown_operations_are_named():
    leases = WeightsLeases()
    leases.acquire("a", "k1", 1, TTL, now=0)
    with pytest.raises(ValueError, match="one round, one set of weights"):
        leases.acquire("a", "k2", 2, TTL, now=0)
    with pytest.raises(ValueError, match="unknown lease operation 'grab'"):
        leases.call({"op": "grab"}, now=0)
    assert leases.mark_ready("a", now=0)["refused"]


def test_an_upload_longer_than_the_lease_does_not_expire_its_loader():
    leases = WeightsLeases()
    leases.acquire("slow", "k1", 1, TTL, now=0)
    # the server answers one call at a time: the loader's renewals wait until its 30 s upload ends
    leases.loaded("slow", "k1", 1, ttl_s=TTL, now=30)
    assert leases.renew("slow", TTL, now=30.5)["state"] == "loading"
    assert leases.mark_ready("slow", now=31)["state"] == "granted"
