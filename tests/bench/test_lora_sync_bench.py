"""benchmarks/bench_lora_sync.py runs at a tiny size, and its figures say what LoRA changes: the
optimizer holds the adapter only, no reference copy is held, a sync carries the adapter alone, and
the engine samples the version it loaded (merged, for the loop engine)."""

from __future__ import annotations

import json

from tests.helpers import import_benchmark, needs_peft

pytestmark = needs_peft


def test_the_lora_sync_benchmark_reports_both_modes_side_by_side(capsys):
    bench = import_benchmark("bench_lora_sync")
    assert bench.main(["--hidden", "64", "--layers", "1", "--rows", "2", "--tokens", "16", "--new-tokens", "2",
                       "--steps", "1", "--syncs", "2", "--repeats", "1", "--engines", "loop", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    full, lora = report["modes"]
    assert (full["mode"], lora["mode"], full["engine"], lora["engine"]) == ("full", "lora", "loop", "loop")
    assert report["repeats"] == 1 and report["load"]
    assert full["trainable"] == full["parameters"] and 0 < lora["trainable"] < full["trainable"]
    assert lora["optimizer_mb"] < full["optimizer_mb"] and lora["reference_copy_mb"] == 0 < full["reference_copy_mb"]
    assert lora["published_bytes"] < full["published_bytes"]
    for mode in (full, lora):
        for figure in ("publish_s", "load_s", "step_s", "tokens_per_s", "peak_rss_over_baseline_mb"):
            assert 0 < mode[figure]["min"] <= mode[figure]["median"] <= mode[figure]["max"], (mode["mode"], figure)
    assert lora["round_s_merged"]["median"] > 0 and lora["round_s_peft_forward"]["median"] > 0
