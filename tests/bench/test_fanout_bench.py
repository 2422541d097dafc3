"""benchmarks/bench_fanout.py at a tiny size: the request counts it reports are the ones docs/scaling.md
gives (counted on its moto server by the key each simulated rank signs with), opening included."""

from __future__ import annotations

from collections import Counter

import pytest
from helpers import import_benchmark

from rlhf_pipeline.files.shard_names import spread_shard_name

SHARDS, RANKS, ROWS = 6, 3, 4


@pytest.fixture(scope="module")
def results():
    pytest.importorskip("moto.server", reason="needs moto's server: pip install -e '.[s3,test-s3]'")
    pytest.importorskip("s3fs")
    bench_fanout = import_benchmark("bench_fanout")
    opened, found = bench_fanout.measure(SHARDS, RANKS, steps=2, rows=ROWS, samplers=["exact", "window"],
                                         log=lambda _: None)
    return {(r["sampler"], r["mode"]): r["steps"] for r in found}, bench_fanout.table(found), \
        {r["opening"]: r for r in opened}, bench_fanout.opening_table(opened)


def test_other_ranks_open_the_buffer_from_rank_zeros_records_without_a_request(results):
    _, _, opened, printed = results
    for opening in opened.values():  # rank 0 lists the buffer once and GETs each shard's record once
        assert (opening["rank 0 LIST"], opening["rank 0 record GET"]) == (1, SHARDS)
    each = opened["each rank opens"]  # every other rank the same
    assert (each["others LIST"], each["others record GET"]) == (RANKS - 1, (RANKS - 1) * SHARDS)
    assert each["sent KB"] == 0
    shared = opened["rank 0's records"]
    assert shared["others LIST"] == shared["others record GET"] == shared["others other"] == 0
    assert shared["most by one other rank"] == 0 and shared["sent KB"] > 0
    lines = printed.splitlines()
    assert lines[0].startswith("| opening | rank 0: LIST | rank 0: record GETs")
    assert [line.split(" | ")[0] for line in lines[2:]] == ["| each rank opens", "| rank 0's records"]


def test_other_ranks_stop_refreshing_once_rank_zeros_refresh_is_shared(results):
    by_mode, *_ = results
    for sampler in ("exact", "window"):
        for step in by_mode[sampler, "before"]:  # each other rank: one LIST and a GET per shard's record
            assert step["others LIST"] == RANKS - 1
            assert step["others record GET"] == (RANKS - 1) * SHARDS
        for mode in ("shared refresh", "shared + affinity"):
            for step in by_mode[sampler, mode]:
                assert step["others LIST"] == step["others record GET"] == 0
                assert step["others unit GET"] > 0  # they still read their slices
        for step in by_mode[sampler, "before"] + by_mode[sampler, "shared refresh"]:
            assert step["rank 0 LIST"] >= 1 and step["rank 0 record GET"] >= SHARDS  # rank 0 refreshes as before


def test_with_affinity_each_unit_is_fetched_by_one_rank_only(results):
    by_mode, *_ = results
    for sampler in ("exact", "window"):
        for step in by_mode[sampler, "shared + affinity"]:
            assert step["units read"] == SHARDS  # one new fragment per shard
            assert step["other ranks per unit"] == 1.0
            # rank 0's reads of the whole draw (policy_version for staleness, done/step for multi-turn)
            # are answered by the records: it GETs only its own shards' fragments
            assert step["rank 0 unit GET"] == SHARDS // RANKS
            assert step["ranks per unit"] == 1.0
    # random draws split in equal slices fetch a fragment from several ranks; the exact sampler's draw
    # is in shard order, so its equal slices were close to affinity already
    assert all(step["other ranks per unit"] > 1.0 for step in by_mode["window", "before"])
    assert all(step["other ranks per unit"] == 1.0 for step in by_mode["exact", "before"])


def test_the_table_has_a_row_per_sampler_and_mode(results):
    by_mode, printed, *_ = results
    lines = printed.splitlines()
    assert len(lines) == 2 + len(by_mode)
    assert lines[0].startswith("| sampler | mode | rank 0: LIST + record GETs")
    for sampler, mode in by_mode:
        assert any(line.startswith(f"| {sampler} | {mode} |") for line in lines)
    assert all(step["collectors PUT"] >= 3 * SHARDS for steps in by_mode.values() for step in steps)


def test_spread_shard_names_spread_the_requests_over_key_prefixes(results):
    """Plain names send every request of a step to one key prefix (``shard-``); spread names
    (``files/shard_names.py``) send each prefix about its shards' share: here the busiest first
    character holds half of the 6 shards, so about half the requests, since every shard gets the
    same appends, record GETs and (the exact sampler) reads."""
    by_mode, *_ = results
    bench_fanout = import_benchmark("bench_fanout")
    _, plain = bench_fanout.measure(SHARDS, RANKS, steps=1, rows=ROWS, samplers=["exact"],
                                    modes=bench_fanout.MODES[-1:], log=lambda _: None, shard_names="plain")
    assert [step["busiest prefix %"] for step in plain[0]["steps"]] == [100.0]
    busiest_share = max(Counter(spread_shard_name(k)[0] for k in range(SHARDS)).values()) / SHARDS
    for step in by_mode["exact", "shared + affinity"]:
        assert step["busiest prefix %"] < 100 * (busiest_share + 0.25)
