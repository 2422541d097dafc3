"""Shard names: ``shard-NNNN`` on a file system, ``<hh>-shard-NNNN`` made at an object-store URL,
both read back to their index; the spread digits place a buffer's shards over key prefixes."""

from __future__ import annotations

from collections import Counter

import pytest

from rlhf_pipeline.files.run_paths import RunPaths
from rlhf_pipeline.files.shard_names import (
    new_shard_name,
    shard_index,
    shard_key_of,
    shard_location,
    shard_name,
    spread_shard_name,
)


def test_every_name_a_shard_can_have_reads_back_to_its_index():
    for index in (0, 7, 639, 9000, 12345):
        assert shard_index(shard_name(index)) == index
        assert shard_index(spread_shard_name(index)) == index
        assert spread_shard_name(index).endswith("-" + shard_name(index))
    assert shard_name(7) == "shard-0007"


def test_a_name_whose_digits_are_not_its_indexs_is_not_a_shard():
    digits = spread_shard_name(7)[:2]
    other = next(f"{d:02x}" for d in range(256) if f"{d:02x}" != digits)
    assert shard_index(f"{other}-shard-0007") is None
    lettered = next(spread_shard_name(i) for i in range(256) if spread_shard_name(i)[:2].isalpha())
    for name in ("shard-", "shard-x1", "buffer", "shard-0003.creating", "ABC-shard-0001", lettered[:2].upper() + lettered[2:],
                 f"{digits}_shard-0007", "pending-shard-0000"):
        assert shard_index(name) is None, name


def test_the_shards_of_a_buffer_start_spread_evenly_over_the_key_prefixes():
    """Any run of consecutive indices (a run's collectors 0..N-1, an import's from 9000) lands at most
    one shard apart on the 16 first digits, the prefixes S3 can split first, and on the 256 pairs;
    plain names all share one prefix."""
    for first, count in [(0, 1), (0, 7), (0, 100), (0, 640), (3, 250), (9000, 40), (0, 6400)]:
        names = [spread_shard_name(index) for index in range(first, first + count)]
        for width, prefixes in ((1, 16), (2, 256)):
            spread = Counter(name[:width] for name in names)
            busiest = max(spread.values())
            least = min(spread.values()) if len(spread) == prefixes else 0
            assert busiest - least <= 1, (first, count, width, spread)
    assert len({shard_name(index)[:2] for index in range(640)}) == 1


@pytest.mark.parametrize("buffer, spread", [("s3://bucket/run/buffer", True), ("az://container/run/buffer", True),
                                            ("/data/run/buffer", False), ("file:///data/run/buffer", False),
                                            ("memory://run/buffer", False)])
def test_shards_are_made_with_spread_names_at_object_store_urls_only(buffer, spread):
    name = new_shard_name(buffer, 3)
    assert name == (spread_shard_name(3) if spread else "shard-0003")
    assert shard_location(buffer, 3) == f"{buffer}/{name}"
    assert shard_key_of(shard_location(buffer, 3) + "/") == name


def test_a_run_makes_its_collectors_shards_under_the_names_of_where_its_buffer_is(tmp_path):
    at_url = RunPaths.at_url("s3://bucket/team/exp1")
    assert at_url.shard_location(2) == f"s3://bucket/team/exp1/buffer/{spread_shard_name(2)}"
    local = RunPaths(tmp_path / "exp1")
    assert local.shard_location(2) == str(tmp_path / "exp1" / "buffer" / "shard-0002") == str(local.shard(2))
    with pytest.raises(ValueError, match="shard index must be >= 0"):
        at_url.shard_location(-1)
