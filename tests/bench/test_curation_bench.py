"""``rlhf-pipeline bench curation`` runs end to end at a tiny size and reports what it measured."""

from __future__ import annotations

import json

from rlhf_pipeline.cli.main import main


def test_curation_bench_reports_both_measurements(capsys):
    assert main(["bench", "curation", "--rows", "300", "--completions", "64", "--rounds", "2", "--steps", "3",
                 "--json", "--quiet"]) == 0
    records = json.loads(capsys.readouterr().out)  # stdout is one JSON document, nothing else
    prioritized = [r for r in records if r["measure"] == "prioritized"]
    assert {r["method"] for r in prioritized} == {"ours (sum tree)", "plain O(N) multinomial"}
    assert all(r["rows"] == 300 and len(r["us_per_step_rounds"]) == 2 for r in prioritized)
    filtered = {r["method"]: r for r in records if r["measure"] == "filter"}
    assert filtered["convert (baseline: copy all)"]["rows_kept"] == 64
    kept = {r["rows_kept"] for name, r in filtered.items() if name.startswith("filter")}
    assert len(kept) == 1 and 0 < kept.pop() < 64  # count, selection and copy keep the same rows
