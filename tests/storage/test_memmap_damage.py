"""A damaged memmap store never reads as shorter or empty without a word, and repair rebuilds it.

Every test damages a real store on disk the way the files get damaged in practice (a flipped
byte, a truncated or deleted file, a deleted segment directory), then checks what readers,
writers, ``inspect --verify`` and ``repair`` do.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import warnings

import pytest
import torch
from helpers import make_batch

from rlhf_pipeline.cli.main import main
from rlhf_pipeline.schema import StoreSchema, TrajectoryBatch
from rlhf_pipeline.storage import (
    NotAStoreError,
    StoreCorruptedError,
    StoreDamageWarning,
    create_store,
    open_store,
)
from rlhf_pipeline.storage.buffers import repair_buffer
from rlhf_pipeline.storage.memmap.store import MemmapTrajectoryStore

SCHEMA = StoreSchema(optional=("advantage",))
SEGMENT_ROWS = 8


def flip(path, offset: int, mask: int = 0x40) -> None:
    """Flips bits of one byte (``offset`` from the end when negative): silent bit rot."""
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


def slot_payload(path) -> tuple[int, bytes]:
    """``(offset past its end, payload)`` of a state slot: a slot file rewritten in place may hold
    stale bytes of a longer earlier publish after its payload."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[16:24], "little")
    return 24 + length, raw[24 : 24 + length]


def digest(directory) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("seg-*/*"))}


def fill(path, appends: int = 5, rows: int = 6) -> TrajectoryBatch:
    """``appends`` publishes of ``rows`` rows (30 rows: three sealed segments of 8 and a tail of 6)."""
    batches = [make_batch(1, rows, seed=i, optional=("advantage",), first_group_id=i, first_trajectory_id=rows * i,
                          policy_version=i) for i in range(appends)]
    with MemmapTrajectoryStore.create(path, SCHEMA, segment_rows=SEGMENT_ROWS) as store:
        for b in batches:
            store.append(b)
    return TrajectoryBatch.cat(batches)


@pytest.fixture
def store_path(tmp_path):
    return tmp_path / "buffer"


def test_damaged_newest_slot_rolls_back_with_a_warning_and_a_writer_refuses(store_path, capsys):
    expected = fill(store_path)
    newest = max((store_path / f"state.{i}" for i in (0, 1)), key=lambda p: json.loads(slot_payload(p)[1])["next_row"])
    flip(newest, slot_payload(newest)[0] - 20)  # inside the payload: the CRC fails, the header (publish 5) is intact
    files = digest(store_path)
    with pytest.warns(StoreDamageWarning, match=r"rows 30 -> 24 \(rolled back\)") as caught:
        reader = open_store(store_path)
    assert str(newest) in str(caught[0].message)
    with reader:
        assert len(reader) == 24  # the older publish, said out loud
        assert reader.read(torch.arange(24)).equal(expected.select(torch.arange(24)))
    with pytest.raises(StoreCorruptedError, match="A writer refuses"):
        open_store(store_path, mode="a")
    assert digest(store_path) == files  # nothing the damaged slot published was truncated or deleted
    assert not (store_path / "writer.lock").exists() or (store_path / "writer.lock").read_text() == ""

    assert main(["inspect", str(store_path), "--verify"]) == 1
    assert "rows 30 -> 24 (rolled back)" in capsys.readouterr().out
    assert main(["repair", str(store_path)]) == 1  # dry run: something to do, nothing written
    out = capsys.readouterr().out
    assert "24 rows published before, 30 rows after" in out and "would:" in out
    assert digest(store_path) == files
    assert main(["repair", str(store_path), "--apply"]) == 0
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no damage left to warn about
        with open_store(store_path, mode="a") as writer:
            assert writer.read(torch.arange(30)).equal(expected)
            writer.append(make_batch(1, 2, seed=9, optional=("advantage",)))
    assert main(["repair", str(store_path)]) == 0  # nothing left to repair
    assert "nothing to repair" in capsys.readouterr().out
    assert any(p.name.startswith("repair-") for p in store_path.iterdir())  # the damaged slot, kept


def test_both_slots_damaged_raise_naming_both_files_and_nothing_is_deleted(store_path):
    expected = fill(store_path)
    for i in (0, 1):
        flip(store_path / f"state.{i}", slot_payload(store_path / f"state.{i}")[0] - 5)
    files = digest(store_path)
    for mode in ("r", "a"):
        with pytest.raises(StoreCorruptedError, match=r"state\.0 and .*state\.1") as raised:
            open_store(store_path, mode=mode)
        assert "repair" in str(raised.value)
    assert digest(store_path) == files  # a refused writer deleted no segment
    report, = repair_buffer(str(store_path), apply=True)
    assert report.rows_before is None and report.rows_after == 30 and not report.unrecoverable
    with open_store(store_path) as reader:
        assert reader.read(torch.arange(30)).equal(expected)


