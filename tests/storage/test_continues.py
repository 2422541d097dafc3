"""``buffer.continues.json``: which parent rows a branch's buffer continues, and what continues none."""

from __future__ import annotations

import pytest

from rlhf_pipeline.storage.continues import continued_rows, continues_file, write_continued_rows
from rlhf_pipeline.storage.errors import StoreCorruptedError


def test_a_written_record_reads_back_and_a_buffer_without_one_continues_none(tmp_path):
    buffer = tmp_path / "branch" / "buffer"
    buffer.mkdir(parents=True)
    assert continued_rows(buffer) is None
    write_continued_rows(buffer, str(tmp_path / "parent" / "buffer"), {"shard-0000": 64})
    record = continued_rows(buffer)
    assert record["parent_buffer"] == str(tmp_path / "parent" / "buffer") and record["rows"] == {"shard-0000": 64}


def test_a_file_url_source_continues_none_without_asking_an_object_store(tmp_path):
    # replay reads sources at file:// URLs; only runs at s3:// and az:// can be branches continued online
    buffer = tmp_path / "zarr"
    buffer.mkdir()
    assert continued_rows(buffer.as_uri()) is None


def test_a_damaged_record_is_refused_by_name(tmp_path):
    buffer = tmp_path / "buffer"
    continues_file(buffer).write_text("{not json")
    with pytest.raises(StoreCorruptedError, match="buffer.continues.json is damaged"):
        continued_rows(buffer)
