"""The storage benchmark at a tiny size: record format, same padded output everywhere, clean --json."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
import preloaded

from rlhf_pipeline.bench.storage_backends import BACKENDS, REMOTE_BACKENDS, BenchSpec, load_backend
from rlhf_pipeline.bench.storage_bench import RECORD_FIELDS, add_ratios, format_table, run_benchmark
from rlhf_pipeline.schema.padding import pad_batch
from rlhf_pipeline.schema import TrajectoryBatch

LOCAL_BACKENDS = [b for b in BACKENDS if b not in REMOTE_BACKENDS]  # zarr-s3 has its own test, with a server
TINY = BenchSpec(completions=48, group_size=4, min_prompt_len=2, max_prompt_len=12, min_response_len=1,
                 max_response_len=20, write_batch_size=16, sample_batch_size=8, sample_batches=3)


@pytest.fixture(scope="module")
def records():
    torch.set_num_threads(1)
    return run_benchmark(TINY, LOCAL_BACKENDS, isolate=False, progress=False)


def test_one_record_per_backend_with_the_documented_fields(records):
    assert [r["backend"] for r in records] == LOCAL_BACKENDS
    for record in records:
        missing = [f for f in RECORD_FIELDS if f not in record]
        assert not missing, f"{record['backend']} lacks {missing}"
        assert record["completions"] == TINY.completions
        for name in ("write_us_per_completion", "batches_per_s", "useful_tokens_per_s", "peak_rss_mb"):
            assert isinstance(record[name], float) and record[name] > 0, (record["backend"], name)
        assert record["raw_bytes"] > 0
    by_name = {r["backend"]: r for r in records}
    # (tiny files round up to whole disk blocks, so only bounds hold at this size)
    for name in ("raw-numpy", "memmap", "torchrl-lazymemmap"):
        assert by_name[name]["disk_bytes_per_raw_byte"] >= 1.0, name
    assert by_name["torchrl-lazystack"]["disk_bytes"] == 0  # RAM only


def test_table_has_a_row_per_backend_and_ratios_to_raw(records):
    table = format_table(records)
    lines = table.splitlines()
    assert len(lines) == 2 + len(records)
    raw_line = next(line for line in lines if line.startswith("| raw-numpy "))
    assert raw_line.count("1.00x") == 2
    without_baseline = format_table([r for r in records if r["backend"] != "raw-numpy"])
    assert "n/a" in without_baseline and "nan" not in without_baseline


def test_writes_compare_with_the_raw_baseline_of_the_same_durability(records):
    by_name = {r["backend"]: r for r in add_ratios([dict(r) for r in records])}
    assert by_name["memmap"]["durable"] and by_name["zarr"]["durable"]
    assert not by_name["memmap-nofsync"]["durable"] and not by_name["torchrl-lazymemmap"]["durable"]
    for name, baseline in (("memmap", "raw-numpy-fsync"), ("zarr", "raw-numpy-fsync"),
                           ("memmap-nofsync", "raw-numpy"), ("torchrl-lazystack", "raw-numpy")):
        record = by_name[name]
        assert record["write_baseline"] == baseline
        assert record["write_vs_raw"] == pytest.approx(
            record["write_us_per_completion"] / by_name[baseline]["write_us_per_completion"])
        assert record["batches_per_s_vs_raw"] == pytest.approx(
            record["batches_per_s"] / by_name["raw-numpy"]["batches_per_s"])


def test_repeat_runs_round_robin_and_keeps_each_backends_best(capsys):
    torch.set_num_threads(1)
    merged = run_benchmark(TINY, ["raw-numpy", "memmap-nofsync"], isolate=False, progress=True, repeat=2)
    order = [line.split(": ")[0] for line in capsys.readouterr().err.splitlines() if "completions" in line]
    assert order == ["[bench storage] raw-numpy (run 1/2)", "[bench storage] memmap-nofsync (run 1/2)",
                     "[bench storage] raw-numpy (run 2/2)", "[bench storage] memmap-nofsync (run 2/2)"]
    for record in merged:
        assert record["runs"] == 2 and len(record["batches_per_s_runs"]) == 2
        assert record["write_us_per_completion"] == min(record["write_us_per_completion_runs"])
        assert record["batches_per_s"] == max(record["batches_per_s_runs"])
    assert merged[0]["write_vs_raw"] == 1.0 and merged[1]["write_baseline"] == "raw-numpy"


@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
@pytest.mark.parametrize("name", [b for b in LOCAL_BACKENDS if b != "raw-numpy"])
def test_every_backend_samples_the_same_padded_batch(name, index_dtype, tmp_path):
    spec = dataclasses.replace(TINY, index_dtype=index_dtype)
    batches = list(spec.batches())
    everything = TrajectoryBatch.cat(batches)
    positions = torch.tensor([5, 0, 47, 5, 20, 33])
    expected = pad_batch(everything.select(positions), index_dtype=spec.torch_index_dtype)
    outputs = {}
    for backend_name in ("raw-numpy", name):
        backend = load_backend(backend_name)
        directory = tmp_path / backend_name
        directory.mkdir()
        backend.setup(directory, spec)
        try:
            for batch in batches:
                backend.write(batch)
            backend.finish_writes()
            outputs[backend_name] = backend.sample_padded(positions)
        finally:
            backend.close()
    for backend_name, got in outputs.items():
        assert set(got.keys(True, True)) == set(expected.keys(True, True)), backend_name
        for key in expected.keys(True, True):
            assert got[key].dtype == expected[key].dtype, (backend_name, key)
            assert torch.equal(got[key], expected[key]), (backend_name, key)


def test_unknown_backend_is_named_in_the_error():
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        load_backend("nope")


def test_cli_json_is_one_clean_array_from_isolated_workers():
    command = [sys.executable, "-m", "rlhf_pipeline.cli.main", "bench", "storage", "--json",
               "--completions", "32", "--sample-batches", "2", "--backends", "raw-numpy"]
    result = preloaded.run(command, capture_output=True, text=True, timeout=300,
                           cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr[-2000:]
    records = json.loads(result.stdout)  # nothing but the JSON array on stdout
    assert isinstance(records, list) and len(records) == 1
    assert records[0]["backend"] == "raw-numpy" and records[0]["completions"] == 32
    assert set(RECORD_FIELDS) <= set(records[0])
    assert "[bench storage]" in result.stderr  # progress went to stderr


def test_interleaved_sampling_compares_medians_taken_side_by_side(capsys):
    from rlhf_pipeline.bench.interleaved import format_interleaved, sample_interleaved

    records = sample_interleaved(TINY, ["raw-numpy", "memmap", "zarr"], rounds=3, batches_per_round=2)
    rounds = [line for line in capsys.readouterr().err.splitlines() if "interleaved round" in line]
    assert len(rounds) == 3 and all("raw-numpy" in r and "memmap" in r and "zarr" in r for r in rounds)
    by_name = {r["backend"]: r for r in records}
    raw_median = by_name["raw-numpy"]["ms_per_batch_median"]
    for record in records:
        assert len(record["ms_per_batch_rounds"]) == 3
        assert 0 < record["ms_per_batch_min"] <= record["ms_per_batch_median"]
        assert record["sampling_vs_raw_median"] == pytest.approx(raw_median / record["ms_per_batch_median"])
    assert by_name["raw-numpy"]["sampling_vs_raw_median"] == 1.0
    assert len(format_interleaved(records).splitlines()) == 2 + 3


def test_the_zarr_store_at_an_s3_location_runs_beside_the_local_ones(s3_server):
    location = s3_server.url("bench")
    spec = dataclasses.replace(TINY, location=location, storage_options=tuple(s3_server.options.items()))
    records = run_benchmark(spec, ["raw-numpy-fsync", "zarr", "zarr-s3"], isolate=False, progress=False)
    by_name = {r["backend"]: r for r in records}
    remote, local = by_name["zarr-s3"], by_name["zarr"]
    for name in ("write_us_per_completion", "batches_per_s", "useful_tokens_per_s"):
        assert remote[name] > 0, name
    assert remote["write_baseline"] == "raw-numpy-fsync" and remote["write_vs_raw"] > 0
    assert remote["raw_bytes"] == local["raw_bytes"]  # the same rows, one through the server
    assert remote["disk_bytes"] > 0
    assert s3_server.keys(location) == []  # the benchmark's prefix is deleted afterwards
