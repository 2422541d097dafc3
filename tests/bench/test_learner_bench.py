"""``rlhf-pipeline bench learner --quick`` runs end to end and its sides train the same rows."""

from __future__ import annotations

import json

import pytest

from rlhf_pipeline.bench.trl_side import trl_version
from rlhf_pipeline.cli.main import main


@pytest.mark.parametrize("with_trl", [False, True], ids=["padded-packed", "with-trl"])
def test_learner_bench_quick_reports_every_side_on_the_same_rows(capsys, with_trl):
    if with_trl and trl_version() is None:
        pytest.skip("trl is not installed (pip install -e .[bench-trl])")
    argv = ["bench", "learner", "--quick", "--steps", "2", "--repeat", "2", "--json"]
    assert main(argv + ([] if with_trl else ["--no-trl"])) == 0
    report = json.loads(capsys.readouterr().out)  # stdout is one JSON document, nothing else
    records = {r["side"]: r for r in report["records"]}
    assert set(records) == ({"padded", "packed", "trl"} if with_trl else {"padded", "packed"})
    padded, packed = records["padded"], records["packed"]
    for r in records.values():
        assert r["rows_trained"] == 8 and len(r["seconds_runs"]) == 2
        assert r["response_tokens"] == padded["response_tokens"] and r["tokens"] == padded["tokens"]
        assert 0 < r["response_tokens_per_s_min"] <= r["response_tokens_per_s_median"] <= r["response_tokens_per_s_max"]
        assert r["peak_rss_mb_median"] > 0
        # the same rows, weights and objective: the same loss at the first step
        assert r["first_loss"] == pytest.approx(padded["first_loss"], rel=1e-5)
    assert packed["padding_fraction"] == 0 and packed["positions"] == packed["tokens"]
    assert padded["padding_fraction"] > 0
    assert report["prompt_lengths"][0] == "lognormal" and report["quick"] is True
