"""The write-path benchmark runs end to end on a tiny workload and reports the storage-bench format."""

from __future__ import annotations

import json

from rlhf_pipeline.cli.main import main


def test_bench_write_path_json(capsys):
    code = main(["bench", "write-path", "--completions", "64", "--batch-size", "24", "--misaligned",
                 "--ref-completions", "2", "--json", "--backends", "raw-numpy", "memmap-append-only", "memmap",
                 "torchrl-mcadvantage-lazystack"])
    assert code == 0
    records = json.loads(capsys.readouterr().out)
    by_backend = {r["backend"]: r for r in records}
    assert set(by_backend) == {"raw-numpy", "memmap-append-only", "memmap", "torchrl-mcadvantage-lazystack",
                               "reference-model"}
    for name in ("raw-numpy", "memmap", "torchrl-mcadvantage-lazystack"):
        assert by_backend[name]["completions"] == 64 and by_backend[name]["write_path_us_per_completion"] > 0
    assert by_backend["memmap"]["groups_written"] == 8
    assert by_backend["reference-model"]["ref_tokens_per_s"] > 0
