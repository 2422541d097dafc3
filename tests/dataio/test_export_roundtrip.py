"""``export`` then ``import``: every stored field comes back exactly, in every format, from both backends."""

from __future__ import annotations

import json
import pytest
import torch
from dataio_setup import DEFAULT_PIPELINE, SMALL, WRITE_PATH_FIELDS

from rlhf_pipeline.cli.main import main
from rlhf_pipeline.dataio.columns import ColumnMap
from rlhf_pipeline.dataio.export import export_buffer
from rlhf_pipeline.dataio.importer import ImportOptions, import_source
from rlhf_pipeline.pipeline import RunPaths, load_pipeline_module, make_settings
from rlhf_pipeline.runs.processes import build_pipeline
from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage import create_store, open_buffer

SUFFIX = {"jsonl": "export.jsonl", "parquet": "export.parquet", "hf": "export_hf"}


def default_pipeline(tmp_path, *overrides: str):
    module = load_pipeline_module(DEFAULT_PIPELINE)
    settings = make_settings(module, [*SMALL, *overrides])
    return build_pipeline(module, settings, RunPaths(tmp_path))


def all_rows(location) -> "TrajectoryBatch":  # noqa: F821
    with open_buffer(str(location), mode="r") as store:
        return store.read(torch.arange(len(store)))


def quiet(*_args, **_kwargs):
    pass


@pytest.mark.parametrize("backend", ["memmap", "zarr"])
@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "hf"])
def test_import_of_an_export_reproduces_every_field(collected_buffers, tmp_path, backend, fmt):
    if fmt != "jsonl":
        pytest.importorskip("pyarrow")
    if fmt == "hf":
        pytest.importorskip("datasets")
    source = collected_buffers[backend]
    out = tmp_path / SUFFIX[fmt]
    seen = []
    result = export_buffer(source, out, fmt, progress=lambda done, total: seen.append((done, total)),
                           rows_per_chunk=32)
    original = all_rows(source)
    assert result.rows == len(original) == 80
    # streamed in chunks of 32, with progress: once the buffer is open (0 done, the rate's clock), then each chunk
    assert seen == [(0, 80), (32, 80), (64, 80), (80, 80)]
    # every optional field is present and real (not all zeros), so the comparison means something
    assert set(WRITE_PATH_FIELDS) <= set(original.field_names)
    assert all(original[f].values.abs().sum() > 0 for f in ("ref_log_probs", "kl", "token_rewards"))
    assert original["advantage"].abs().sum() > 0 and len(set(original["policy_version"].tolist())) == 5

    # into an existing store of the other backend with the same fields: no recomputation
    other = "zarr" if backend == "memmap" else "memmap"
    target = tmp_path / "imported"
    create_store(target, other, schema=StoreSchema(optional=WRITE_PATH_FIELDS)).close()
    pipeline = default_pipeline(tmp_path)
    logged: list[str] = []
    imported = import_source(out, target, pipeline, options=ImportOptions(show_progress=False), log=logged.append)
    assert imported.rows_written == 80 and imported.write_path == []
    assert all_rows(target).equal(original)
    assert not [line for line in logged if "warning" in line], logged  # the prompt's ids came with its text


def test_export_of_a_run_buffer_reads_every_shard(tiny_run, tmp_path, capsys):
    out = tmp_path / "run.jsonl"
    assert main(["export", str(tiny_run / "buffer"), str(out), "--format", "jsonl"]) == 0
    lines = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    rows = all_rows(tiny_run / "buffer")
    assert len(lines) == len(rows) == 64
    assert [line["trajectory_id"] for line in lines] == rows["trajectory_id"].tolist()
    assert lines[5]["response_log_probs"] == rows["response_log_probs"].row(5).tolist()
    assert "64/64 rows" in capsys.readouterr().err  # progress lines in a non-interactive log

    assert main(["export", str(tiny_run / "buffer"), str(out), "--format", "jsonl"]) == 2
    assert "already exists" in capsys.readouterr().err


