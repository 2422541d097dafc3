"""benchmarks/bench_run_requests.py on a short run: it counts a whole run's requests by kind from its
moto server's log, and the run sends none of the kinds it stopped sending (a listing of each replaced
fragment, a HEAD before each copy the position history keeps)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import import_benchmark

REPO = Path(__file__).resolve().parents[2]


def test_a_short_run_at_a_url_is_counted_by_kind_and_lists_no_unit(tmp_path):
    pytest.importorskip("moto.server", reason="needs moto's server: pip install -e '.[s3,test-s3]'")
    pytest.importorskip("s3fs")
    bench = import_benchmark("bench_run_requests")
    record = bench.run_once(REPO, steps=4, scratch=tmp_path, latency_s=0.001)  # a round trip added to each answer
    kinds = record["kinds"]
    assert record["total"] == sum(kinds.values()) > 0
    assert record["step_s"] > 0  # from the times the run's metrics log records at the URL
    assert kinds["PUT weights"] >= 5 and kinds["GET weights"] >= 1  # version 0, one a step; the collector's loads
    assert kinds["PUT buffer"] > 0 and kinds["LIST buffer/"] > 0  # appends; the learner's refreshes
    assert not [kind for kind in kinds if "units/<unit>/" in kind], kinds  # replaced units are deleted by their keys
    assert kinds["HEAD collector"] <= 1, kinds  # the start's look for its entry; none before a copy
    assert bench.kind_of("POST", "/bench-run-requests?delete", "p/r/") == "DeleteObjects (its keys are in the body)"
    assert bench.kind_of("GET", "/bench-run-requests?list-type=2&prefix=p%2Fr%2Fweights%2F&delimiter=%2F",
                         "p/r/") == "LIST weights/"