@pytest.mark.parametrize("damage", ["truncate", "empty", "garbage", "delete"])
def test_damaged_manifest_is_store_corrupted_naming_it_and_repair_rebuilds_it(store_path, damage):
    expected = fill(store_path)
    manifest = store_path / "manifest.json"
    raw = manifest.read_bytes()
    if damage == "truncate":
        manifest.write_bytes(raw[: len(raw) // 2])
    elif damage == "empty":
        manifest.write_bytes(b"")
    elif damage == "garbage":
        manifest.write_bytes(b"\x00\xff" * 40)
    else:
        manifest.unlink()
    with pytest.raises(StoreCorruptedError, match="manifest.json"):
        open_store(store_path)
    with pytest.raises(StoreCorruptedError, match="manifest.json"):
        open_store(store_path, mode="a")
    report, = repair_buffer(str(store_path), apply=True)
    assert report.rows_after == 30 and not report.unrecoverable, report
    with open_store(store_path) as reader:
        assert reader.read(torch.arange(30)).equal(expected)
        assert reader.schema == SCHEMA


def test_flipped_end_offset_names_segment_and_field_and_other_segments_read(store_path, capsys):
    expected = fill(store_path)
    ends = store_path / "seg-00000001" / "response_tokens.ends"
    flip(ends, 8 * 3 + 6)  # a high byte of row 3's end offset: far beyond the values
    with open_store(store_path) as reader:
        with pytest.raises(StoreCorruptedError, match=r"seg-00000001.*response_tokens"):
            reader.read([8 + 3])
        with pytest.raises(StoreCorruptedError, match=r"seg-00000001.*response_tokens"):
            reader.read_padded([8 + 1, 0])
        others = torch.tensor([0, 7, 16, 29, 23])
        assert reader.read(others).equal(expected.select(others))
        reader.read_padded(others)
    assert main(["inspect", str(store_path), "--verify"]) == 1
    out = capsys.readouterr().out
    assert "response_tokens.ends" in out and "crc32c" in out
    report, = repair_buffer(str(store_path))
    assert any("response_tokens.ends" in u for u in report.unrecoverable)


def test_flipped_end_offset_in_the_open_segment_is_caught_without_a_checksum(store_path):
    fill(store_path)
    flip(store_path / "seg-00000003" / "prompt_tokens.ends", 8 * 2 + 7, 0x80)  # negative end offset
    with open_store(store_path) as reader:
        with pytest.raises(StoreCorruptedError, match=r"seg-00000003.*prompt_tokens"):
            reader.read([24 + 2])
        with pytest.raises(StoreCorruptedError, match=r"seg-00000003.*prompt_tokens"):
            reader.read_padded([24 + 3])
        assert len(reader.read(torch.arange(24))) == 24


def test_silent_bit_rot_in_values_is_caught_by_the_checksum(store_path, capsys):
    expected = fill(store_path)
    flip(store_path / "seg-00000000" / "response_log_probs.values", 11)
    flip(store_path / "seg-00000002" / "reward.col", 2)
    with open_store(store_path) as reader:
        with pytest.raises(StoreCorruptedError, match=r"seg-00000000/response_log_probs.values fails its crc32c"):
            reader.read([1])
        with pytest.raises(StoreCorruptedError, match=r"seg-00000002/reward.col"):
            reader.read_padded([17])
        middle = torch.arange(8, 16)
        assert reader.read(middle).equal(expected.select(middle))
    assert main(["inspect", str(store_path), "--verify", "--json"]) == 1
    report, = json.loads(capsys.readouterr().out)
    assert len(report["problems"]) == 2 and not report["ok"]


def test_deleted_segment_directory_names_segment_and_field(store_path, capsys):
    expected = fill(store_path)
    shutil.rmtree(store_path / "seg-00000001")
    with open_store(store_path) as reader:
        with pytest.raises(StoreCorruptedError, match=r"segment seg-00000001 .*directory is missing"):
            reader.read([9])
        with pytest.raises(StoreCorruptedError, match="seg-00000001"):
            reader.read_padded([10])
        others = torch.tensor([0, 5, 16, 29])
        assert reader.read(others).equal(expected.select(others))
        assert reader.read_padded(others).batch_size == torch.Size([4])
    assert main(["inspect", str(store_path), "--verify"]) == 1
    assert "seg-00000001 is missing: rows 8..15 are lost" in capsys.readouterr().out
    report, = repair_buffer(str(store_path), apply=True)
    assert any("rows 8..15 are lost" in u for u in report.unrecoverable)
    with open_store(store_path) as reader:  # still published: later segments stay readable
        assert len(reader) == 30


def test_a_failed_open_for_append_leaves_the_directory_as_it_was(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(NotAStoreError):
        open_store(empty, mode="a", backend="memmap")
    assert list(empty.iterdir()) == []
    create_store(empty, "memmap").close()  # no leftover writer.lock in the way


def unacknowledged_append(path, segment_rows: int, published_rows: int, appended_rows: int,
                          complete_rows: int | None = None) -> TrajectoryBatch:
    """A store whose last append was written but never published: a writer killed before its publish.

    The state slots are put back as they were before the append (both intact); with
    ``complete_rows`` only that many of the appended rows are complete in the files (killed mid-write).
    """
    first = make_batch(1, published_rows, seed=1, optional=("advantage",))
    with MemmapTrajectoryStore.create(path, SCHEMA, segment_rows=segment_rows) as store:
        store.append(first)
        slots = {i: (path / f"state.{i}").read_bytes() if (path / f"state.{i}").exists() else None for i in (0, 1)}
        store.append(make_batch(1, appended_rows, seed=2, optional=("advantage",), first_trajectory_id=100))
    for i, raw in slots.items():
        if raw is None:
            (path / f"state.{i}").unlink()
        else:
            (path / f"state.{i}").write_bytes(raw)
    if complete_rows is not None:  # the tail segment holds the first rows of the append only
        tail = path / "seg-00000000"
        keep = published_rows + complete_rows
        for file in tail.iterdir():
            if file.suffix == ".ends":
                file.write_bytes(file.read_bytes()[: keep * 8])
            elif file.suffix == ".col":
                file.write_bytes(file.read_bytes()[: keep * (file.stat().st_size // (published_rows + appended_rows))])
    return first


def test_repair_beside_a_live_writer_calls_its_rows_in_flight_not_a_killed_writers(tmp_path, capsys):
    """Rows past the published end while a writer holds the lock are its append in flight (they were
    called "a writer was killed before publishing them"); ``--apply`` is refused in one line."""
    import os

    from rlhf_pipeline.storage.locking import WriterLock

    path = tmp_path / "buffer"
    unacknowledged_append(path, 64, 10, 30, 20)
    lock = WriterLock(path / "writer.lock")  # as a writer holds it between writing rows and publishing them
    with lock:
        assert main(["repair", str(path)]) == 0
        live = capsys.readouterr().out
    assert main(["repair", str(path)]) == 0
    stopped = capsys.readouterr().out
    assert f"being appended by the live writer, process {os.getpid()} on" in live and "killed" not in live, live
    assert "a writer was killed before publishing them" in stopped, stopped
    (path / "state.0").write_bytes(b"damaged")  # something to repair, which --apply may not write now
    with lock:
        assert main(["repair", str(path), "--apply"]) == 2
        refused = capsys.readouterr().err
    assert len(refused.strip().splitlines()) == 1 and f"process {os.getpid()}" in refused, refused
    assert "mode=" not in refused and "nothing was written" in refused, refused


@pytest.mark.parametrize("appended, complete", [(30, 20), (30, None)])
def test_repair_never_publishes_rows_past_an_intact_publish(tmp_path, capsys, appended, complete):
    path = tmp_path / "buffer"
    if complete is not None:  # 20 rows of a 30-row append in the open segment
        published = unacknowledged_append(path, 64, 10, appended, complete)
    else:  # a whole append that filled the open segment and two more
        published = unacknowledged_append(path, SEGMENT_ROWS, 6, appended)
    assert main(["repair", str(path)]) == 0  # the record is intact: nothing to repair
    out = capsys.readouterr().out
    assert "nothing to repair" in out and "never acknowledged" in out, out
    assert main(["repair", str(path), "--apply"]) == 0
    capsys.readouterr()
    with open_store(path) as reader:
        assert len(reader) == len(published)
        assert reader.read(torch.arange(len(published))).equal(published)
    with open_store(path, mode="a") as writer:  # the collector writes the unacknowledged round again
        writer.append(make_batch(1, appended, seed=2, optional=("advantage",), first_trajectory_id=100))
        assert len(writer) == len(published) + appended
    assert main(["inspect", str(path), "--verify"]) == 0


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_repair_without_a_record_keeps_every_readable_row_and_appends_reuse_no_row_id(store_path, damage):
    expected = fill(store_path)
    for i in (0, 1):
        (store_path / f"state.{i}").unlink()  # no record: the manifest alone says 0 rows
    if damage == "deleted":
        shutil.rmtree(store_path / "seg-00000001")
    else:
        ends = store_path / "seg-00000001" / "response_tokens.ends"
        ends.write_bytes(ends.read_bytes()[: 8 * 3])
    report, = repair_buffer(str(store_path), apply=True)
    assert report.rows_after == 30, report  # rows 8..15 stay published as lost: the rows after keep their ids
    assert any("seg-00000001" in u for u in report.unrecoverable)
    assert not list(store_path.glob("repair-*/seg-*"))  # no readable segment was moved aside
    readable = torch.tensor([0, 7, 16, 23, 24, 29])
    with open_store(store_path) as reader:
        assert len(reader) == 30
        assert reader.read(readable).equal(expected.select(readable))
        with pytest.raises(StoreCorruptedError, match="seg-00000001"):
            reader.read([9])
    with open_store(store_path, mode="a") as writer:
        writer.append(make_batch(1, 2, seed=7, optional=("advantage",)))
        assert len(writer) == 32 and writer.read(readable).equal(expected.select(readable))


@pytest.mark.parametrize("name, offset", [("response_log_probs.values", 5), ("reward.col", 4 * 3 + 1)])
def test_flipped_byte_in_the_open_segment_raises_on_read_and_is_caught_by_verify(store_path, capsys, name, offset):
    expected = fill(store_path)  # rows 24..29 in the open segment seg-00000003
    assert main(["inspect", str(store_path), "--verify"]) == 0
    assert "checked for structure only" not in capsys.readouterr().out
    flip(store_path / "seg-00000003" / name, offset)  # a wrong value that no structural check can see
    with open_store(store_path) as reader:
        for read in (reader.read, reader.read_padded):
            with pytest.raises(StoreCorruptedError, match=rf"seg-00000003/{name} fails its crc32c"):
                read([24])
        assert reader.read(torch.arange(24)).equal(expected.select(torch.arange(24)))  # other segments read
    assert main(["inspect", str(store_path), "--verify"]) == 1
    assert f"seg-00000003/{name} fails its crc32c" in capsys.readouterr().out


def test_bytes_flipped_under_a_live_reader_are_caught_when_the_next_publish_is_read(store_path):
    rows = fill(store_path)
    more = make_batch(1, 1, seed=7, optional=("advantage",))
    # the open segment's response tokens: rows 24..29, then the row appended below
    tokens = len(rows.select(torch.arange(24, 30))["response_tokens"].values) + len(more["response_tokens"].values)
    with open_store(store_path) as reader, open_store(store_path, mode="a") as writer:
        reader.read_padded([25])  # the open segment is mapped and checked
        writer.append(more)  # published, not yet read
        flip(store_path / "seg-00000003" / "response_tokens.values", 4 * tokens - 1)  # a byte it published
        reader.refresh()
        with pytest.raises(StoreCorruptedError, match=r"seg-00000003/response_tokens.values fails its crc32c"):
            reader.read_padded([30])


def test_verify_of_a_live_writers_open_segment_is_clean(store_path, capsys):
    fill(store_path)
    with open_store(store_path, mode="a") as writer:  # reopened: the checksums are taken from the files
        for seed in range(3):
            writer.append(make_batch(1, 1, seed=seed, optional=("advantage",)))
            assert main(["inspect", str(store_path), "--verify"]) == 0, capsys.readouterr().out
    assert main(["inspect", str(store_path), "--verify"]) == 0


def test_a_byte_damaged_in_the_open_segment_is_not_sealed_as_right(store_path):
    expected = fill(store_path)  # rows 24..29 in the open segment
    flip(store_path / "seg-00000003" / "reward.col", 4 * 2 + 1)  # row 26, before its segment is sealed
    with open_store(store_path, mode="a") as writer:
        writer.append(make_batch(1, 2, seed=8, optional=("advantage",)))  # fills and seals seg-00000003
    with open_store(store_path) as reader:
        with pytest.raises(StoreCorruptedError, match=r"seg-00000003/reward.col fails its crc32c"):
            reader.read([26])
        assert reader.read(torch.arange(24)).equal(expected.select(torch.arange(24)))