def test_recomputed_log_probs_match_the_sampler(collected_buffers, tmp_path):
    """Without the log-prob column, import scores with make_policy(): the collector's model here."""
    out = tmp_path / "rows.jsonl"
    export_buffer(collected_buffers["memmap"], out, "jsonl")
    target = tmp_path / "rescored"
    create_store(target, "memmap", schema=StoreSchema(optional=WRITE_PATH_FIELDS)).close()
    options = ImportOptions(columns=ColumnMap(ignore=("response_log_probs", "policy_version")), show_progress=False)
    result = import_source(out, target, default_pipeline(tmp_path), options=options, log=quiet)
    assert "make_policy" in result.log_probs_from
    original, rescored = all_rows(collected_buffers["memmap"]), all_rows(target)
    assert torch.allclose(rescored["response_log_probs"].values, original["response_log_probs"].values, atol=1e-4)
    assert rescored.without("response_log_probs", "policy_version").equal(
        original.without("response_log_probs", "policy_version"))
    assert rescored["policy_version"].eq(0).all()  # the version of the weights that scored them


def test_export_refuses_an_unknown_format_and_keeps_no_partial_output(collected_buffers, tmp_path):
    with pytest.raises(ValueError, match="unknown export format 'csv'"):
        export_buffer(collected_buffers["memmap"], tmp_path / "x.csv", "csv")
    assert list(tmp_path.iterdir()) == []


def test_a_real_runs_buffer_exports_and_imports_back_unchanged(tiny_run, tmp_path, capsys):
    """The round-trip promise on the rows a run stored (the default pipeline's own data: short
    answers, some only EOS), through the commands a user types."""
    out = tmp_path / "rows.jsonl"
    assert main(["export", str(tiny_run / "buffer"), str(out), "--quiet"]) == 0
    copy = tmp_path / "copy"
    code = main(["import", str(out), str(copy), "--pipeline", str(DEFAULT_PIPELINE), "--quiet",
                 *[arg for item in SMALL for arg in ("--set", item)]])
    assert code == 0, capsys.readouterr().err
    assert all_rows(copy).equal(all_rows(tiny_run / "buffer"))


def test_multi_turn_trajectories_round_trip_and_get_one_advantage_per_trajectory(tmp_path):
    """Rows of multi-turn trajectories export and import back field for field (termination reasons
    included); the write path's group advantage compares trajectories' returns (the sum of their
    turns' rewards) and gives every turn its trajectory's advantage."""
    from helpers import TRAJECTORIES, multi_turn_rows

    original = multi_turn_rows()
    with create_store(tmp_path / "src", "memmap", StoreSchema(optional=("termination_reason",))) as store:
        store.append(original)
    export_buffer(tmp_path / "src", tmp_path / "rows.jsonl", "jsonl")
    create_store(tmp_path / "dst", "zarr", StoreSchema(optional=("termination_reason", "advantage"))).close()
    pipeline = default_pipeline(tmp_path, "group_size=2")
    options = ImportOptions(columns=ColumnMap(check_text=False), show_progress=False)  # ids of no real text
    result = import_source(tmp_path / "rows.jsonl", tmp_path / "dst", pipeline, options=options, log=quiet)
    assert result.write_path == ["GroupAdvantage"] and result.rows_written == len(original)
    imported = all_rows(tmp_path / "dst")
    assert imported.without("advantage").equal(original)

    returns = torch.tensor([turns * reward for turns, _, reward in TRAJECTORIES]).view(-1, 2)
    centered = returns - returns.mean(dim=1, keepdim=True)
    std = returns.std(dim=1, keepdim=True)
    expected = torch.where(std > 0, centered / std.clamp_min(1e-6), torch.zeros_like(centered)).flatten()
    per_row = expected.repeat_interleave(torch.tensor([turns for turns, _, _ in TRAJECTORIES]))
    torch.testing.assert_close(imported["advantage"], per_row, rtol=0, atol=1e-5)
