"""Stores written by the library before checksums and Zarr format 2 stay readable, writable and checkable.

``tests/data/format1-stores.tar.gz`` holds stores the previous library wrote (see
``tests/data/make_format1_stores.py``): a memmap store (no field layout in its manifest, no
checksums), a closed Zarr format 1 store (per-field sealed segments and fragment) and one
copied while its writer was live (a packed fragment). Their rows are ``make_batch`` rows with
known seeds, so every read is checked value for value.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from helpers import make_batch

from rlhf_pipeline.schema import TrajectoryBatch
from rlhf_pipeline.storage import open_store
from rlhf_pipeline.storage.buffers import buffer_stats, verify_buffer

ARCHIVE = Path(__file__).resolve().parents[1] / "data" / "format1-stores.tar.gz"


def written_rows() -> TrajectoryBatch:
    return TrajectoryBatch.cat([make_batch(2, 3, seed=i, optional=("advantage",), first_group_id=2 * i,
                                           first_trajectory_id=6 * i, policy_version=i) for i in range(3)])


@pytest.fixture
def old_stores(tmp_path) -> Path:
    with tarfile.open(ARCHIVE) as tar:
        tar.extractall(tmp_path, filter="data")
    return tmp_path


@pytest.mark.parametrize("name", ["memmap", "zarr-closed", "zarr-packed"])
def test_old_stores_read_append_and_verify(old_stores, name):
    path = old_stores / name
    expected = written_rows()
    with open_store(path) as reader:
        assert reader.read(torch.arange(18)).equal(expected)
        assert reader.read_padded(torch.tensor([17, 0, 9])).batch_size == torch.Size([3])
    stats = buffer_stats(str(path))  # inspect, without torch
    assert (stats.rows, stats.groups, stats.policy_versions) == (18, 6, {0: 6, 1: 6, 2: 6})
    report, = verify_buffer(str(path))
    assert report.ok and any("without checksums" in n or "no checksums" in n for n in report.notes), report
    more = make_batch(2, 4, seed=5, optional=("advantage",), first_group_id=10, first_trajectory_id=100)
    with open_store(path, mode="a") as writer:  # a writer carries on in today's format
        writer.append(more)
    with open_store(path) as reader:
        assert reader.read(torch.arange(26)).equal(TrajectoryBatch.cat([expected, more]))
    report, = verify_buffer(str(path))
    assert report.ok, report.problems
    if name == "memmap":  # the writer recorded the field layout; the segment it sealed has checksums
        assert "fields" in json.loads((path / "manifest.json").read_text())
        assert (path / "seg-00000002" / "checksums.json").exists()
        assert not (path / "seg-00000000" / "checksums.json").exists()
    else:
        record = json.loads((path / "zarr.json").read_text())["attributes"]["rlhf_pipeline"]
        assert record["format_version"] == 2 and record["units"][0][2] == 1  # old units kept as they were


def test_a_truncated_format1_blosc_chunk_is_caught_without_a_checksum(old_stores):
    path = old_stores / "zarr-closed"
    chunk = path / "units" / "000000000000000-0000000008" / "response_tokens" / "c.0"
    chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])
    from rlhf_pipeline.storage import StoreCorruptedError

    with open_store(path) as reader:
        with pytest.raises(StoreCorruptedError, match=r"000000000000000-0000000008/response_tokens/c.0"):
            reader.read([2])
        assert reader.read(torch.arange(8, 18)).equal(written_rows().select(torch.arange(8, 18)))


def test_plain_zarr_reads_format1_units(old_stores, tmp_path):
    from test_zarr import PLAIN_READER, assert_same_rows

    script = tmp_path / "plain.py"
    script.write_text(PLAIN_READER)
    for name, kinds in (("zarr-closed", [1, 1, 0]), ("zarr-packed", [1, 1, 2])):
        out = subprocess.run([sys.executable, str(script), str(old_stores / name)], capture_output=True, text=True,
                             check=True, cwd=tmp_path)
        got = json.loads(out.stdout)
        assert got["kinds"] == kinds
        assert_same_rows(got, written_rows())


def test_repair_rebuilds_the_record_of_a_format1_store(old_stores):
    from rlhf_pipeline.storage.buffers import repair_buffer

    path = old_stores / "zarr-closed"
    (path / "zarr.json").unlink()
    report, = repair_buffer(str(path), apply=True)
    assert report.rows_after == 18 and not report.unrecoverable, report
    with open_store(path) as reader:  # its units as they were: per-field sealed segments and fragment
        assert [u.kind for u in reader.units] == [1, 1, 0]
        assert reader.read(torch.arange(18)).equal(written_rows())



def test_repair_rewrites_the_damaged_array_metadata_of_format1_units(old_stores):
    from rlhf_pipeline.storage.buffers import repair_buffer

    damaged = [old_stores / "zarr-closed" / "units" / "000000000000008-0000000008" / "response_tokens" / "zarr.json",
               old_stores / "zarr-closed" / "units" / "000000000000016-0000000002" / "done" / "zarr.json",
               old_stores / "zarr-packed" / "units" / "000000000000016-0000000002p" / "zarr.json"]
    written = [p.read_bytes() for p in damaged]
    damaged[0].unlink()
    damaged[1].write_bytes(written[1].replace(b'"fill_value":false', b'"fill_value":true'))
    damaged[2].write_bytes(written[2][:-9])
    for name, count in (("zarr-closed", 2), ("zarr-packed", 1)):
        report, = verify_buffer(str(old_stores / name))
        assert len(report.problems) == count and all("metadata" in p for p in report.problems), report.problems
        report, = repair_buffer(str(old_stores / name), apply=True)
        assert not report.unrecoverable and f"rewrite {count} metadata file(s)" in report.actions[0], report
        assert verify_buffer(str(old_stores / name))[0].ok
    assert [p.read_bytes() for p in damaged] == written  # as the format 1 writer wrote them
