"""benchmarks/bench_lora_memory.py runs at a tiny size, and its figures say what LoRA changes: the
optimizer holds the adapter only, no reference copy is held, a sync carries the adapter alone."""

from __future__ import annotations

import json

import pytest

from tests.helpers import import_benchmark, needs_peft

pytestmark = needs_peft


def test_the_lora_memory_benchmark_reports_both_modes(capsys):
    bench = import_benchmark("bench_lora_memory")
    assert bench.main(["--hidden", "64", "--layers", "1", "--rows", "2", "--tokens", "16", "--new-tokens", "2",
                       "--steps", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    full, lora = report["modes"]
    assert (full["mode"], lora["mode"]) == ("full", "lora")
    assert full["trainable"] == full["parameters"] and 0 < lora["trainable"] < full["trainable"]
    assert lora["optimizer_mb"] < full["optimizer_mb"] and lora["reference_copy_mb"] == 0 < full["reference_copy_mb"]
    assert lora["published_bytes"] < full["published_bytes"]
    assert lora["round_s_merged"] > 0 and lora["round_s_peft_forward"] > 0
