"""A damaged Zarr store raises errors naming the file or chunk, and repair rebuilds its commit record.

Real stores on disk, damaged as files get damaged: a truncated or deleted root ``zarr.json``,
a flipped byte in a packed fragment, a missing unit, a unit's array metadata that only plain
zarr readers need. Chunk damage of sealed segments is in ``test_zarr.py``.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import make_batch

from rlhf_pipeline.cli.main import main
from rlhf_pipeline.schema import StoreSchema, TrajectoryBatch
from rlhf_pipeline.storage import NotAStoreError, StoreCorruptedError, create_store, open_store
from rlhf_pipeline.storage.buffers import repair_buffer, verify_buffer
from rlhf_pipeline.storage.zarr.store import ZarrTrajectoryStore
from test_zarr import assert_same_rows, read_with_plain_zarr

SCHEMA = StoreSchema(optional=("advantage",))


def fill(path, *, close: bool = True) -> tuple[TrajectoryBatch, ZarrTrajectoryStore | None]:
    """34 rows in segments of 8: four sealed segments, and a tail of two fragments while open."""
    batches = [make_batch(1, 6, seed=i, optional=("advantage",), first_group_id=i, first_trajectory_id=6 * i,
                          policy_version=i) for i in range(5)] + [make_batch(1, 4, seed=5, optional=("advantage",))]
    store = ZarrTrajectoryStore.create(str(path), SCHEMA, segment_rows=8)
    for b in batches:
        store.append(b)
    store.flush()
    if close:
        store.close()
        store = None
    return TrajectoryBatch.cat(batches), store


@pytest.mark.parametrize("damage", ["truncate", "empty", "delete", "foreign"])
def test_damaged_root_document_is_store_corrupted_and_repair_rebuilds_the_record(tmp_path, damage, capsys):
    path = tmp_path / "b"
    expected, _ = fill(path)
    root = path / "zarr.json"
    raw = root.read_bytes()
    if damage == "truncate":
        root.write_bytes(raw[: len(raw) // 2])
    elif damage == "empty":
        root.write_bytes(b"")
    elif damage == "delete":
        root.unlink()
    else:  # a valid Zarr group document without our record
        root.write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
    for mode in ("r", "a"):
        with pytest.raises(StoreCorruptedError, match="zarr.json"):
            open_store(path, mode=mode)
    assert main(["inspect", str(path)]) == 2
    assert "zarr.json" in capsys.readouterr().err
    assert main(["repair", str(path)]) == 1  # dry run
    assert "would:" in capsys.readouterr().out
    report, = repair_buffer(str(path), apply=True)
    assert report.rows_after == 34 and not report.unrecoverable, report
    with open_store(path) as reader:
        assert reader.read(torch.arange(34)).equal(expected)
        assert reader.schema == SCHEMA and reader.segment_rows == 8
    with open_store(path, mode="a") as writer:  # the rebuilt store takes appends again
        writer.append(make_batch(1, 2, seed=7, optional=("advantage",)))
    report, = verify_buffer(str(path))
    assert report.ok, report.problems


def test_a_repaired_record_keeps_a_damaged_unit_published_as_lost_and_what_follows(tmp_path):
    path = tmp_path / "b"
    expected, _ = fill(path)
    (path / "zarr.json").unlink()
    chunk = path / "units" / "000000000000016-0000000008s" / "values" / "c.0"
    chunk.write_bytes(chunk.read_bytes()[:-7])
    report, = repair_buffer(str(path), apply=True)
    assert report.rows_after == 34  # rows 16..23 stay published (reads raise), the rows after keep their ids
    assert any("000000000000016-0000000008s" in u for u in report.unrecoverable)
    readable = torch.cat([torch.arange(16), torch.arange(24, 34)])
    with open_store(path) as reader:
        assert reader.read(readable).equal(expected.select(readable))
        with pytest.raises(StoreCorruptedError, match="000000000000016-0000000008s"):
            reader.read([17])


def test_flipped_byte_in_a_live_writers_fragment_names_the_chunk(tmp_path, capsys):
    path = tmp_path / "b"
    expected, writer = fill(path, close=False)
    try:
        fragment = next(p for p in (path / "units").iterdir() if p.name.endswith("f"))
        chunk = fragment / "c.0"
        data = bytearray(chunk.read_bytes())
        data[len(data) // 2] ^= 0x01
        chunk.write_bytes(bytes(data))
        with ZarrTrajectoryStore.open(str(path)) as reader:
            with pytest.raises(StoreCorruptedError, match=f"{fragment.name}/c.0 fails its crc32c"):
                reader.read([33])
            assert reader.read(torch.arange(32)).equal(expected.select(torch.arange(32)))
        assert main(["inspect", str(path), "--verify"]) == 1
        assert f"{fragment.name}/c.0 fails its crc32c" in capsys.readouterr().out
        report, = repair_buffer(str(path))  # the record is intact: damage it cannot fix, named
        assert not report.actions and any(f"{fragment.name}/c.0" in u for u in report.unrecoverable)
    finally:
        writer.close()


def test_verify_of_a_healthy_store_checks_every_unit(tmp_path, capsys):
    path = tmp_path / "b"
    fill(path)
    assert main(["inspect", str(path), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "checked 5 units, 5 units with checksums, 34 rows" in out and "no damage found" in out


def test_create_on_a_file_says_it_is_a_file(tmp_path):
    file = tmp_path / "buffer"
    file.write_text("not a directory")
    for backend in ("zarr", "memmap"):
        with pytest.raises(FileExistsError, match="is a file"):
            create_store(file, backend)
    with pytest.raises(NotAStoreError, match="is a file"):
        ZarrTrajectoryStore.open(str(file))
    assert file.read_text() == "not a directory"


def test_repair_without_a_record_keeps_every_readable_row_and_appends_reuse_no_row_id(tmp_path):
    path = tmp_path / "b"
    expected, _ = fill(path)
    (path / "zarr.json").unlink()
    shutil.rmtree(path / "units" / "000000000000008-0000000008s")  # a sealed segment deleted by hand
    report, = repair_buffer(str(path), apply=True)
    assert report.rows_after == 34  # rows 8..15 stay published as lost: the rows after keep their ids
    assert any("000000000000008-0000000008s" in u or "rows 8..15" in u for u in report.unrecoverable)
    assert not list(path.glob("repair-*/0*"))  # no readable unit was moved aside
    readable = torch.tensor([0, 7, 16, 23, 24, 33])
    with open_store(path) as reader:
        assert len(reader) == 34
        assert reader.read(readable).equal(expected.select(readable))
        with pytest.raises(StoreCorruptedError):
            reader.read([9])
    with open_store(path, mode="a") as writer:
        writer.append(make_batch(1, 2, seed=7, optional=("advantage",)))
        assert len(writer) == 36 and writer.read(readable).equal(expected.select(readable))


def test_repair_never_publishes_a_unit_past_an_intact_record(tmp_path, capsys):
    path = tmp_path / "b"
    expected, _ = fill(path)
    record = (path / "zarr.json").read_bytes()
    writer = ZarrTrajectoryStore.open(str(path), mode="a")
    try:
        writer.append(make_batch(1, 3, seed=9, optional=("advantage",)))  # then its publish is undone: as if
        (path / "zarr.json").write_bytes(record)  # the writer had been killed just before it
        assert main(["repair", str(path)]) == 0  # a dry run: it takes no lock
        out = capsys.readouterr().out
        assert "nothing to repair" in out and "000000000000034-0000000003f" in out, out
        with open_store(path) as reader:
            assert len(reader) == 34 and reader.read(torch.arange(34)).equal(expected)
    finally:
        writer.close()


def test_damaged_unit_metadata_is_reported_and_repair_lets_plain_zarr_read_the_store_again(tmp_path, capsys):
    """This library reads units without their zarr.json; plain zarr cannot: damage there was silent."""
    path = tmp_path / "b"
    expected, _ = fill(path)  # four sealed segments and one fragment
    units = path / "units"
    damaged = {  # file -> how it is damaged
        "units/000000000000000-0000000008s/values/zarr.json": "flip",  # still JSON: a shape one digit off
        "units/000000000000008-0000000008s/rows/zarr.json": "truncate",
        "units/000000000000016-0000000008s/zarr.json": "not json",
        "units/000000000000032-0000000002f/zarr.json": "delete",
        "units/zarr.json": "delete",
    }
    written = {key: (path / key).read_bytes() for key in damaged}
    for key, how in damaged.items():
        raw = written[key]
        if how == "flip":
            at = raw.index(b"]", raw.index(b'"shape":[')) - 1  # the shape's last digit, one bit off
            (path / key).write_bytes(raw[:at] + bytes([raw[at] ^ 0x01]) + raw[at + 1:])
        elif how == "truncate":
            (path / key).write_bytes(raw[: len(raw) // 2])
        elif how == "not json":
            (path / key).write_bytes(b"\x00" * len(raw))
        else:
            (path / key).unlink()
    with open_store(path) as reader:  # our reads never needed them
        assert reader.read(torch.arange(34)).equal(expected)

    assert main(["inspect", str(path), "--verify"]) == 1
    out = capsys.readouterr().out
    assert "5 problem(s)" in out and all(f"{path}/{key} " in out for key in damaged), out
    assert "values/zarr.json (unit 000000000000000-0000000008s's metadata) does not describe what the unit holds " \
           "(its shape differs)" in out, out
    assert main(["repair", str(path)]) == 1  # a dry run
    assert "would: rewrite 5 metadata file(s)" in capsys.readouterr().out
    assert main(["repair", str(path), "--apply"]) == 0
    assert "did: rewrite 5 metadata file(s)" in capsys.readouterr().out
    assert {key: (path / key).read_bytes() for key in damaged} == written  # what the writer wrote, byte for byte
    assert [r.problems for r in verify_buffer(str(path))] == [[]]
    assert_same_rows(read_with_plain_zarr(path, tmp_path), expected)
    assert not list(units.glob("*.partial")) and not list(units.glob("*/*.partial"))


def test_verify_tells_a_live_writers_unpublished_units_from_a_stopped_writers_leftovers(tmp_path, capsys):
    """Units past the record are a live writer's append in flight while it holds the writer lock; only
    without one are they leftovers of a writer stopped before its publish."""
    import os

    path, stopped_copy = tmp_path / "b", tmp_path / "copy"
    _, writer = fill(path, close=False)
    try:
        record = (path / "zarr.json").read_bytes()
        writer.append(make_batch(1, 3, seed=9, optional=("advantage",)))
        (path / "zarr.json").write_bytes(record)  # its publish undone: the unit it wrote is past the record
        shutil.copytree(path, stopped_copy)  # the same files, and no process holding the copy's lock
        assert main(["inspect", "--verify", str(path)]) == 0
        live = capsys.readouterr().out
    finally:
        writer.close()
    assert main(["inspect", "--verify", str(stopped_copy)]) == 0
    stopped = capsys.readouterr().out
    assert f"being written by the live writer, process {os.getpid()} on" in live and "leftovers" not in live, live
    assert "a writer's leftovers: a writer was stopped before publishing them" in stopped, stopped
