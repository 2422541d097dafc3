"""An append interrupted (Ctrl-C in a notebook or a command) just before or just after its publish
lands: the store keeps exactly what was published, loses none of it, and appends on correctly.

The memmap writer rolled its files back to the previous publish whatever the moment, so an
interrupt that came after the new state slot was written cut published bytes ("the manifest
publishes 160; the file was truncated"); the Zarr writer kept its old row count and would have
written the next rows under ids already published."""

from __future__ import annotations

import pytest
import torch
from store_worker import check_rows, checksummed_batch

from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage import create_store, open_store
from rlhf_pipeline.storage.memmap.state_slots import StateSlots
from rlhf_pipeline.storage.zarr import appending as zarr_appending_module


def _interrupt_publish(monkeypatch, backend: str, *, after_it_lands: bool) -> None:
    """The next publish raises KeyboardInterrupt, before or after writing its state."""
    if backend == "memmap":
        owner, name = StateSlots, "publish"
    else:
        owner, name = zarr_appending_module, "publish"  # what the append path publishes with
    real = getattr(owner, name)
    state = {"armed": True}

    def interrupted(*args, **kwargs):
        if not state["armed"]:
            return real(*args, **kwargs)
        state["armed"] = False
        if after_it_lands:
            real(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(owner, name, interrupted)


@pytest.mark.parametrize("backend", ["memmap", "zarr"])
@pytest.mark.parametrize("after_it_lands", [True, False], ids=["after-publish", "before-publish"])
def test_an_append_interrupted_at_its_publish_keeps_what_was_published(backend, after_it_lands, tmp_path,
                                                                       monkeypatch):
    location = str(tmp_path / "buf")
    with create_store(location, backend, StoreSchema(), segment_rows=16) as store:
        store.append(checksummed_batch(0, 10))
        _interrupt_publish(monkeypatch, backend, after_it_lands=after_it_lands)
        with pytest.raises(KeyboardInterrupt):
            store.append(checksummed_batch(10, 5))
        held = 15 if after_it_lands else 10
        assert len(store) == held
        with open_store(location, backend=backend) as reader:  # what another process sees
            assert len(reader) == held
            check_rows(reader.read(torch.arange(held)))
        # the writer carries on after the interrupt, at the next free row id
        assert store.append(checksummed_batch(held, 9)).tolist() == list(range(held, held + 9))
    monkeypatch.undo()
    with open_store(location, "a", backend=backend) as reopened:  # a writer's open checks every file
        assert len(reopened) == held + 9
        check_rows(reopened.read(torch.arange(held + 9)))
