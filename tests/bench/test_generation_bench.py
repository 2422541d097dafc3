"""``bench generation``: every engine gets the same requests and generates the same tokens, every
figure is in the JSON, an engine that cannot run is skipped with the reason, and the vLLM engines
run when the vLLM environment is there. The pipeline case runs the default pipeline's collector,
a weight update before each round, at a tiny size."""

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
    return parser.parse_args(["--cases", "long", "--models", "2m", "--repeats", "2", "--prompts", "2", "--group", "3",
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


def test_loop_and_hf_generate_the_same_tokens_and_report_every_figure_and_vllm_without_its_environment_is_skipped(
        tmp_path, capsys):
    """One bench for both (each engine runs in a process of its own: a bench per test would start the
    loop's twice): the loop and hf report every figure; the vLLM engines without their Python are skipped
    with the reason, in the JSON, on stderr and in the table."""
    missing = str(tmp_path / "no-such-python")
    result = run_bench(tmp_path, "--engines", "loop", "hf", "vllm", "vllm-server", "--vllm-python", missing)
    assert (result["repeats"], result["prompts"], result["group"], result["max_new_tokens"]) == (2, 2, 3, 4)
    assert len(result["load_before"]) == 3 and len(result["load_after"]) == 3
    engines = result["models"]["2m"]
    assert list(engines) == ["loop", "hf", "vllm", "vllm-server"]
    for engine in ("loop", "hf"):
        check_engine(engines[engine], repeats=2)
    assert engines["loop"]["parameters"] == engines["hf"]["parameters"] == 2_126_080
    for engine in ("vllm", "vllm-server"):
        assert f"--vllm-python {missing} is not a Python with vLLM" in engines[engine]["skipped"]
    captured = capsys.readouterr()
    table = captured.out
    assert "model 2m (2,126,080 parameters)" in table
    assert "| loop |" in table and "| hf |" in table
    assert f"vllm skipped: --vllm-python {missing}" in captured.err
    assert "| vllm-server | skipped: " in table


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


# the default pipeline's round at a tiny size: 2 prompts x 2 completions, a short warm start
TINY_PIPELINE = ("--cases", "pipeline", "--rounds", "2", "--set", "warm_start_steps=2", "--set", "prompts_per_round=2",
                 "--set", "group_size=2")


def check_rounds(figures: dict, repeats: int) -> None:
    for name in ("generate_s", "update_s", "rounds_per_s"):
        s = figures[name]
        assert 0 < s["min"] <= s["median"] <= s["max"], (name, s)
    assert figures["rows_per_round"] == [4] * repeats  # every round: 2 prompts x 2 completions written
    assert all(1 <= length <= 6 for length in figures["response_len_mean"])  # the pipeline's max_new_tokens
    assert figures["peak_rss_mib"] > 50


def test_the_pipeline_case_runs_the_collectors_rounds_with_an_update_before_each(tmp_path, capsys):
    result = run_bench(tmp_path, *TINY_PIPELINE, "--engines", "loop", "hf")
    assert result["models"] == {}  # the long case was not asked for
    case = result["pipeline"]
    assert case["settings"] == {"overrides": ["num_heads=2", "warm_start_steps=2", "prompts_per_round=2",
                                              "group_size=2"], "rounds": 2}
    check_rounds(case["engines"]["loop"], repeats=2)
    assert case["engines"]["loop"]["parameters"] == 138_304  # the default pipeline's model, 2 heads
    assert "no collector engine" in case["engines"]["hf"]["skipped"]
    assert case["ratios"] == {}  # no vLLM to compare
    table = capsys.readouterr().out
    assert "pipeline case: pipelines/default.py's round" in table and "| loop |" in table
    assert "| engine | generation s/round | weight update s/round | rounds/s |" in table


def test_the_pipeline_case_refuses_zero_rounds():
    with pytest.raises(SystemExit, match="--rounds must be >= 1, got 0"):
        generation_bench.main(bench_args("--rounds", "0"))


def test_the_pipeline_case_compares_vllm_with_the_loop(tmp_path, capsys):
    from rlhf_pipeline.generation.settings import find_vllm_python

    try:
        find_vllm_python(None)
    except ValueError as error:
        pytest.skip(f"needs the vLLM environment: {error}")
    result = run_bench(tmp_path, *TINY_PIPELINE, "--engines", "loop", "vllm", "--repeats", "1")
    case = result["pipeline"]
    for engine in ("loop", "vllm"):
        check_rounds(case["engines"][engine], repeats=1)
    assert case["engines"]["vllm"]["engine_start_s"] > 0.5
    assert set(case["ratios"]["vllm"]) == {"generate_s", "update_s", "rounds_per_s"}
    assert "| vllm / loop |" in capsys.readouterr().out
