"""The replay benchmark at a tiny size: a record per (backend, order), ratios, a clean --json."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from rlhf_pipeline.bench import replay_bench
from rlhf_pipeline.bench.replay_bench import BACKENDS, ORDERS, RECORD_FIELDS, format_table, run_benchmark
from rlhf_pipeline.bench.storage_backends import BenchSpec

TINY = BenchSpec(completions=96, group_size=4, min_prompt_len=2, max_prompt_len=12, min_response_len=1,
                 max_response_len=20, write_batch_size=32, sample_batch_size=8)


@pytest.fixture(scope="module")
def records():
    torch.set_num_threads(1)
    return run_benchmark(TINY, window_rows=32, segment_rows=32, isolate=False, progress=False)


def test_a_record_per_backend_and_order_with_the_documented_fields(records):
    assert [(r["backend"], r["order"]) for r in records] == [(b, o) for b in BACKENDS for o in ORDERS]
    for record in records:
        assert not [f for f in RECORD_FIELDS if f not in record], record
        assert record["batches_per_s"] > 0 and record["peak_rss_mb"] >= record["import_rss_mb"] > 0
    by_key = {(r["backend"], r["order"]): r for r in records}
    # an epoch is every row once: 96 rows in batches of 8
    assert by_key["zarr", "shuffle"]["batches"] == by_key["memmap", "sequential"]["batches"] == 12
    # the Zarr store is opened with a quarter of the raw payload as its decoded-unit cache
    assert by_key["zarr", "shuffle"]["cache_bytes"] == records[0]["raw_bytes"] // 4
    assert by_key["memmap", "shuffle"]["cache_bytes"] is None
    assert by_key["memmap", "uniform"]["vs_memmap"] == 1.0 == by_key["zarr", "uniform"]["vs_uniform"]
    expected = by_key["zarr", "shuffle"]["batches_per_s"] / by_key["memmap", "shuffle"]["batches_per_s"]
    assert by_key["zarr", "shuffle"]["vs_memmap"] == pytest.approx(expected)


def test_table_has_a_row_per_record(records):
    lines = format_table(records).splitlines()
    assert len(lines) == 2 + len(records)
    assert all(line.count("|") == 9 for line in lines)


def test_json_output_is_one_array(capsys):
    args = argparse.Namespace(completions=64, window_rows=32, repeat=1, seed=0, json=True, in_process=True)
    assert replay_bench.main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert len(printed) == len(BACKENDS) * len(ORDERS)
