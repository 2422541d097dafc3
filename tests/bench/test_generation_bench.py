"""``bench generation``: every engine gets the same requests and generates the same tokens, every
figure is in the JSON, an engine that cannot run is skipped with the reason, and the vLLM engines
run when the vLLM environment is there."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import pytest

from rlhf_pipeline.bench import generation_bench
from rlhf_pipeline.bench.generation_side import peak_rss_mib, process_tree

FIGURES = ("tokens_per_s", "ttft_s", "weight_update_s")
ONCE = ("engine_start_s", "peak_rss_mib", "driver_peak_rss_mib", "parameters")


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    generation_bench.add_arguments(parser)
    return parser.parse_args(["--models", "2m", "--repeats", "2", "--prompts", "2", "--group", "3",
                              "--max-new-tokens", "4", *argv])


def run_bench(tmp_path, *argv: str) -> dict:
    out = tmp_path / "bench.json"
    assert generation_bench.main(bench_args("--json", str(out), *argv)) == 0
    return json.loads(out.read_text())


def check_engine(figures: dict, repeats: int, completions: int = 6, max_new_tokens: int = 4) -> None:
    for name in FIGURES:
        s = figures[name]
        assert 0 < s["min"] <= s["median"] <= s["max"], (name, s)
    for name in ONCE:
        assert figures[name] >= 0, name
    assert figures["peak_rss_mib"] > 50  # torch and the model at least: read from /proc, not zero
    # every call: the same completions, each of 1 .. max_new_tokens tokens (they stop at EOS)
    assert figures["completions_per_call"] == [completions] * repeats
    assert all(completions <= t <= completions * max_new_tokens for t in figures["tokens_per_call"])


def test_loop_and_hf_generate_the_same_tokens_and_report_every_figure(tmp_path, capsys):
    result = run_bench(tmp_path, "--engines", "loop", "hf")
    assert (result["repeats"], result["prompts"], result["group"], result["max_new_tokens"]) == (2, 2, 3, 4)
    assert len(result["load_before"]) == 3 and len(result["load_after"]) == 3
    engines = result["models"]["2m"]
    assert list(engines) == ["loop", "hf"]
    for figures in engines.values():
        check_engine(figures, repeats=2)
    assert engines["loop"]["parameters"] == engines["hf"]["parameters"] == 2_126_080
    table = capsys.readouterr().out
    assert "model 2m (2,126,080 parameters)" in table
    assert "| loop |" in table and "| hf |" in table


def test_vllm_engines_without_the_environment_are_skipped_with_the_reason(tmp_path, capsys):
    missing = str(tmp_path / "no-such-python")
    result = run_bench(tmp_path, "--engines", "loop", "vllm", "vllm-server", "--repeats", "1", "--vllm-python", missing)
    engines = result["models"]["2m"]
    check_engine(engines["loop"], repeats=1)
    for engine in ("vllm", "vllm-server"):
        assert f"--vllm-python {missing} is not a Python with vLLM" in engines[engine]["skipped"]
    captured = capsys.readouterr()
    assert f"vllm skipped: --vllm-python {missing}" in captured.err
    assert "| vllm-server | skipped: " in captured.out


def test_bad_counts_are_refused_naming_the_option():
    with pytest.raises(SystemExit, match="--max-new-tokens must be >= 1, got 0"):
        generation_bench.main(bench_args("--max-new-tokens", "0"))


def test_peak_memory_of_a_process_tree_covers_its_children():
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(200 << 20); time.sleep(30)"],
                             stdout=subprocess.PIPE)
    try:
        assert child.pid in process_tree(os.getpid())
        deadline = time.monotonic() + 30
        while peak_rss_mib(child.pid) < 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert peak_rss_mib(child.pid) >= 200  # the 200 MiB it touched
    finally:
        child.kill()
        child.wait()
    assert peak_rss_mib(child.pid) == 0.0  # gone: nothing to read


def test_vllm_engine_and_server_generate_the_same_tokens(tmp_path):
    from rlhf_pipeline.generation.settings import find_vllm_python

    try:
        find_vllm_python(None)
    except ValueError as error:
        pytest.skip(f"needs the vLLM environment: {error}")
    result = run_bench(tmp_path, "--engines", "loop", "vllm", "vllm-server", "--repeats", "1")
    engines = result["models"]["2m"]
    for engine in ("loop", "vllm", "vllm-server"):
        assert "skipped" not in engines[engine], engines[engine]
        check_engine(engines[engine], repeats=1)
    for engine in ("vllm", "vllm-server"):
        # the engine's own processes, not the driver: vLLM's is far bigger than a torch process
        assert engines[engine]["peak_rss_mib"] > engines[engine]["driver_peak_rss_mib"]
        assert engines[engine]["engine_start_s"] > 0.5
    # the same seeds on the same weights: the engine and the server sample the same rows
    assert engines["vllm"]["tokens_per_call"] == engines["vllm-server"]["tokens_per_call"]
