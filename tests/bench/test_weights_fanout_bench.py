"""benchmarks/bench_weights_fanout.py at a tiny size: the GET counts it reports (counted on its moto
server by the key each collector process signs with) are N per version per machine without the
machine cache and 1 with it; docs/scaling.md quotes its table."""

from __future__ import annotations

import pytest
from helpers import import_benchmark

MACHINES, COLLECTORS, VERSIONS = 1, 2, 2


def test_collectors_of_a_machine_download_each_version_once_instead_of_once_each():
    pytest.importorskip("moto.server", reason="needs moto's server: pip install -e '.[s3,test-s3]'")
    pytest.importorskip("s3fs")
    bench_weights_fanout = import_benchmark("bench_weights_fanout")
    results = bench_weights_fanout.measure(MACHINES, COLLECTORS, VERSIONS, model_mb=0.25, log=lambda _: None)
    assert [row["GETs"] for row in results["before"]] == [MACHINES * COLLECTORS] * VERSIONS
    assert [row["GETs"] for row in results["after"]] == [MACHINES] * VERSIONS
    assert all(row["LISTs"] >= MACHINES * COLLECTORS for rows in results.values() for row in rows)  # each polled
    table = bench_weights_fanout.table(results, MACHINES, COLLECTORS)
    assert "| before | 1 × 2 | 2 |" in table and "| after | 1 × 2 | 1 |" in table
