"""The Zarr backend: the shared contract, plus what only a Zarr store has to prove.

Zarr-specific: every field is readable by plain ``zarr`` (no rlhf_pipeline import),
zip stores and fsspec ``file://`` URLs, codec settings, and clear errors for damaged
chunks, foreign or incompatible stores and read-only locations.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from contract import StoreContractTests
from helpers import assert_same_padded, make_batch

from rlhf_pipeline.schema import OPTIONAL_FIELDS, StoreSchema, TrajectoryBatch
from rlhf_pipeline.storage import NotAStoreError, open_store
from rlhf_pipeline.storage.base import ReadOnlyStoreError, StoreCorruptedError, StoreError
from rlhf_pipeline.storage.manifest import IncompatibleStoreError
from rlhf_pipeline.storage.zarr.store import ZarrTrajectoryStore


class TestZarrContract(StoreContractTests):
    backend = "zarr"


def test_a_process_that_wrote_a_zarr_store_and_ends_with_os_exit_leaks_no_semaphore(tmp_path):
    """A run's collector and learner end with ``os._exit`` (runs/forking.py). Blosc's mutex, made at the
    first encode, was a named semaphore under torchrl's "spawn" start method, and the resource tracker
    warned of it leaked after runs with a Zarr buffer (layout.py)."""
    script = f"""
import os, sys
import torchrl  # makes "spawn" the start method, as in every process of a run
import multiprocessing
assert multiprocessing.get_start_method() == "spawn"
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
from helpers import make_batch
from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage.zarr.store import ZarrTrajectoryStore
store = ZarrTrajectoryStore.create({str(tmp_path / "b")!r}, StoreSchema(()), segment_rows=8)
for i in range(3):  # sealed segments (blosc-zstd) and the open one's tail (blosc-lz4)
    store.append(make_batch(2, 4, seed=i, optional=(), first_group_id=2 * i, first_trajectory_id=8 * i))
