"""Retention on real stores (memmap, Zarr in a directory, on moto's S3 server and on Azurite): old rows go whole
(whole segments, never a group or trajectory cut in two), their files or objects are gone and the
bytes down, the rows kept read exactly as before, and a read of a dropped row is a clear error."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers import make_batch

from rlhf_pipeline.storage import create_store, open_store
from rlhf_pipeline.storage.retention import RetentionSettings, RowClock, wanted_cut, whole_cut

SEGMENT = 16
GROUP = 6  # 16 is no multiple of 6: groups straddle segment boundaries
NO_FLOOR = 10**12


def settled(store, size):
    """``size`` measured once the store's background seals and deletions are done (a Zarr store
    seals and removes merged units on a thread: a listing under way would race them)."""
    def measure():
        getattr(store, "flush", lambda: None)()
        return size()
    return measure


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def s3_bytes(server, url: str) -> tuple[int, int]:
    """(objects, bytes) under ``url`` as the server lists them."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    pages = server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    objects = [o for page in pages for o in page.get("Contents", [])]
    return len(objects), sum(o["Size"] for o in objects)


def fill(store, rounds: int, groups_per_round: int = 2) -> None:
    """``rounds`` appends of whole groups, round ``r`` sampled by policy version ``r``."""
    for r in range(rounds):
        store.append(make_batch(groups_per_round, GROUP, seed=r, first_group_id=r * groups_per_round,
                                first_trajectory_id=r * groups_per_round * GROUP, policy_version=r))


def az_bytes(server, url: str) -> tuple[int, int]:
    """(blobs, bytes) under ``url`` as the emulator lists them."""
    prefix = url.split("/", 3)[3] + "/"
    container = server.client().get_container_client(url.removeprefix("az://").split("/", 1)[0])
    blobs = list(container.list_blobs(name_starts_with=prefix))
    return len(blobs), sum(b.size for b in blobs)


@pytest.fixture(params=["memmap", "zarr", "zarr-s3", "zarr-az"])
def store_at(request, tmp_path):
    """A new writable store, a function returning the (objects, bytes) it takes now, and the
    arguments a reader opens it with."""
    if request.param == "zarr-s3":
        server = request.getfixturevalue("s3_server")
        url = server.url(f"retention-{os.getpid()}-{id(tmp_path)}")
        env = server.env()
        options = {"key": env["AWS_ACCESS_KEY_ID"], "secret": env["AWS_SECRET_ACCESS_KEY"],
                   "client_kwargs": {"endpoint_url": env["AWS_ENDPOINT_URL"], "region_name": "us-east-1"}}
        store = create_store(url, "zarr", segment_rows=SEGMENT, storage_options=options)
        yield store, settled(store, lambda: s3_bytes(server, url)), {"storage_options": options}
    elif request.param == "zarr-az":
        server = request.getfixturevalue("azure_server")
        url = server.url()
        store = create_store(url, "zarr", segment_rows=SEGMENT, storage_options=server.options)
        yield store, settled(store, lambda: az_bytes(server, url)), {"storage_options": server.options}
    else:
        path = tmp_path / "buffer"
        # memmap deletes a dropped segment's files after evict_grace_s (readers may still map them)
        extra = {"evict_grace_s": 0.0} if request.param == "memmap" else {}
        store = create_store(path, request.param, segment_rows=SEGMENT, **extra)
        yield store, settled(store, lambda: (sum(1 for f in path.rglob("*") if f.is_file()), du(path))), {}
    store.close()


def test_max_rows_drops_whole_groups_frees_space_and_keeps_the_other_rows(store_at):
    store, size, open_args = store_at
    fill(store, 10)  # 120 rows: 7 sealed segments and an open one
    before_objects, before_bytes = size()
    everything = store.read_global(list(range(store.next_row)))
    rules = RetentionSettings(max_rows=50)

    cut = whole_cut(store, wanted_cut(store, rules, newest_version=None, clock=None, now=0.0), NO_FLOOR)
    dropped = store.drop_rows_before(cut)

    assert cut % SEGMENT == 0 and cut <= store.next_row - 50 + SEGMENT
    assert store.first_row == cut == sum(d.rows for d in dropped) and len(store) == 120 - cut
    groups = everything.group_id.tolist()
    assert groups[cut - 1] != groups[cut], "a group was cut in two"
    after_objects, after_bytes = size()
    assert after_objects < before_objects and after_bytes < before_bytes
    assert before_bytes - after_bytes >= sum(d.bytes for d in dropped) * 0.9  # what it says it freed
    kept = list(range(cut, store.next_row))
    again = store.read_global(kept)
    for name in ("group_id", "trajectory_id", "policy_version", "reward"):
        assert torch.equal(getattr(again, name), getattr(everything, name)[cut:])
    assert again.response_tokens.equal(everything.response_tokens.index(slice(cut, None)))
    with pytest.raises(IndexError, match="dropped by retention"):
        store.read_global([cut - 1])
    reader = open_store(store.location, **open_args)
    try:  # a new reader sees the same: the drop was published
        assert reader.first_row == cut and torch.equal(reader.read_global(kept).group_id, again.group_id)
    finally:
        reader.close()


