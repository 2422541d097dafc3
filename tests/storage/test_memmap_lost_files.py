"""Files of a memmap store lost outside this library are damage, never an empty or shorter store.

A deleted state slot used to open as an empty store (both gone) or as the older publish (the newest
gone), and a writer opened on it then deleted or overwrote published rows; a deleted
``checksums.json`` left its sealed segment unprotected without a word. Each test deletes real files
of a real store and checks what readers, writers, ``inspect --verify`` and ``repair`` do.
"""

from __future__ import annotations

import json
import tarfile
import warnings
from pathlib import Path

import pytest
import torch
from helpers import make_batch
from test_memmap_damage import digest

from rlhf_pipeline.cli.main import main
from rlhf_pipeline.schema import StoreSchema, TrajectoryBatch
from rlhf_pipeline.storage import StoreCorruptedError, StoreDamageWarning, open_store
from rlhf_pipeline.storage.memmap.store import MemmapTrajectoryStore

SEGMENT_ROWS = 64
OLD_STORES = Path(__file__).resolve().parents[1] / "data" / "format1-stores.tar.gz"


def fill(path, appends: int = 10, rows: int = 50) -> TrajectoryBatch:
    """500 rows in 10 publishes: seven sealed segments of 64 and a tail of 52."""
    batches = [make_batch(1, rows, seed=i, first_group_id=i, first_trajectory_id=rows * i) for i in range(appends)]
    with MemmapTrajectoryStore.create(path, StoreSchema(), segment_rows=SEGMENT_ROWS) as store:
        for batch in batches:
            store.append(batch)
    return TrajectoryBatch.cat(batches)


def newest_slot(path) -> Path:
    return max((path / f"state.{i}" for i in (0, 1)), key=lambda p: int.from_bytes(p.read_bytes()[8:16], "little"))


def assert_refused_and_untouched(path, slot_named: str) -> None:
    """Readers and writers raise naming the slot and the fix; nothing on disk changes."""
    files = digest(path)
    for mode in ("r", "a"):
        with pytest.raises(StoreCorruptedError, match=slot_named) as raised:
            open_store(path, mode=mode)
        assert f"repair {path} --apply" in str(raised.value)
    assert digest(path) == files  # a refused writer deleted and truncated nothing


@pytest.mark.parametrize("lost", ["newest", "both"])
def test_a_lost_state_slot_is_loud_and_repair_publishes_every_row(tmp_path, capsys, lost):
    path = tmp_path / "buffer"
    expected = fill(path)
    slots = [newest_slot(path)] if lost == "newest" else [path / "state.0", path / "state.1"]
    for slot in slots:
        slot.unlink()
    assert_refused_and_untouched(path, rf"{slots[-1].name} (is|are) missing")
    assert main(["inspect", str(path), "--verify"]) == 1
    assert f"{slots[-1]}" in capsys.readouterr().out

    assert main(["repair", str(path)]) == 1  # dry run: nothing written
    out = capsys.readouterr().out
    before = "450 rows" if lost == "newest" else "0 rows"
    assert f"{before} published before, 500 rows after" in out and "lost state slot" in out, out
    assert main(["repair", str(path), "--apply"]) == 0
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with open_store(path, mode="a") as writer:  # the rows the lost publish covered are kept, not overwritten
            assert writer.read(torch.arange(500)).equal(expected)
            writer.append(make_batch(1, 3, seed=99, first_trajectory_id=1000))
    with open_store(path) as reader:
        assert len(reader) == 503 and reader.read(torch.arange(500)).equal(expected)
    assert main(["inspect", str(path), "--verify"]) == 0
    assert main(["repair", str(path)]) == 0  # nothing left to repair


@pytest.mark.parametrize("damage", ["older slot of an old store deleted", "newest slot emptied"])
def test_a_lost_slot_is_told_by_the_other_slots_publish_number(tmp_path, capsys, damage):
    """Publish ``n >= 2`` in one slot means the other held ``n - 1`` or ``n + 1``: without the
    manifest's word (stores made before slot files were created with the store) too."""
    if damage.startswith("older"):
        with tarfile.open(OLD_STORES) as tar:
            tar.extractall(tmp_path, filter="data")
        path = tmp_path / "memmap"
        older = min((path / f"state.{i}" for i in (0, 1)), key=lambda p: int.from_bytes(p.read_bytes()[8:16], "little"))
        older.unlink()
        assert_refused_and_untouched(path, rf"{older.name} is missing, but .* holds publish")
    else:
        path = tmp_path / "buffer"
        fill(path)
        newest = newest_slot(path)
        newest.write_bytes(b"")
        assert_refused_and_untouched(path, rf"{newest.name} is empty")
    capsys.readouterr()
    assert main(["repair", str(path), "--apply", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report[0]["rows_after"] == (18 if damage.startswith("older") else 500), report
    with open_store(path) as reader:
        assert len(reader) == report[0]["rows_after"]


def test_a_store_made_before_slot_files_is_damaged_when_its_files_hold_rows_no_slot_publishes(tmp_path):
    """A store made before slot files were created with it: no slot and no row past the manifest is a
    store never appended to (a writer records the slot files); no slot and rows in the files is damage."""
    path = tmp_path / "buffer"
    fill(path, appends=2)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest.pop("state_slot_files_created", None)  # as a library before it wrote it
    (path / "manifest.json").write_text(json.dumps(manifest))
    for i in (0, 1):
        (path / f"state.{i}").unlink()
    assert_refused_and_untouched(path, "hold 100 complete row")

    fresh = tmp_path / "fresh"
    MemmapTrajectoryStore.create(fresh, StoreSchema(), segment_rows=SEGMENT_ROWS).close()
    for i in (0, 1):
        (fresh / f"state.{i}").unlink()
    (fresh / "manifest.json").write_text(json.dumps({k: v for k, v in json.loads(
        (fresh / "manifest.json").read_text()).items() if k != "state_slot_files_created"}))
    with open_store(fresh) as reader:
        assert len(reader) == 0
    with open_store(fresh, mode="a") as writer:  # brings it to today's layout
        writer.append(make_batch(1, 2))
    assert json.loads((fresh / "manifest.json").read_text())["state_slot_files_created"] is True
    assert (fresh / "state.0").exists() and (fresh / "state.1").exists()


def test_a_deleted_checksums_file_is_found_by_verify_and_recorded_again_by_repair(tmp_path, capsys):
    path = tmp_path / "buffer"
    expected = fill(path)
    checksums = path / "seg-00000002" / "checksums.json"
    recorded = checksums.read_bytes()
    checksums.unlink()
    with open_store(path) as reader:
        with pytest.warns(StoreDamageWarning, match=r"seg-00000002/checksums.json is missing"):
            rows = reader.read(torch.arange(128, 140))
        assert rows.equal(expected.select(torch.arange(128, 140)))  # the files themselves are intact
    assert main(["inspect", str(path), "--verify"]) == 1
    assert "seg-00000002/checksums.json is missing" in capsys.readouterr().out
    assert main(["repair", str(path)]) == 1
    assert "record " in capsys.readouterr().out and not checksums.exists()  # a dry run writes nothing
    assert main(["repair", str(path), "--apply"]) == 0
    assert checksums.read_bytes() == recorded
    assert main(["inspect", str(path), "--verify"]) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with open_store(path) as reader:
            assert reader.read(torch.arange(128, 140)).equal(expected.select(torch.arange(128, 140)))
