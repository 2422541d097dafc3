"""The learner's publishes of ``weights/`` (``publish_weights``) with its own listing of it, kept up to
date by each publish in place of a LIST request each time: the same versions published and pruned; and
a publish onto a full disk."""

import errno

import pytest
import torch
from helpers import fill

from rlhf_pipeline.coordination.weights import WEIGHTS, load_weights, publish_weights, published_versions
from rlhf_pipeline.files.run_store import LocalRunStore


def state(version: int) -> dict[str, torch.Tensor]:
    return {"weight": torch.full((2, 2), float(version))}


def test_publishes_with_the_learners_own_listing_leave_what_listing_each_time_leaves(tmp_path):
    listed_each_time, own_listing = LocalRunStore(tmp_path / "a"), LocalRunStore(tmp_path / "b")
    for store in (listed_each_time, own_listing):  # an older run's .pt beside version 1, and version 2 alone as .pt
        publish_weights(store, state(0), 0)
        publish_weights(store, state(1), 1)
        store.write(f"{WEIGHTS}/policy_00000001.pt", b"legacy", fence=False)
        store.write(f"{WEIGHTS}/policy_00000002.pt", b"legacy", fence=False)
    listing = own_listing.list(WEIGHTS)
    for version in range(3, 9):
        pinned = (0,) if version < 6 else (4,)  # what the evaluator pins changes
        publish_weights(listed_each_time, state(version), version, keep_versions=pinned)
        publish_weights(own_listing, state(version), version, keep_versions=pinned, listing=listing)
        assert sorted(listing) == sorted(own_listing.list(WEIGHTS)) == sorted(listed_each_time.list(WEIGHTS))
    assert published_versions(own_listing) == [4, 6, 7, 8]


def test_publishes_at_a_url_with_the_learners_own_listing_send_no_list(s3_server, s3_env):
    from rlhf_pipeline.files.object_run_store import ObjectRunStore

    store = ObjectRunStore(s3_server.url("run"))
    publish_weights(store, state(0), 0)
    listing = store.list(WEIGHTS)
    with s3_server.requests.recording() as sent:
        for version in range(1, 6):
            publish_weights(store, state(version), version, keep_versions=(0,), listing=listing)
    assert not [path for _, path in sent if "list-type=2" in path], sent
    assert sorted(method for method, _ in sent) == ["DELETE"] * 2 + ["PUT"] * 5, sent
    assert published_versions(store) == [0, 3, 4, 5] and sorted(listing) == sorted(store.list(WEIGHTS))


def test_a_version_published_onto_a_full_disk_is_the_os_error_and_the_versions_before_stay_whole(small_disk):
    """The learner's publish on a full disk (`run` says the error in one line, and the same command
    resumes): the OS error names the version's partial file, which is gone; the versions before are
    listed and load as they were, and once there is room the same version publishes."""
    store = LocalRunStore(small_disk / "run")
    publish_weights(store, state(0), 0)
    publish_weights(store, state(1), 1)
    large = {"weight": torch.ones(512, 1024)}  # 2 MiB
    filler = fill(small_disk, leave_bytes=256 * 1024)
    with pytest.raises(OSError) as failed:
        publish_weights(store, large, 2)
    assert failed.value.errno == errno.ENOSPC, failed.value
    assert failed.value.filename.startswith(str(small_disk / "run" / WEIGHTS / "policy_00000002")), failed.value
    assert not [p.name for p in (small_disk / "run" / WEIGHTS).iterdir() if "partial" in p.name]
    assert published_versions(store) == [0, 1]
    weights, version = load_weights(store)
    assert version == 1 and torch.equal(weights["weight"], state(1)["weight"])

    filler.unlink()
    publish_weights(store, large, 2)
    weights, version = load_weights(store)
    assert version == 2 and torch.equal(weights["weight"], large["weight"])