def test_a_boundary_a_group_straddles_is_held(tmp_path):
    store = create_store(tmp_path / "buffer", "memmap", segment_rows=SEGMENT, evict_grace_s=0.0)
    fill(store, 5)  # groups [0,6) [6,12) [12,18) ...: groups straddle rows 16 and 32, none straddles 48
    groups = store.read_global(list(range(store.next_row))).group_id.tolist()
    assert groups[15] == groups[16] and groups[31] == groups[32] and groups[47] != groups[48]
    assert whole_cut(store, 40, NO_FLOOR) == 0  # 32 and 16 split a group, and there is no boundary before
    assert whole_cut(store, 50, NO_FLOOR) == 48  # 48 splits none: rows [0, 48) go together
    assert whole_cut(store, 50, 47) == 0  # the floor: nothing at or after row 47 may go
    assert [d.first_row for d in store.drop_rows_before(48)] == [0, 16, 32] and store.first_row == 48
    store.close()


def test_trajectories_are_never_cut_either(tmp_path):
    store = create_store(tmp_path / "buffer", "memmap", segment_rows=SEGMENT, evict_grace_s=0.0)
    batch = make_batch(4, 8, seed=1)  # one group per row would pass the group test alone
    batch.group_id[:] = torch.arange(len(batch))
    batch.trajectory_id[:] = torch.arange(len(batch)) // 4  # turns of one trajectory: rows 12..19
    store.append(batch)
    assert whole_cut(store, 17, NO_FLOOR) == 16  # 16 splits nothing: 4 divides 16
    batch.trajectory_id[:] = torch.arange(len(batch)) // 5  # trajectory 3 holds rows 15..19
    store2 = create_store(tmp_path / "b2", "memmap", segment_rows=SEGMENT, evict_grace_s=0.0)
    store2.append(batch)
    assert whole_cut(store2, 17, NO_FLOOR) == 0
    store.close()
    store2.close()


def test_versions_and_age_rules(tmp_path):
    store = create_store(tmp_path / "buffer", "zarr", segment_rows=SEGMENT)
    fill(store, 10)  # round r: rows [12r, 12r + 12) of version r
    rules = RetentionSettings(max_versions_behind=4)
    # versions below 9 - 4 = 5 may go: rows [0, 60); the whole segments of them end at 48
    assert wanted_cut(store, rules, newest_version=9, clock=None, now=0.0) == 48
    clock = RowClock()
    for r in range(10):
        clock.mark(12 * (r + 1), now=100.0 + r)  # round r was written at t = 100 + r
    aged = RetentionSettings(max_age_s=5.0)
    assert wanted_cut(store, aged, newest_version=None, clock=clock, now=107.5) == 36  # rounds 0-2
    both = RetentionSettings(max_rows=100, max_age_s=5.0)  # any rule that says so drops
    assert wanted_cut(store, both, newest_version=None, clock=clock, now=107.5) == 36
    store.close()


def test_the_row_clock_stays_small_and_never_makes_rows_older():
    clock = RowClock()
    for i in range(1, 2000):
        clock.mark(10 * i, now=float(i))
    assert len(clock.marks) <= 300
    for age in (5.0, 100.0, 1500.0):
        row = clock.rows_older_than(age, now=2000.0)
        assert row <= 10 * int(2000.0 - age)  # rows written at t <= 2000 - age end at 10 * t
    clock.forget_before(15_000)
    assert clock.marks[0][0] <= 15_000 and clock.rows_older_than(1.0, now=2000.0) == 19_990


@pytest.mark.parametrize("rules, words", [
    (dict(max_rows=0), "setting 'retention.max_rows' must be >= 1 or none, got 0"),
    (dict(max_versions_behind=-1), "setting 'retention.max_versions_behind' must be >= 0 or none, got -1"),
    (dict(max_age_s=-1.0), "setting 'retention.max_age_s' must be > 0 or none, got -1.0"),
    (dict(max_rows=2.5), "setting 'retention.max_rows' must be a whole number or none (no bound), got 2.5"),
    (dict(max_age_s="1d"), "setting 'retention.max_age_s' must be a number of seconds or none (no bound), got '1d'"),
    (dict(max_age_s=float("nan")), "'retention.max_age_s' must be a finite number or none, got nan"),
])
def test_bad_settings_are_one_line_naming_the_setting(rules, words):
    with pytest.raises(ValueError) as raised:
        RetentionSettings(**rules)
    assert words in str(raised.value) and "\n" not in str(raised.value)


def test_a_reader_cannot_drop_rows(tmp_path):
    store = create_store(tmp_path / "buffer", "memmap", segment_rows=SEGMENT)
    fill(store, 4)
    store.close()
    reader = open_store(tmp_path / "buffer")
    with pytest.raises(Exception, match="only its writer"):
        reader.drop_rows_before(32)
    reader.close()
