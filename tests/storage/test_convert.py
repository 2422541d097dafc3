"""memmap <-> Zarr conversion: every row equal, in bounded steps, through the API and the CLI."""

from __future__ import annotations

import re
import zipfile

import pytest
import torch
from helpers import make_batch

from rlhf_pipeline.cli.main import main
from rlhf_pipeline.schema import OPTIONAL_FIELDS, StoreSchema, TrajectoryBatch
from rlhf_pipeline.storage import create_store, open_store
from rlhf_pipeline.storage.convert import convert, verify


def _fill(path: str, backend: str, *, batches: int = 5, optional=OPTIONAL_FIELDS, **options) -> TrajectoryBatch:
    written = [make_batch(3, 4, seed=i, optional=optional, first_group_id=3 * i, first_trajectory_id=12 * i,
                          policy_version=i) for i in range(batches)]
    with create_store(path, backend, StoreSchema(optional), segment_rows=16, **options) as store:
        for b in written:
            store.append(b)
    return TrajectoryBatch.cat(written)


@pytest.mark.parametrize(("source", "target"), [("memmap", "zarr"), ("zarr", "memmap")])
def test_conversion_is_lossless_on_every_row(tmp_path, source, target):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    expected = _fill(src, source)  # 60 rows: 3 sealed segments + an open tail
    steps = []
    stats = convert(src, dst, target, progress=lambda done, total: steps.append((done, total)))
    assert stats.backend == target and stats.rows == 60
    assert steps[-1] == (60, 60) and len(steps) == 4  # one step per source segment
    with open_store(dst) as converted:
        assert converted.backend_name == target
        assert converted.schema == StoreSchema(OPTIONAL_FIELDS)
        assert converted.read(torch.arange(60)).equal(expected)
    assert verify(src, dst) == 60


def test_round_trip_memmap_zarr_memmap_keeps_bytes_and_eviction_window(tmp_path):
    src = str(tmp_path / "src")
    expected = _fill(src, "memmap", batches=8, optional=(), capacity_rows=48)  # oldest rows evicted
    with open_store(src) as store:
        held = torch.arange(store.first_row, store.next_row)
        assert store.first_row > 0
    convert(src, str(tmp_path / "z"), "zarr", codec="zstd")
    convert(str(tmp_path / "z"), str(tmp_path / "back"), "memmap")
    with open_store(str(tmp_path / "back")) as back:
        assert back.read(torch.arange(len(back))).equal(expected.select(held))
        assert back.capacity_rows == 48


def test_destination_that_exists_is_refused_and_untouched(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    _fill(src, "memmap", batches=1)
    kept = _fill(dst, "zarr", batches=2)
    with pytest.raises(FileExistsError):
        convert(src, dst, "zarr")
    with open_store(dst) as store:
        assert store.read(torch.arange(len(store))).equal(kept)


def test_cli_convert_with_verify(tmp_path, capsys):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    expected = _fill(src, "memmap", batches=3)
    assert main(["convert", src, dst, "--to", "zarr", "--verify", "--quiet"]) == 0
    assert "36 rows" in capsys.readouterr().out
    with open_store(dst) as store:
        assert store.read(torch.arange(36)).equal(expected)
    assert main(["convert", src, dst, "--to", "zarr", "--quiet"]) == 2
    assert "already holds" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "nothing"), str(tmp_path / "x"), "--to", "memmap", "--quiet"]) == 2
    # 0 rows per segment is refused as filter refuses it: it read as "not given", the source's size
    assert main(["convert", src, str(tmp_path / "zero"), "--to", "zarr", "--segment-rows", "0", "--quiet"]) == 2
    assert "segment_rows must be >= 1, got 0" in capsys.readouterr().err and not (tmp_path / "zero").exists()


def test_cli_converts_a_saved_selection_into_a_store_of_its_rows(tmp_path, capsys):
    """``convert`` of a ``filter --selection`` was refused as "not a store: read it with open_buffer(...)",
    a Python hint for a command-line user; its rows are copied into a store that needs no source. The
    commands that write or repair refuse it naming its source (``import`` only after checking every row)."""
    import shutil

    from pathlib import Path

    src, sel, dst = str(tmp_path / "src"), str(tmp_path / "sel"), str(tmp_path / "dst")
    rows = _fill(src, "memmap", batches=4)
    assert main(["filter", src, sel, "--where", "policy_version >= 2", "--selection", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["repair", sel]) == 2
    assert f"one that writes or repairs takes its source, {src}" in capsys.readouterr().err
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(f'{{"prompt": "1+{d}=", "completion": "{1 + d}", "reward": 1.0, "group_id": 0}}\n'
                              for d in range(4)))
    pipeline = Path(__file__).resolve().parents[2] / "pipelines" / "default.py"
    assert main(["import", str(source), sel, "--pipeline", str(pipeline)]) == 2
    refused = capsys.readouterr().err
    assert f"takes no rows of its own: import into its source ({src})" in refused and "[import: check]" not in refused
    assert main(["convert", sel, dst, "--to", "zarr", "--verify", "--quiet"]) == 0
    assert f"{dst}: 24 rows" in capsys.readouterr().out
    shutil.rmtree(src)  # the copy holds its rows: the selection's source is no longer needed
    with open_store(dst) as store:
        assert store.read(torch.arange(len(store))).equal(rows.select(torch.arange(24, 48)))


