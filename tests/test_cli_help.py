"""What ``--help`` and ``--version`` say: true of the CLI as it is (issue 33)."""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

import pytest

from rlhf_pipeline.cli.bench_cmd import BENCHMARKS
from rlhf_pipeline.cli.main import build_parser, main
from rlhf_pipeline.dataio.export import EXPORT_FORMATS
from rlhf_pipeline.files.run_paths import run_paths

REPO = Path(__file__).resolve().parent.parent


def test_version_is_the_installed_packages(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"rlhf-pipeline {version('rlhf-pipeline')}\n"


def test_the_bare_command_lists_every_command_and_fails(capsys):
    with pytest.raises(SystemExit) as exited:
        main([])
    assert exited.value.code == 2  # no command given is a usage error, as argparse's own
    said = capsys.readouterr().err
    assert all(re.search(rf"^    {name}\b", said, re.M) for name in build_parser().commands), said


def test_the_command_list_names_every_benchmark_and_export_format():
    lines = " ".join(build_parser().format_help().split())  # argparse wraps the one-line helps
    bench = lines.split(" bench ", 1)[1].split(" import ", 1)[0]
    assert all(name in bench for name in BENCHMARKS), bench
    export = lines.split(" export ", 1)[1].split(" export-model ", 1)[0]
    assert all(re.search(name, export, re.I) for name in ("JSONL", "Parquet", "HF", "chat")), export
    assert set(EXPORT_FORMATS) == {"jsonl", "parquet", "hf", "chat"}  # a new format is named above too


def test_show_examples_name_the_run_directory_that_run_makes():
    from rlhf_pipeline.cli.show_cmd import EXAMPLES

    runs = re.findall(r"rlhf-pipeline show storage/(\w+)", EXAMPLES)
    assert runs
    for name in runs:
        assert (REPO / "pipelines" / f"{name}.py").is_file()  # `rlhf-pipeline run pipelines/NAME.py` ...
        assert run_paths(name, REPO / "storage").root == REPO / "storage" / name  # ... writes storage/NAME
