"""``rlhf-pipeline export``'s arguments and failures: the format from OUT's name, errors before
torch is imported, a run for its buffer, and a full disk as one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlhf_pipeline.cli.main import main

# runs ``main(argv)`` in a fresh interpreter and reports whether torch got imported
IMPORTS_TORCH = ("import sys; from rlhf_pipeline.cli.main import main; code = main(sys.argv[1:]); "
                 "print('torch' in sys.modules); sys.exit(code)")


def test_the_format_follows_the_suffix_and_a_contradiction_is_refused(collected_buffers, tmp_path, capsys):
    pytest.importorskip("pyarrow")
    buffer = str(collected_buffers["memmap"])
    assert main(["export", buffer, str(tmp_path / "rows.parquet"), "--quiet"]) == 0
    assert (tmp_path / "rows.parquet").read_bytes()[:4] == b"PAR1"
    assert main(["export", buffer, str(tmp_path / "rows.jsonl"), "--quiet"]) == 0
    assert json.loads((tmp_path / "rows.jsonl").read_text().splitlines()[0])["group_id"] == 0
    # into a directory not made yet: made, as convert's, filter's and export-model's are (was a traceback)
    assert main(["export", buffer, str(tmp_path / "exports" / "rows.jsonl"), "--quiet"]) == 0
    assert (tmp_path / "exports" / "rows.jsonl").read_text() == (tmp_path / "rows.jsonl").read_text()
    capsys.readouterr()

    assert main(["export", buffer, str(tmp_path / "x.parquet"), "--format", "jsonl"]) == 2
    assert "--format jsonl contradicts the name" in capsys.readouterr().err
    assert main(["export", buffer, str(tmp_path / "rows_hf")]) == 2
    assert "pass --format jsonl, parquet or hf" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exports", "rows.jsonl", "rows.parquet"]


@pytest.mark.parametrize("argv", [
    ["export", "{tmp}/missing", "{tmp}/x.jsonl"],
    ["export", "{tmp}", "{tmp}/x.csv"],
    ["filter", "{tmp}/missing", "{tmp}/out", "--where", "reward > 0"],
    ["filter", "{tmp}", "{tmp}/out", "--where", "reward >"],
])
def test_bad_arguments_are_one_line_before_torch_is_imported(tmp_path, argv):
    argv = [a.format(tmp=tmp_path) for a in argv]
    done = subprocess.run([sys.executable, "-c", IMPORTS_TORCH, *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "False\n", (done.stdout, done.stderr)
    assert len(done.stderr.strip().splitlines()) == 1 and "rows/s" not in done.stderr, done.stderr


def test_a_run_given_for_a_buffer_stands_for_its_buffer(tiny_run, tmp_path, capsys, monkeypatch):
    """export, filter and convert take a run (its directory, or its name under the home) for the buffer its
    learner read, saying so in one line; they asked "did you mean RUN/buffer?" before. inspect takes a run
    too: its rewind points and branches, then its buffer. A replay's directory keeps no buffer: refused."""
    buffer = tiny_run / "buffer"
    assert main(["export", str(buffer), str(tmp_path / "of-buffer.jsonl"), "--quiet"]) == 0
    monkeypatch.setenv("RLHF_PIPELINE_HOME", str(tiny_run.parent))
    for name, given in (("of-directory", str(tiny_run)), ("of-name", tiny_run.name)):
        assert main(["export", given, str(tmp_path / f"{name}.jsonl"), "--quiet"]) == 0
        assert f"[export] {tiny_run} is a run: its buffer {buffer}" in capsys.readouterr().err
        assert (tmp_path / f"{name}.jsonl").read_text() == (tmp_path / "of-buffer.jsonl").read_text()
    assert main(["filter", tiny_run.name, "--where", "reward >= 0", "--dry-run"]) == 0
    said = capsys.readouterr()
    assert f"its buffer {buffer}" in said.err and "kept" in said.out, said
    assert main(["convert", str(tiny_run), str(tmp_path / "converted"), "--to", "zarr", "--quiet"]) == 0
    assert sorted(p.name for p in (tmp_path / "converted").iterdir()) == sorted(p.name for p in buffer.iterdir()
                                                                               if p.name.startswith("shard-"))
    replay_run = tmp_path / "a-replay"
    replay_run.mkdir()
    (replay_run / "settings.json").write_text(json.dumps({"replay": {"buffer": str(buffer)}}))
    assert main(["export", str(replay_run), str(tmp_path / "x.jsonl")]) == 2
    assert f"is a replay of {buffer}, which keeps no buffer of its own" in capsys.readouterr().err
    assert main(["inspect", str(tiny_run)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"run  {tiny_run}") and "rewind points" in out and "shard rows" in out


@pytest.mark.slow
def test_a_full_disk_is_one_line_and_leaves_no_output(collected_buffers, tmp_path):
    """The file size limit (RLIMIT_FSIZE) makes writes fail as a full disk does (EFBIG for ENOSPC)."""
    out = tmp_path / "rows.jsonl"
    limited = ("import resource, sys; from rlhf_pipeline.cli.main import main; "
               "resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384)); sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", limited, "export", str(collected_buffers["memmap"]), str(out),
                           "--quiet"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip() == (f"rlhf-pipeline export: error: cannot write {out}: File too large (the "
                                   f"partial output was removed); free space or export elsewhere")
    assert list(tmp_path.iterdir()) == []