def test_cli_converts_a_sharded_buffer_shard_by_shard_and_names_the_ratio_one_way(tmp_path, capsys):
    import json

    from rlhf_pipeline.storage.sharded import list_shards, shard_path

    buffer, dst = tmp_path / "buffer", tmp_path / "zarr-buffer"
    expected = {k: _fill(str(shard_path(buffer, k)), "memmap", batches=2 + k) for k in (0, 1)}
    assert main(["convert", str(buffer), str(dst), "--to", "zarr", "--verify", "--quiet"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [index for index, _ in list_shards(dst)] == [0, 1] and len(lines) == 2
    for k, line in zip((0, 1), lines):
        with open_store(shard_path(dst, k)) as store:
            assert store.backend_name == "zarr"
            assert store.read(torch.arange(len(store))).equal(expected[k])
        assert main(["inspect", str(shard_path(dst, k)), "--json"]) == 0
        stats = json.loads(capsys.readouterr().out)
        # the message and inspect give the same figures: bytes as du counts them, disk/raw
        assert f"{stats['bytes_on_disk']} bytes on disk" in line
        assert f"disk/raw {stats['bytes_on_disk'] / stats['raw_bytes']:.3f}" in line
    assert main(["convert", str(buffer), str(dst), "--to", "zarr", "--quiet"]) == 2  # never over a buffer
    assert "already holds" in capsys.readouterr().err


def test_cli_refuses_a_destination_that_is_the_source_inside_it_or_inside_a_run_buffer(tmp_path, capsys):
    """``convert X X`` advised ``MemmapTrajectoryStore.open(...)`` (Python, on the command line); a DST
    inside a run's buffer became one more shard of it."""
    src = str(tmp_path / "src")
    _fill(src, "memmap", batches=1)
    run_buffer = tmp_path / "run" / "buffer"
    _fill(str(run_buffer / "shard-0000"), "memmap", batches=1)
    (tmp_path / "run" / "settings.json").write_text("{}")
    refused = [(src, src, "memmap", "is the source: convert writes a copy"),
               (src, src, "zarr", "is the source: convert writes a copy"),
               (src, f"{src}/inner", "zarr", "is inside the source"),
               (src, str(run_buffer / "shard-0001"), "memmap", "is inside the buffer .*run/buffer"),
               (str(run_buffer), str(tmp_path / "run"), "zarr", "already holds files; convert writes a new buffer")]
    for a, b, to, message in refused:
        assert main(["convert", a, b, "--to", to, "--quiet"]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and re.search(message, err), err
        assert ".open(" not in err and "mode=" not in err and "exist_ok" not in err, err
    assert not (run_buffer / "shard-0001").exists() and not (tmp_path / "src" / "inner").exists()
    with open_store(src) as store:
        assert len(store) == 12


# a convert that dies midway (kill -9) left DST a valid store with fewer rows than the source: read
# later it looked finished, and the rerun was refused ("already holds files")
KILLED_MIDWAY = """
import os, signal, sys
import rlhf_pipeline.storage.convert as converting
from rlhf_pipeline.cli.main import main

def die(_done, _total):
    os.kill(os.getpid(), signal.SIGKILL)

if sys.argv[1] == "store":  # after the first of the source's segments is appended
    converting.convert(sys.argv[2], sys.argv[3], "zarr", progress=lambda done, total: done >= 16 and die(done, total))
else:  # a buffer of shards: after its first shard is converted whole
    convert = converting.convert

    def convert_then_die(*args, **kwargs):
        convert(*args, **kwargs)
        die(0, 0)

    converting.convert = convert_then_die
    main(["convert", sys.argv[2], sys.argv[3], "--to", "zarr", "--quiet"])
"""


@pytest.mark.parametrize("source", ["store", "shards"])
def test_a_convert_killed_midway_leaves_no_destination_and_the_rerun_converts_every_row(tmp_path, source):
    import signal
    import subprocess
    import sys

    from rlhf_pipeline.storage.sharded import list_shards, shard_path

    src, dst = tmp_path / "src", tmp_path / "dst"
    if source == "store":
        expected = {None: _fill(str(src), "memmap")}  # 4 segments of the source: killed after the first
    else:
        expected = {k: _fill(str(shard_path(src, k)), "memmap", batches=2) for k in (0, 1)}
    killed = subprocess.run([sys.executable, "-c", KILLED_MIDWAY, source, str(src), str(dst)], capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not dst.exists()  # half a buffer never takes DST's name
    assert (tmp_path / "dst.partial").exists()  # what it was building when it died

    assert main(["convert", str(src), str(dst), "--to", "zarr", "--quiet"]) == 0  # clears what the kill left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]
    for k, rows in expected.items():
        with open_store(str(dst if k is None else shard_path(dst, k))) as store:
            assert store.backend_name == "zarr" and store.read(torch.arange(len(store))).equal(rows)
    if source == "shards":
        assert [k for k, _ in list_shards(dst)] == [0, 1]


@pytest.mark.parametrize("name", ["dst", "dst.zip"])
def test_a_convert_that_fails_midway_leaves_no_destination(tmp_path, name):
    """A source whose third segment is damaged: the error is raised after two were appended, and
    nothing is left at DST or beside it (a zip's directory store, built first, neither)."""
    from rlhf_pipeline.storage.errors import StoreError

    src, dst = tmp_path / "src", tmp_path / name
    _fill(str(src), "memmap")
    (src / "seg-00000002" / "reward.col").write_bytes(b"")  # a column file cut to nothing
    with pytest.raises(StoreError):
        convert(str(src), str(dst), "zarr")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_destination_given_with_a_trailing_slash_is_that_directory(tmp_path, capsys):
    """``convert SRC DST/`` (and ``filter``, through the same storage/new_buffer.py) built under
    ``DST/.partial``, made DST first, then refused it as "written meanwhile by another" and left it."""
    src = tmp_path / "src"
    expected = _fill(str(src), "memmap", batches=2)
    assert main(["convert", str(src), f"{tmp_path / 'dst'}/", "--to", "zarr", "--quiet"]) == 0, capsys.readouterr().err
    assert main(["filter", str(src), f"{tmp_path / 'kept'}/", "--where", "reward > -1e9", "--quiet"]) == 0, \
        capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "kept", "src"]
    for name in ("dst", "kept"):
        with open_store(str(tmp_path / name)) as store:
            assert store.read(torch.arange(len(store))).equal(expected)


@pytest.mark.parametrize("source", ["memmap", "zarr"])
def test_a_destination_ending_in_zip_is_one_zip_file_that_reads_every_row(tmp_path, capsys, source):
    """A .zip holds a Zarr store, which stores read (read-only): convert once made a directory of that name
    that nothing could open, and said the destination did not exist."""
    src, archive = str(tmp_path / "src"), tmp_path / "buffer.zip"
    expected = _fill(src, source)
    assert main(["convert", src, str(archive), "--to", "zarr", "--verify", "--quiet"]) == 0
    assert "60 rows" in capsys.readouterr().out
    assert archive.is_file() and zipfile.is_zipfile(archive)
    assert "writer.lock" not in zipfile.ZipFile(archive).namelist()  # nobody writes a zip again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["buffer.zip", "src"]  # its partial is gone
    with open_store(str(archive), mode="r") as store:
        assert store.backend_name == "zarr" and store.read(torch.arange(60)).equal(expected)
    with pytest.raises(FileExistsError):
        convert(src, str(archive), "zarr")
    with open_store(str(archive), mode="r") as store:
        assert len(store) == 60


def test_a_zip_destination_that_cannot_hold_the_buffer_is_refused_before_any_file(tmp_path, capsys):
    src = str(tmp_path / "src")
    _fill(src, "memmap", batches=1)
    assert main(["convert", src, str(tmp_path / "m.zip"), "--to", "memmap"]) == 2
    assert "a .zip holds a Zarr store, and this buffer would be memmap; give --to zarr" in capsys.readouterr().err
    run_buffer = tmp_path / "run" / "buffer"
    for k in range(2):
        _fill(str(run_buffer / f"shard-{k:04d}"), "memmap", batches=1)
    assert main(["convert", str(run_buffer), str(tmp_path / "shards.zip"), "--to", "zarr"]) == 2
    assert "a .zip holds one store, and this buffer is several" in capsys.readouterr().err
    assert main(["convert", src, "s3://bucket/buffer.zip", "--to", "zarr"]) == 2
    assert "a zipped store is written on local disk only" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "src"]


def test_a_zip_on_a_file_system_without_hard_links_is_renamed_in(tmp_path, monkeypatch):
    """Some file systems (FUSE mounts, SMB shares, exFAT) refuse ``link``; the zip is then renamed in."""
    import errno
    import os

    def no_links(*_):
        raise OSError(errno.EPERM, "Operation not permitted")

    src, archive = str(tmp_path / "src"), tmp_path / "buffer.zip"
    expected = _fill(src, "memmap", batches=2)
    monkeypatch.setattr(os, "link", no_links)
    convert(src, str(archive), "zarr")
    assert zipfile.is_zipfile(archive) and sorted(p.name for p in tmp_path.iterdir()) == ["buffer.zip", "src"]
    with open_store(str(archive), mode="r") as store:
        assert store.read(torch.arange(len(store))).equal(expected)
