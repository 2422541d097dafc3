"""Outages of an object store: connections refused (or reset) for a set time by a TCP proxy in front
of moto's S3 server and Azurite (``tests/outage_proxy.py``). A refused connection fails in about a
millisecond, so retries counted in tries were spent within a second of an outage (8 tries in 7.6 s
stopped a run over a 10 s outage, with a 60 s budget). An outage is retried for the budget's time,
however many tries that takes; a fault the store answers is still retried a counted number of times.
"""

from __future__ import annotations

import re

import pytest
import torch

from helpers import make_batch
from outage_proxy import OutageProxy
from rlhf_pipeline.files.object_run_store import ObjectRunStore, RetryPolicy
from rlhf_pipeline.files.run_store import RunStoreError
from rlhf_pipeline.storage import create_store, open_store

# one answered fault at most: were an unanswered try counted, the first refused connection would end
# the request, so any second try shows the outage was retried for a time (however slow a loaded
# machine makes each try, which a count of tries above 1 would not survive)
ONE_FAULT = RetryPolicy(attempts=1, first_delay_s=0.05, max_delay_s=0.5, budget_s=30.0)
OUTAGE_S = 1.0


@pytest.fixture(params=["s3", "az"])
def cloud(request):
    """``(url, storage_options through the proxy, storage_options straight to the server, proxy)``."""
    server = request.getfixturevalue("s3_server" if request.param == "s3" else "azure_server")
    proxy = OutageProxy(server.endpoint)
    if request.param == "s3":
        through = {**server.options, "endpoint_url": proxy.endpoint}
    else:
        from azurite_server import connection_string

        through = {"connection_string": connection_string(proxy.endpoint)}
    yield server.url("run"), through, server.options, proxy
    proxy.stop()


@pytest.mark.parametrize("outage", ["refuse", "reset"])
def test_the_run_store_rides_out_an_outage_shorter_than_its_budget(cloud, outage):
    url, through, direct, proxy = cloud
    store = ObjectRunStore(url, storage_options=through, retry=ONE_FAULT)
    store.write("pacing.json", b"before the outage")
    sent = store.requests
    getattr(proxy, f"{outage}_for")(OUTAGE_S)
    store.write("pacing.json", b"written through the outage")
    assert ObjectRunStore(url, storage_options=direct).read("pacing.json") == b"written through the outage"
    # more tries than the faults it would take from a store that answers: the outage was retried for a time
    assert store.requests - sent > ONE_FAULT.attempts


def test_an_outage_past_the_budget_gives_up_naming_the_time_not_a_count(cloud):
    url, through, _, proxy = cloud
    policy = RetryPolicy(attempts=1, first_delay_s=0.01, max_delay_s=0.05, budget_s=1.0)
    store = ObjectRunStore(url, storage_options=through, retry=policy)
    # the client is built by the first request (2.9 s on a loaded CI machine): were that request in the
    # outage, its one try could spend the whole budget and say nothing of how an outage is retried
    store.write("warm.json", b"before the outage")
    proxy.refuse_for(30.0)
    with pytest.raises(RunStoreError, match=r"pacing.json: PUT \(create\) gave up after \d+ tries in \d+\.\d s "
                                            r"\(retry budget: .*1 s in all\); last error") as caught:
        store.create("pacing.json", b"never written")
    assert int(re.search(r"after (\d+) tries", str(caught.value)).group(1)) > policy.attempts
    # at least the budget's time (a loaded machine's last try may end well past it)
    assert float(re.search(r"tries in (\d+\.\d) s", str(caught.value)).group(1)) >= policy.budget_s


def test_a_buffer_append_and_a_refresh_ride_out_an_outage(s3_server):
    """A collector's append and a learner's refresh at an ``s3://`` URL. The client's own retries
    are cut to one try, so what rides the outage out is the store's retrying for a time: botocore's
    default (five tries, backoff from ~1 s) gave up after 2.5 to 5.4 s of refused connections."""
    proxy = OutageProxy(s3_server.endpoint)
    options = {**s3_server.options, "endpoint_url": proxy.endpoint,
               "config_kwargs": {"retries": {"total_max_attempts": 1}}}
    url = s3_server.url("buffer")
    first = make_batch(4, 4, seed=0)
    second = make_batch(4, 4, seed=1, first_group_id=4, first_trajectory_id=16)
    try:
        with create_store(url, "zarr", storage_options=options) as writer:
            writer.append(first)
            reader = open_store(url, storage_options=options, refresh_interval_s=0)
            proxy.refuse_for(OUTAGE_S)
            writer.append(second)  # the unit's PUTs and the record's, through the outage
            proxy.refuse_for(OUTAGE_S)
            assert reader.refresh() == 32  # the record's GET, through the outage
            assert reader.read(torch.arange(32)).equal(type(first).cat([first, second]))
            reader.close()
    finally:
        proxy.stop()
    assert proxy.refused == 2


def test_a_writer_whose_lock_create_was_retried_after_its_answer_was_lost_holds_the_lock(s3_server):
    """Retries re-send a create that may have landed: the lock object found then is this writer's own
    (its token), not another writer's to be refused by (before, a writer refused itself, naming its
    own pid). A 503 instead of the answer (``tests/s3_faults.py``), which botocore retries."""
    from s3_faults import FaultyProxy

    proxy = FaultyProxy(s3_server.endpoint)
    url = s3_server.url("buffer")
    try:
        proxy.lose_answer("PUT", 1)  # the first PUT of a new store: its writer.lock
        with create_store(url, "zarr", storage_options={**s3_server.options, "endpoint_url": proxy.endpoint}) as w:
            w.append(make_batch(2, 2, seed=0))
    finally:
        proxy.stop()
    assert 412 in proxy.statuses()  # the retry met the lock its first try created
    with open_store(url, storage_options=s3_server.options) as reader:
        assert len(reader) == 4
