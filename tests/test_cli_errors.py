"""Every command words a failure alike: one line, ``rlhf-pipeline COMMAND: error: ...``, exit code 2,
no traceback, including failures it did not word itself (``cli/main.py`` catches those)."""

from __future__ import annotations

import sys

import pytest

from rlhf_pipeline.cli.main import main


@pytest.mark.parametrize("argv", [
    ["inspect", "s3://some-bucket/run"],  # a run at a URL
    ["inspect", "s3://some-bucket/run/buffer"],
    ["export", "s3://some-bucket/run/buffer", "rows.jsonl"],  # was a traceback (RunStoreError)
    ["filter", "s3://some-bucket/run/buffer", "kept", "--where", "response_length <= 3"],
], ids=["inspect-run", "inspect-buffer", "export", "filter"])
def test_a_url_without_its_cloud_package_is_one_error_line(argv, monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "s3fs", None)  # as if the `s3` extra were not installed
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rlhf-pipeline {argv[0]}: error: ") and err.count("\n") == 1, err
    assert "s3fs" in err and "pip install -e '.[s3]'" in err
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("argv, words", [
    (["filter", "./buffer", "kept"], "give SRC, DST (or --dry-run) and --where"),
    (["import", "rows.jsonl", "buffer", "--rows-per-chunk", "0"], "--rows-per-chunk must be >= 1"),
    (["export-model", "./run"], "OUT is required"),
    (["replay", "pipelines/default.py"], "--buffer PATH is required"),
    (["show", "no-such-buffer"], "no-such-buffer does not exist"),
    # without a reference model nothing recomputes the KL these two shape: they were ignored
    (["replay", "pipelines/default.py", "--buffer", ".", "--kl-coef", "0.1"],
     "--kl-coef shapes the KL recomputed with a reference model: give --ref-model MODEL_DIR|RUN_DIR too, or drop it"),
    (["replay", "pipelines/default.py", "--buffer", ".", "--kl-coef", "nan", "--ref-model", "."],
     "--kl-coef must be a finite number >= 0, got nan"),
    # these three printed their own line, without "error:"
    (["inspect", ".", "--vocab-size", "0"], "--vocab-size 0: give a vocabulary size >= 1, with --verify"),
    (["repair", ".", "--vocab-size", "0"], "--vocab-size must be >= 1, got 0"),
    (["convert", "no-such-buffer", "out", "--to", "zarr"], "no-such-buffer does not exist"),
], ids=["filter", "import", "export-model", "replay", "show", "replay-kl-alone", "replay-kl-nan", "inspect", "repair",
        "convert"])
def test_a_commands_own_refusal_of_its_arguments_is_the_same_one_line(argv, words, monkeypatch, capsys, tmp_path):
    # each command refuses through one exception main words (cli.CommandRefused); filter once printed its own
    # line without "error:"
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rlhf-pipeline {argv[0]}: error: ") and err.count("\n") == 1, err
    assert words in err
    assert not any(tmp_path.iterdir())  # nothing written
