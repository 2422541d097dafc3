"""What ``detach`` (runs/detach.py) writes for the copy it switches ``parent-rows/`` to: one range
of the copy's ids in ``selection.json`` (storage/row_ranges.py), no per-row ids file, whatever the
number of rows; the same rows at the same positions, and the identity a resumed checkpoint checks.
A branch detached before ranges (its copy's ids one by one in ``own-rows.npy``) still opens, and a
detach stopped after its switch finishes without copying again."""

from __future__ import annotations

import json
import shutil

import numpy as np
import torch

from helpers import make_batch
from rlhf_pipeline.runs.detach import OWN_IDS, OWN_ROWS, SWITCHED, detach
from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage import create_store, open_buffer
from rlhf_pipeline.storage.selection import write_range_selection, write_selection
from rlhf_pipeline.storage.sharded import shard_path

SCHEMA = StoreSchema(("advantage",))


def branch_of_two_shards(tmp_path, rows_per_shard: int):
    """A parent buffer of two shards and a branch whose ``parent-rows/`` names a prefix of each."""
    parent, branch = tmp_path / "parent", tmp_path / "branch"
    for k in (0, 1):
        with create_store(shard_path(parent / "buffer", k), "memmap", SCHEMA, segment_rows=512) as store:
            base = k << 40
            store.append(make_batch(rows_per_shard // 4, 4, seed=k, optional=SCHEMA.optional, first_group_id=base,
                                    first_trajectory_id=base))
    branch.mkdir()
    with open_buffer(parent / "buffer", mode="r") as source:
        write_range_selection(branch / "parent-rows", source,
                              {0: (4, rows_per_shard - 8), 1: (0, rows_per_shard - 4)},
                              where="rows published by step 2")
    (branch / "branch.json").write_text(json.dumps({"parent": str(parent), "step": 2, "replay_source": None}))
    return parent, branch


def everything(selection) -> tuple[torch.Tensor, torch.Tensor, dict]:
    with open_buffer(selection) as store:
        rows = store.read(torch.arange(len(store)), fields=("trajectory_id", "response_tokens"))
        return rows["trajectory_id"], rows["response_tokens"].values, store.state_dict()


def test_detach_switches_to_one_range_of_its_copy_at_any_size(tmp_path):
    sizes = {}
    for rows_per_shard in (400, 4000):
        parent, branch = branch_of_two_shards(tmp_path / str(rows_per_shard), rows_per_shard)
        ids, tokens, state = everything(branch / "parent-rows")
        record, now = detach(branch)
        assert now and record["rows_copied"] == ids.numel() == 2 * rows_per_shard - 16
        assert sorted(p.name for p in (branch / "parent-rows").iterdir()) == ["selection.json"]
        manifest = json.loads((branch / "parent-rows" / "selection.json").read_text())
        assert manifest["row_ranges"] == [[0, 0, ids.numel()]] and manifest[SWITCHED] == OWN_ROWS
        sizes[rows_per_shard] = (branch / "parent-rows" / "selection.json").stat().st_size
        shutil.rmtree(parent)
        copied_ids, copied_tokens, copied_state = everything(branch / "parent-rows")
        assert copied_ids.equal(ids) and copied_tokens.equal(tokens)  # the same rows at the same positions
        with open_buffer(branch / "parent-rows") as store:
            store.load_state_dict(state)  # what a checkpoint taken before detaching recorded
        assert copied_state["rows_crc32"] == state["rows_crc32"]
    assert abs(sizes[4000] - sizes[400]) <= 16  # a few digits more, not 8 bytes a row


def test_a_branch_detached_with_per_row_ids_still_opens_and_finishes_without_copying_again(tmp_path):
    parent, branch = branch_of_two_shards(tmp_path, 400)
    ids, _, state = everything(branch / "parent-rows")
    detach(branch)
    # what detach wrote before ranges: the copy's ids one by one in own-rows.npy, named by the manifest
    selection, lineage = branch / "parent-rows", json.loads((branch / "branch.json").read_text())
    ranged = json.loads((selection / "selection.json").read_text())
    with open_buffer(branch / OWN_ROWS, mode="r") as copied:
        write_selection(tmp_path / "old", copied, np.zeros(len(copied), dtype=np.int64), np.arange(len(copied)),
                        source_location=str(branch / OWN_ROWS))
    old = json.loads((tmp_path / "old" / "selection.json").read_text())
    old.update(rows_file=OWN_IDS, parts_file=None, rows_identity_crc32=ranged["rows_identity_crc32"])
    old["source"]["relative"] = f"../{OWN_ROWS}"
    for part in old["parts"]:
        part["relative"] = f"../{OWN_ROWS}"
    shutil.copyfile(tmp_path / "old" / "rows.npy", selection / OWN_IDS)
    (selection / "selection.json").write_text(json.dumps(old))
    lineage.pop("detached")  # stopped after the switch, before branch.json said so
    (branch / "branch.json").write_text(json.dumps(lineage))
    copy_files = {p: p.stat().st_mtime_ns for p in (branch / OWN_ROWS).rglob("*")}

    record, now = detach(branch)
    assert now and record["rows_copied"] == ids.numel()  # branch.json did not say it was detached: this call did
    assert {p: p.stat().st_mtime_ns for p in (branch / OWN_ROWS).rglob("*")} == copy_files  # not copied again
    shutil.rmtree(parent)
    old_ids, _, old_state = everything(selection)
    assert old_ids.equal(ids) and old_state["rows_crc32"] == state["rows_crc32"]
