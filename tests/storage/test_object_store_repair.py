"""``rlhf-pipeline repair`` of Zarr stores at an ``s3://`` URL (moto's S3 server on loopback): a
damaged or lost commit record is rebuilt under the store's leased writer lock, in a single store
and in one shard of a run's buffer of shards; a live writer keeps repair out; schemes without a
writer lock are refused. The command runs in this process, as the local repair tests run it.
"""

from __future__ import annotations

import pytest
import torch
from store_worker import check_rows, checksummed_batch

from rlhf_pipeline.cli.main import main
from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage import open_buffer, open_store
from rlhf_pipeline.storage.buffers import repair_buffer
from rlhf_pipeline.storage.zarr import ZarrTrajectoryStore


@pytest.fixture()
def env(s3_server, monkeypatch):
    """The CLI reads the endpoint and credentials from the AWS variables, as a user's shell gives them."""
    environment = s3_server.env()
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL"):
        monkeypatch.setenv(key, environment[key])


def _store(url: str, start: int, rows: int) -> str:
    with ZarrTrajectoryStore.create(url, StoreSchema(), segment_rows=16) as store:
        store.append(checksummed_batch(start, rows))
    return url


def _put(s3_server, url: str, key: str, body: bytes | None) -> None:
    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    if body is None:
        s3_server.client().delete_object(Bucket=bucket, Key=f"{prefix}/{key}")
    else:
        s3_server.client().put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=body)


@pytest.mark.parametrize("damage", [b"{not json", None], ids=["garbled", "deleted"])
def test_repair_rebuilds_a_damaged_commit_record_at_a_url(s3_server, env, damage, capsys):
    url = _store(s3_server.url("store"), 0, 40)  # segments of 16: two sealed, one fragment
    with open_store(url) as store:
        before = store.read(torch.arange(40))
    _put(s3_server, url, "zarr.json", damage)

    assert main(["repair", url, "--quiet"]) == 1  # a dry run: what it would write, nothing written
    out = capsys.readouterr().out
    assert f"would: write {url}/zarr.json: a commit record rebuilt from 3 unit(s), rows 0..39" in out, out
    assert not [k for k in s3_server.keys(url) if k.startswith("repair-")]

    assert main(["repair", url, "--apply", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "repaired" in out and f"a copy of the replaced zarr.json (if any) is in {url}/repair-" in out, out
    backups = [k for k in s3_server.keys(url) if k.startswith("repair-")]
    assert backups == ([] if damage is None else [backups[0]]) and "writer.lock" not in s3_server.keys(url)
    with open_store(url) as store:
        rows = store.read(torch.arange(len(store)))
    check_rows(rows)
    assert len(rows) == 40 and rows.equal(before)
    with open_store(url, mode="a") as store:  # a writer appends after the repaired rows, reusing no row id
        store.append(checksummed_batch(40, 5))
        assert len(store) == 45
    assert main(["repair", url, "--quiet"]) == 0
    assert "nothing to repair" in capsys.readouterr().out


def test_repair_of_a_run_buffer_of_shards_at_a_url_repairs_the_damaged_shard(s3_server, env, capsys):
    buffer = s3_server.url("buffer")
    _store(f"{buffer}/shard-0000", 0, 20)
    _store(f"{buffer}/shard-0001", 100, 12)
    _put(s3_server, f"{buffer}/shard-0001", "zarr.json", b"")

    reports = repair_buffer(buffer + "/")
    assert [(r.location.rsplit("/", 1)[-1], r.needed) for r in reports] == [("shard-0000", False),
                                                                             ("shard-0001", True)]
    assert main(["repair", buffer + "/", "--apply", "--quiet"]) == 0
    capsys.readouterr()
    with open_buffer(buffer + "/") as union:
        rows = union.read(torch.arange(len(union)))
    check_rows(rows)
    assert rows["trajectory_id"].tolist() == list(range(20)) + list(range(100, 112))


def test_repair_is_refused_while_a_writer_holds_the_store_at_a_url(s3_server, env, capsys):
    url = _store(s3_server.url("store"), 0, 20)
    with open_store(url, mode="a") as writer:  # a live writer: its lease is renewed while it runs
        _put(s3_server, url, "zarr.json", None)
        assert main(["repair", url, "--apply", "--quiet"]) == 2
        err = capsys.readouterr().err
        assert f"{url} is being written by process" in err and len(err.strip().splitlines()) == 1, err
        assert "repair --apply needs the store's writer lock" in err and "stop that writer" in err, err
    assert not [k for k in s3_server.keys(url) if k.startswith("repair-")]  # nothing written


def test_repair_refuses_an_unknown_scheme_and_a_url_without_a_writer_lock(tmp_path, capsys):
    assert main(["repair", "foo://bucket/store"]) == 2
    assert "foo:// is not a URL scheme a buffer can be read at" in capsys.readouterr().err
    local = _store(str(tmp_path / "store"), 0, 20)
    (tmp_path / "store" / "zarr.json").write_bytes(b"")
    assert main(["repair", f"file://{local}", "--apply", "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "repair writes a commit record only in a local directory or at an s3:// or az:// URL" in out, out
    assert "give the store's local path instead" in out
    assert not list(tmp_path.glob("**/repair-*"))


def test_damaged_unit_metadata_at_a_url_is_reported_and_rewritten_under_the_lock(s3_server, env, capsys):
    url = _store(s3_server.url("store"), 0, 40)  # two sealed segments, one fragment
    damaged = {"units/000000000000000-0000000016s/values/zarr.json": b"{not json",
               "units/000000000000032-0000000008f/zarr.json": None}
    written = {key: s3_server.get(url, key) for key in damaged}
    for key, body in damaged.items():
        _put(s3_server, url, key, body)
    assert main(["inspect", url, "--verify"]) == 1
    out = capsys.readouterr().out
    assert all(f"{url}/{key} " in out for key in damaged) and "2 problem(s)" in out, out
    assert main(["repair", url, "--apply", "--quiet"]) == 0
    assert "did: rewrite 2 metadata file(s)" in capsys.readouterr().out
    assert {key: s3_server.get(url, key) for key in damaged} == written  # as the writer wrote them
    assert "writer.lock" not in s3_server.keys(url)
    assert main(["inspect", url, "--verify"]) == 0
    with ZarrTrajectoryStore.open(url, mode="a") as writer:  # its writer carries on: units stay create-only
        writer.append(checksummed_batch(40, 4))
    with open_store(url) as store:
        rows = store.read(torch.arange(len(store)))
    assert rows["trajectory_id"].tolist() == list(range(44))
    check_rows(rows)