store.close()
print(len(ZarrTrajectoryStore.open({str(tmp_path / "b")!r})), flush=True)
os._exit(0)
"""
    ended = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert ended.returncode == 0 and ended.stdout.strip() == "24", ended.stderr[-3000:]
    assert "leaked semaphore" not in ended.stderr, ended.stderr


def _fill(path, n_batches=5, *, optional=OPTIONAL_FIELDS, segment_rows=16, **options):
    batches = [make_batch(2, 4, seed=i, optional=optional, first_group_id=2 * i, first_trajectory_id=8 * i)
               for i in range(n_batches)]
    with ZarrTrajectoryStore.create(str(path), StoreSchema(optional), segment_rows=segment_rows,
                                    **options) as store:
        for b in batches:
            store.append(b)
    return TrajectoryBatch.cat(batches)


# ============================================================================ plain zarr
# The reader of docs/zarr-layout.md: every kind of unit, with zarr and numpy only.
PLAIN_READER = r'''
import json, sys
import numpy as np
import zarr

SUFFIX = {0: "", 1: "", 2: "p", 3: "s", 4: "f"}
root = zarr.open_group(sys.argv[1], mode="r")
record = root.attrs["rlhf_pipeline"]
out = {"kinds": []}
for first_row, rows, kind in record["units"]:
    node = root[f"units/{first_row:015d}-{rows:010d}{SUFFIX[kind]}"]
    if kind in (0, 1):                      # one array per field
        arrays = {name: node[name][:] for name in node.array_keys()}
    else:                                   # packed: kind 3 is a group of two, kinds 2 and 4 one array
        arrays = {}
        for packed in ([node["rows"], node["values"]] if kind == 3 else [node]):
            raw = packed[:]
            for name, r in packed.attrs["rlhf_pipeline_fields"].items():
                arrays[name] = raw[r["start"]:r["stop"]].view(np.dtype(r["dtype"]).newbyteorder("<"))
    out["kinds"].append(kind)
    for name, field in record["fields"].items():
        values = arrays.get(name, np.zeros(0))
        if field["kind"] == "row":
            vals = values.tolist()
        else:
            off = arrays[field["offsets"]]
            pieces = [values[off[i]:off[i + 1]] for i in range(rows)]
            vals = [p.tolist() for p in pieces] if field["kind"] == "token" else \
                [bytes(p).decode("utf-8") for p in pieces]
        out.setdefault(name, []).extend(vals)
assert "rlhf_pipeline" not in sys.modules
print(json.dumps(out))
'''


def read_with_plain_zarr(path, tmp_path) -> dict:
    script = tmp_path / "plain.py"
    script.write_text(PLAIN_READER)
    result = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True, check=True,
                            cwd=tmp_path)
    return json.loads(result.stdout)


def assert_same_rows(got: dict, expected: TrajectoryBatch) -> None:
    assert set(got) - {"kinds"} == set(expected.field_names)
    for name in expected.field_names:
        column = expected[name]
        if isinstance(column, list):
            assert got[name] == column
        elif isinstance(column, torch.Tensor):
            assert torch.equal(torch.tensor(got[name], dtype=column.dtype), column), name
        else:
            for row, values in zip(column.to_list(), got[name]):
                assert torch.equal(row, torch.tensor(values, dtype=column.dtype)), name


def test_plain_zarr_reads_every_field_of_a_live_and_a_closed_store(tmp_path):
    batches = [make_batch(2, 4, seed=i, optional=OPTIONAL_FIELDS, first_group_id=2 * i, first_trajectory_id=8 * i)
               for i in range(5)]
    expected = TrajectoryBatch.cat(batches)
    with ZarrTrajectoryStore.create(str(tmp_path / "b"), StoreSchema(OPTIONAL_FIELDS), segment_rows=16) as store:
        for b in batches[:4]:
            store.append(b)
        for part in (slice(0, 4), slice(4, 6), slice(6, 8)):
            store.append(batches[4].select(part))
        store.flush()  # two sealed segments; the open one is three fragments
        live = read_with_plain_zarr(tmp_path / "b", tmp_path)
    assert live["kinds"] == [3, 3, 4, 4, 4]
    assert_same_rows(live, expected)
    closed = read_with_plain_zarr(tmp_path / "b", tmp_path)
    assert closed["kinds"] == [3, 3, 4]  # close merged the open segment's fragments into one
    assert_same_rows(closed, expected)
    files = [p for p in (tmp_path / "b" / "units").rglob("*") if p.is_file()]
    assert len(files) == 1 + 2 * 5 + 2  # units/zarr.json, two sealed segments of 5 files, one fragment of 2


# ============================================================================ locations
def test_zip_store_reads_every_row(tmp_path):
    expected = _fill(tmp_path / "b")
    archive = tmp_path / "b.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for file in sorted((tmp_path / "b").rglob("*")):
            if file.is_file() and file.name != "writer.lock":
                zf.write(file, file.relative_to(tmp_path / "b").as_posix())
    with open_store(str(archive)) as store:
        assert store.backend_name == "zarr"
        assert store.read(torch.arange(len(store))).equal(expected)
    with pytest.raises(ReadOnlyStoreError, match="zip"):
        ZarrTrajectoryStore.open(str(archive), "a")


def test_a_zip_cut_short_or_holding_no_store_is_named_as_such(tmp_path):
    """Both were "not a replay buffer: no backend recognizes it", as for a path that holds anything else."""
    _fill(tmp_path / "b", n_batches=1)
    archive = tmp_path / "b.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for file in sorted((tmp_path / "b").rglob("*")):
            if file.is_file():
                zf.write(file, file.relative_to(tmp_path / "b").as_posix())
    cut = tmp_path / "cut.zip"
    cut.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])  # a copy stopped half way
    with pytest.raises(NotAStoreError, match=r"cut.zip is not a readable zip file \(cut short in a copy"):
        open_store(str(cut))
    other = tmp_path / "notes.zip"
    with zipfile.ZipFile(other, "w") as zf:
        zf.writestr("notes.txt", "not a store")
    with pytest.raises(NotAStoreError, match=r"notes.zip is a zip file that holds no Zarr store"):
        open_store(str(other))


def test_fsspec_file_url_round_trip_with_reader(tmp_path):
    url = (tmp_path / "b").as_uri()
    assert url.startswith("file://")
    batches = [make_batch(2, 3, seed=i, first_group_id=2 * i, first_trajectory_id=6 * i) for i in range(4)]
    with ZarrTrajectoryStore.create(url, segment_rows=8) as store, ZarrTrajectoryStore.open(url) as reader:
        assert store.location == url
        for b in batches[:2]:
            store.append(b)
        assert len(reader) == 12
        for b in batches[2:]:
            store.append(b)
        assert len(reader) == 24
        assert reader.read(torch.arange(24)).equal(TrajectoryBatch.cat(batches))
    with open_store(url) as again:  # open_store detects the backend through fsspec too
        assert again.read(torch.arange(24)).equal(TrajectoryBatch.cat(batches))


# ============================================================================ codecs
@pytest.mark.parametrize("codec", ["zstd", "none", {"name": "blosc", "cname": "lz4", "clevel": 1,
                                                     "shuffle": "bitshuffle"}])
def test_codec_is_configurable_and_recorded(tmp_path, codec):
    import zarr

    expected = _fill(tmp_path / "b", codec=codec, optional=())
    with ZarrTrajectoryStore.open(str(tmp_path / "b")) as store:
        assert store.read(torch.arange(len(store))).equal(expected)
        name = store.stats().extra["codec"]["name"]
    assert name == (codec if isinstance(codec, str) else "blosc")
    units = zarr.open_group(str(tmp_path / "b"), mode="r")["units"]
    first = units[sorted(units.group_keys())[0]]["values"]  # a sealed segment's token values and text
    kinds = [type(c).__name__ for c in first.compressors]
    assert kinds == {"zstd": ["ZstdCodec"], "none": []}.get(name, ["BloscCodec"]) + ["Crc32cCodec"]


def test_default_codec_compresses_token_ids(tmp_path):
    with ZarrTrajectoryStore.create(str(tmp_path / "b"), segment_rows=256) as store:
        for i in range(4):  # one sealed segment of 256 rows: 5 files, so blocks and metadata stay small
            store.append(make_batch(8, 8, seed=i, prompt_len=(32, 256), response_len=(16, 256)))
        stats = store.stats()
    assert stats.extra["codec"]["name"] == "blosc" and stats.extra["codec"]["cname"] == "zstd"
    assert stats.bytes_on_disk < 0.8 * stats.raw_bytes, stats


def test_unknown_codec_is_rejected_with_the_choices(tmp_path):
    with pytest.raises(ValueError, match="blosc-zstd"):
        ZarrTrajectoryStore.create(str(tmp_path / "b"), codec="gzip9")


# ============================================================================ errors
def _first_chunk(path: Path, array: str) -> Path:
    unit = sorted((path / "units").iterdir())[0]  # the first sealed segment
    return unit / array / "c.0"


@pytest.mark.parametrize("array", ["values", "rows"])
@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_chunk_gives_a_clear_error_and_other_rows_survive(tmp_path, damage, array):
    path = tmp_path / "b"
    expected = _fill(path, optional=())
    chunk = _first_chunk(path, array)
    raw = chunk.read_bytes()
    if damage == "truncate":  # half of a sealed blosc chunk: caught by its checksum and size
        chunk.write_bytes(raw[: len(raw) // 2])
    elif damage == "flip":  # silent bit rot: one byte in the middle
        chunk.write_bytes(raw[: len(raw) // 2] + bytes([raw[len(raw) // 2] ^ 0x10]) + raw[len(raw) // 2 + 1:])
    else:
        chunk.unlink()
    with ZarrTrajectoryStore.open(str(path)) as store:
        with pytest.raises(StoreCorruptedError, match=f"000000000000000-0000000016s/{array}/c.0"):
            store.read([0])
        with pytest.raises(StoreCorruptedError, match="000000000000000-0000000016s"):
            store.read_padded([3])
        # rows of the undamaged units are still served
        assert store.read(torch.arange(16, 40)).equal(expected.select(torch.arange(16, 40)))


def test_incompatible_format_and_schema_versions(tmp_path):
    path = tmp_path / "b"
    _fill(path, n_batches=1)
    meta = path / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["attributes"]["rlhf_pipeline"]["schema"]["schema_version"] = 99
    meta.write_text(json.dumps(doc))
    with pytest.raises(IncompatibleStoreError, match="schema version 99"):
        ZarrTrajectoryStore.open(str(path))
    doc["attributes"]["rlhf_pipeline"]["format_version"] = 7
    meta.write_text(json.dumps(doc))
    with pytest.raises(IncompatibleStoreError, match="format version 7"):
        open_store(str(path), backend="zarr")


def test_not_a_buffer(tmp_path):
    import zarr

    zarr.open_group(str(tmp_path / "plain"), mode="w")  # a Zarr group, but not ours
    with pytest.raises(NotAStoreError, match="not an rlhf_pipeline replay buffer"):
        ZarrTrajectoryStore.open(str(tmp_path / "plain"))
    (tmp_path / "file.txt").write_text("hello")
    with pytest.raises(NotAStoreError):
        ZarrTrajectoryStore.open(str(tmp_path / "file.txt"))
    with pytest.raises(NotAStoreError):
        open_store(str(tmp_path / "plain"))


def test_existing_store_is_not_overwritten(tmp_path):
    expected = _fill(tmp_path / "b", n_batches=1)
    with pytest.raises(FileExistsError):
        ZarrTrajectoryStore.create(str(tmp_path / "b"))
    with ZarrTrajectoryStore.open(str(tmp_path / "b")) as store:
        assert store.read(torch.arange(len(store))).equal(expected)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_directory_refuses_a_writer(tmp_path):
    _fill(tmp_path / "b", n_batches=1)
    os.chmod(tmp_path / "b", 0o555)
    try:
        with pytest.raises(ReadOnlyStoreError, match="not writable"):
            ZarrTrajectoryStore.open(str(tmp_path / "b"), "a")
        with ZarrTrajectoryStore.open(str(tmp_path / "b")) as reader:
            assert len(reader) == 8
    finally:
        os.chmod(tmp_path / "b", 0o755)


def test_read_only_location_refuses_a_writer(tmp_path):
    """Works as root too: a zip file is a read-only location by nature."""
    _fill(tmp_path / "b", n_batches=1)
    archive = tmp_path / "b.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for file in (tmp_path / "b").rglob("*"):
            if file.is_file():
                zf.write(file, file.relative_to(tmp_path / "b").as_posix())
    with pytest.raises(ReadOnlyStoreError):
        ZarrTrajectoryStore.create(str(tmp_path / "new.zip"))
    with pytest.raises(ReadOnlyStoreError):
        open_store(str(archive), "a")


# ============================================================================ design
def test_orphan_units_of_a_crashed_writer_are_removed_and_rows_kept(tmp_path):
    path = tmp_path / "b"
    expected = _fill(path, n_batches=3)  # 24 rows: one segment + a fragment
    orphan = path / "units" / "000000000000024-0000000008"
    (orphan / "reward").mkdir(parents=True)
    (orphan / "reward" / "c.0").write_bytes(b"half written")
    with ZarrTrajectoryStore.open(str(path), "a") as store:
        assert not orphan.exists()
        assert store.read(torch.arange(24)).equal(expected)
        store.append(make_batch(2, 4, seed=9, optional=OPTIONAL_FIELDS))
        assert len(store) == 32


def test_cache_stays_within_its_byte_budget(tmp_path):
    path = tmp_path / "b"
    expected = _fill(path, n_batches=12, segment_rows=8, optional=())  # 12 segments
    with ZarrTrajectoryStore.open(str(path), cache_bytes=20_000) as store:
        for start in range(0, 96, 8):
            assert store.read(torch.arange(start, start + 8)).equal(expected.select(torch.arange(start, start + 8)))
            assert store.cache.nbytes <= 20_000
        assert 0 < len(store.cache) < 12


def test_reader_survives_compaction_of_fragments_it_cached(tmp_path):
    path = str(tmp_path / "b")
    batches = [make_batch(1, 4, seed=i, first_group_id=i, first_trajectory_id=4 * i) for i in range(4)]
    with ZarrTrajectoryStore.create(path, segment_rows=16) as store, ZarrTrajectoryStore.open(path) as reader:
        store.append(batches[0])
        store.append(batches[1])
        assert reader.refresh() == 8
        assert reader.read(torch.arange(8)).equal(TrajectoryBatch.cat(batches[:2]))
        store.append(batches[2])
        store.append(batches[3])  # seals: the fragments the reader knows are deleted
        assert [u.sealed for u in store.units] == [True]
        # the reader still holds the old record: it must find the rows in the new segment
        assert reader.read_global(torch.arange(8)).equal(TrajectoryBatch.cat(batches[:2]))
        assert reader.refresh() == 16
        assert reader.read(torch.arange(16)).equal(TrajectoryBatch.cat(batches))


def test_inspect_command_reports_the_codec(tmp_path, capsys):
    from rlhf_pipeline.cli.main import main

    _fill(tmp_path / "b", n_batches=2)
    assert main(["inspect", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "zarr" in out and "blosc" in out and "16" in out


def test_writer_seals_a_segment_its_killed_predecessor_left_in_fragments(tmp_path, monkeypatch):
    from rlhf_pipeline.storage.zarr import writer as zarr_writer

    path = str(tmp_path / "b")
    batches = [make_batch(1, 4, seed=i, first_group_id=i, first_trajectory_id=4 * i) for i in range(5)]
    with monkeypatch.context() as patch:
        patch.setattr(zarr_writer.Sealer, "submit", lambda self, first_row: None)  # as if killed before sealing
        with ZarrTrajectoryStore.create(path, segment_rows=8) as store:
            for b in batches:
                store.append(b)
            assert [u.kind for u in store.units] == [4, 4, 4, 4, 4]
    with ZarrTrajectoryStore.open(path, "a") as store:
        store.flush()
        assert [u.kind for u in store.units] == [3, 3, 4]
        assert store.read(torch.arange(20)).equal(TrajectoryBatch.cat(batches))


# ============================================================================ fused read_padded
def _check_read_padded(store, n):
    from rlhf_pipeline.schema.padding import pad_batch, padded_fields

    generator = torch.Generator().manual_seed(n)
    cases = [torch.tensor([0]), torch.tensor([n - 1, 0, 7, 8, 7, 15, 16, n - 1]) % n, torch.arange(n).flip(0),
             *(torch.randint(0, n, (12,), generator=generator) for _ in range(4))]
    for positions in cases:
        for pad_token_id in (0, 77):
            expected = pad_batch(store.read(positions, fields=padded_fields(store.schema)), pad_token_id=pad_token_id)
            assert_same_padded(store.read_padded(positions, pad_token_id=pad_token_id), expected)


@pytest.mark.parametrize("optional", [(), ("advantage",), ("ref_log_probs", "kl", "token_rewards", "advantage")])
def test_read_padded_equals_pad_batch_of_read_across_units(tmp_path, optional):
    from rlhf_pipeline.schema.padding import PaddedCollator

    path = str(tmp_path / "b")
    with ZarrTrajectoryStore.create(path, StoreSchema(optional), segment_rows=8, durable=False) as store:
        for i in range(5):  # 30 rows: 3 sealed segments (once sealed), packed fragments in the tail
            store.append(make_batch(2, 3, seed=i, optional=optional))
            _check_read_padded(store, len(store))  # the writer's cache, while segments are sealed
        store.flush()
        assert {u.kind for u in store.units} == {3, 4}
        _check_read_padded(store, 30)
    with ZarrTrajectoryStore.open(path) as reader:  # cold cache: sealed segments + the merged fragment
        assert [u.kind for u in reader.units] == [3, 3, 3, 4]
        _check_read_padded(reader, 30)
        assert PaddedCollator(pad_token_id=5).read(reader, [3, 29, 3]).batch_size == torch.Size([3])
        with pytest.raises(IndexError, match="positions must lie in"):
            reader.read_padded([30])
        with pytest.raises(ValueError, match="empty batch"):
            reader.read_padded(torch.tensor([], dtype=torch.int64))
    with ZarrTrajectoryStore.open(path, cache_bytes=0) as reader:  # no unit kept: rows' slices only
        _check_read_padded(reader, 30)
        assert len(reader.cache) == 0
    with pytest.raises(StoreError, match="closed"):
        reader.read_padded([0])


def test_read_padded_follows_compaction_and_eviction(tmp_path):
    path = str(tmp_path / "b")
    with ZarrTrajectoryStore.create(path, segment_rows=4, capacity_rows=8, durable=False) as store, \
            ZarrTrajectoryStore.open(path) as reader:
        for i in range(6):
            reader.refresh()
            reader.read_padded(torch.arange(len(reader))) if len(reader) else None  # caches units
            store.append(make_batch(1, 3, seed=i))
            store.flush()
            reader.refresh()
            _check_read_padded(reader, len(reader))
            _check_read_padded(store, len(store))
        assert store.first_row > 0  # evictions happened
    # a reader whose record names fragments since compacted (no refresh, nothing cached): retried
    path = str(tmp_path / "c")
    with ZarrTrajectoryStore.create(path, segment_rows=8, durable=False) as store:
        store.append(make_batch(1, 3, seed=0))
        with ZarrTrajectoryStore.open(path, cache_bytes=0) as reader:
            store.append(make_batch(1, 3, seed=1))
            store.append(make_batch(1, 3, seed=2))  # completes segment 0: its fragments are sealed
            store.flush()
            positions = torch.tensor([2, 0, 1])
            assert reader._published_len() == 3 and reader._units[0].kind == 4  # (len() would refresh)
            got = reader.read_padded(positions)
            assert reader._units[0].kind == 3  # it refreshed on the missing fragment, then read
            assert_same_padded(got, store.read_padded(positions))
