"""The weights a learner keeps for the branches of its kept steps (docs/branching.md#continuing-online):
``HeldVersions`` (per shard of a buffer collectors write, the version the collector state published
with the rows a reader sees says it held) and ``weights_for_branches`` (from the kept checkpoints'
records and that). A whole run and its branch: tests/integration/test_branch_online.py."""

from rlhf_pipeline.coordination.branch_weights import HeldVersions, weights_for_branches
from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage import create_store, open_buffer, open_store
from rlhf_pipeline.storage.writer_state import encode

from helpers import make_batch


def append(shard, version: int | None) -> None:
    with open_store(shard, mode="a") as store:
        store.append(make_batch(2, 4), writer_state=None if version is None else encode({"policy_version": version}, []))


def test_each_shard_gives_its_rows_and_the_version_published_with_them_as_of_the_last_refresh(tmp_path):
    buffer = tmp_path / "buffer"
    for index in range(3):
        create_store(buffer / f"shard-{index:04d}", "memmap", schema=StoreSchema()).close()
    append(buffer / "shard-0000", 4)
    append(buffer / "shard-0001", None)  # rows without a state (written by a tool, not a collector)
    held = HeldVersions()
    with open_buffer(buffer) as reader:
        assert held(reader) == {"shard-0000": (8, 4)}
        append(buffer / "shard-0000", 6)
        append(buffer / "shard-0002", 5)
        assert held(reader) == {"shard-0000": (8, 4)}  # what the reader sees: not refreshed yet
        reader.refresh(force=True)
        assert held(reader) == {"shard-0000": (16, 6), "shard-0002": (8, 5)}


def test_a_single_store_has_no_collectors_to_name(tmp_path):
    create_store(tmp_path / "store", "memmap", schema=StoreSchema()).close()
    append(tmp_path / "store", 3)
    with open_store(tmp_path / "store") as store:
        assert HeldVersions()(store) == {}


def record(step: int, rows: dict[str, int], held: dict[str, int] | None) -> dict:
    """A checkpoint's rewind record as the learner writes it (a run made before ``held_versions``: None)."""
    return {"step": step, "policy_version": step, "buffer_rows": rows,
            **({"held_versions": held} if held is not None else {})}


def test_each_kept_step_keeps_from_what_its_collectors_held_to_its_own_and_the_next_from_what_they_hold_now():
    records = [record(8, {"shard-0000": 128}, {"shard-0000": 6}), record(16, {"shard-0000": 256}, {"shard-0000": 15})]
    assert weights_for_branches(records, {"shard-0000": (300, 18)}, newest=20) == {6, 7, 8, 15, 16, 18, 19, 20}
    assert weights_for_branches(records, {}, newest=20) == {6, 7, 8, 15, 16}  # no shard seen yet


def test_a_collector_that_wrote_nothing_since_the_checkpoint_before_keeps_only_what_it_held():
    """Collector 1 stopped after 64 rows holding version 2: the versions since then are no round's of it."""
    records = [record(8, {"shard-0000": 128, "shard-0001": 64}, {"shard-0000": 7, "shard-0001": 2}),
               record(16, {"shard-0000": 256, "shard-0001": 64}, {"shard-0000": 15, "shard-0001": 2})]
    now = {"shard-0000": (300, 18), "shard-0001": (64, 2)}
    assert weights_for_branches(records, now, newest=20) == {2, 3, 4, 5, 6, 7, 8, 15, 16, 18, 19, 20}


def test_checkpoints_of_a_run_made_before_their_records_named_what_collectors_held_keep_nothing():
    assert weights_for_branches([record(8, {"shard-0000": 128}, None)], {}, newest=12) == set()
