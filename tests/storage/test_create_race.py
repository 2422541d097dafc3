"""Two creators of one new store: the one that loses decides "new or existing" under the lock.

The race: the loser finds no store, then another process creates it and publishes rows, then the
loser gets the writer lock (at once locally after the winner closed; on S3 and Azure after waiting
out the winner's lease). The loser used to publish an empty record over the winner's rows, and its next
open deleted their data as orphans. Here the winner's whole life (create, append, close) is run at
exactly that moment, by running it just before the loser's lock is taken.
"""

from __future__ import annotations

import pytest
import torch
from store_worker import check_rows, checksummed_batch

from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage import create_store, open_store
from rlhf_pipeline.storage.locking import WriterLock
from rlhf_pipeline.storage.zarr import store as zarr_store_module

WINNER_ROWS = 50


def _location(kind: str, tmp_path, server) -> tuple[str, str, dict]:
    if kind == "memmap":
        return str(tmp_path / "buf"), "memmap", {}
    if kind == "zarr":
        return str(tmp_path / "buf.zarr"), "zarr", {}
    return server.url(), "zarr", {"storage_options": server.options, "lock_wait_s": 30}  # moto or Azurite


def _winner_runs_before_the_losers_lock(monkeypatch, location: str, backend: str, options: dict) -> None:
    """Makes the loser's next lock acquisition first run the winner to completion."""
    state = {"ran": False}

    def run_winner() -> None:
        state["ran"] = True
        with create_store(location, backend, StoreSchema(), segment_rows=16, **options) as winner:
            winner.append(checksummed_batch(0, WINNER_ROWS))  # acknowledged: the append returned

    if backend == "zarr":
        real_lock_for = zarr_store_module.lock_for

        def lock_for(*args, **kwargs):
            if not state["ran"]:
                run_winner()
            return real_lock_for(*args, **kwargs)

        monkeypatch.setattr(zarr_store_module, "lock_for", lock_for)
    else:
        real_acquire = WriterLock.acquire

        def acquire(self, *args, **kwargs):
            if not state["ran"]:
                run_winner()
            return real_acquire(self, *args, **kwargs)

        monkeypatch.setattr(WriterLock, "acquire", acquire)


def _check_winners_rows_survive(location: str, backend: str, options: dict) -> None:
    storage_options = {k: v for k, v in options.items() if k == "storage_options"}
    with open_store(location, "a", backend=backend, **storage_options) as writer:  # deletes orphans
        assert len(writer) == WINNER_ROWS
    with open_store(location, backend=backend, **storage_options) as reader:
        assert len(reader) == WINNER_ROWS
        check_rows(reader.read(torch.arange(WINNER_ROWS)))


@pytest.mark.parametrize("kind", ["memmap", "zarr", "s3", "azure"])
def test_a_creator_that_lost_the_race_opens_the_winners_store_with_exist_ok(kind, tmp_path, monkeypatch, request):
    server = request.getfixturevalue(f"{kind}_server") if kind in ("s3", "azure") else None
    location, backend, options = _location(kind, tmp_path, server)
    _winner_runs_before_the_losers_lock(monkeypatch, location, backend, options)
    with create_store(location, backend, StoreSchema(), segment_rows=16, exist_ok=True, **options) as loser:
        assert len(loser) == WINNER_ROWS  # the winner's store, not a new empty one
        loser.append(checksummed_batch(WINNER_ROWS, 5))
    monkeypatch.undo()
    with open_store(location, backend=backend, **{k: v for k, v in options.items() if k == "storage_options"}) as r:
        assert len(r) == WINNER_ROWS + 5
        check_rows(r.read(torch.arange(WINNER_ROWS + 5)))


@pytest.mark.parametrize("kind", ["memmap", "zarr", "s3", "azure"])
def test_a_creator_that_lost_the_race_is_refused_without_exist_ok(kind, tmp_path, monkeypatch, request):
    server = request.getfixturevalue(f"{kind}_server") if kind in ("s3", "azure") else None
    location, backend, options = _location(kind, tmp_path, server)
    _winner_runs_before_the_losers_lock(monkeypatch, location, backend, options)
    with pytest.raises(FileExistsError, match="created by another process meanwhile"):
        create_store(location, backend, StoreSchema(), segment_rows=16, **options)
    monkeypatch.undo()
    _check_winners_rows_survive(location, backend, options)
