"""A collector's :class:`~rlhf_pipeline.coordination.weights.WeightsPoller` when a resumed learner takes
back versions (``retract_versions_after``) between the poller's listing of ``weights/`` and its load of
a listed file: the poller treats the file as pruned (a ``FileNotFoundError``), never as an error."""

import subprocess
import sys

import pytest
import torch

from rlhf_pipeline.coordination.weights import (
    WeightsPoller,
    load_published,
    load_weights_file,
    publish_weights,
    retract_versions_after,
    weights_path,
)
from rlhf_pipeline.files.run_store import LocalRunStore


class LearnerRetractsAfterTheNextListing(LocalRunStore):
    """A run directory whose learner, resumed from the checkpoint of version ``checkpointed``, takes back
    every newer version right after a reader has listed them: the moment a live learner's retraction
    can fall between a collector's listing and its load."""

    def __init__(self, root, checkpointed: int) -> None:
        super().__init__(root)
        self.checkpointed, self.retracted = checkpointed, None

    def list(self, prefix: str) -> list[str]:
        names = super().list(prefix)
        if self.retracted is None:
            self.retracted = []  # the learner's own listing, inside the retraction, lists what is there
            self.retracted = retract_versions_after(self, self.checkpointed)
        return names


def state(version: int) -> dict[str, torch.Tensor]:
    return {"weight": torch.full((2, 3), float(version))}


@pytest.fixture()
def run(tmp_path):
    for version in range(5):  # the killed learner published up to 4; its last checkpoint holds version 3
        publish_weights(tmp_path, state(version), version, keep_last=5)
    return tmp_path


def test_a_weights_file_removed_before_its_load_is_file_not_found(run):
    path = weights_path(run, 4)
    path.unlink()
    with pytest.raises(FileNotFoundError):
        load_weights_file(path)


# a learner in another process publishing version 5 and taking it back, over and over, until told to stop
LEARNER = """
import sys, torch
from pathlib import Path
from rlhf_pipeline.coordination.weights import publish_weights, retract_versions_after
run = Path(sys.argv[1])
publish_weights(run, {"weight": torch.full((64, 64), 5.0)}, 5)
retract_versions_after(run, 4)
print("cycling", flush=True)
while not (run / "stop").exists():
    publish_weights(run, {"weight": torch.full((64, 64), 5.0)}, 5)
    retract_versions_after(run, 4)
"""


@pytest.mark.slow
def test_a_version_taken_back_while_it_is_read_is_file_not_found(run):
    """safe_open reads the header, then torch maps each tensor by the file's path: a learner in another
    process that deleted the file in between made the load fail with torch's "unable to open file"
    RuntimeError (a collector resumed beside a resumed learner died of it), and one that published the
    version again in between could have had its tensors read from the new file. Every load now gives
    this version's tensors or FileNotFoundError."""
    learner = subprocess.Popen([sys.executable, "-c", LEARNER, str(run)], stdout=subprocess.PIPE, text=True)
    outcomes = {"loaded": 0, "not found": 0}
    try:
        assert learner.stdout.readline().strip() == "cycling"
        path = weights_path(run, 5)
        for _ in range(20_000):  # before the fix about 1 load in 500 failed here (a quiet machine)
            try:
                loaded, version = load_weights_file(path)
            except FileNotFoundError:
                outcomes["not found"] += 1
            else:
                assert version == 5 and torch.equal(loaded["weight"], torch.full((64, 64), 5.0))
                outcomes["loaded"] += 1
    finally:
        (run / "stop").touch()
        learner.wait(timeout=60)
    assert learner.returncode == 0
    assert outcomes["not found"] and outcomes["loaded"], outcomes  # the file came and went while it was read


def test_a_version_taken_back_after_the_listing_is_waited_for_not_an_error(run):
    store = LearnerRetractsAfterTheNextListing(run, checkpointed=3)
    poller = WeightsPoller(store)
    update = poller.poll_version(4)  # listed, then taken back before the load: the newest left instead
    assert store.retracted == [4]
    assert update is not None and update[1] == 3 and torch.equal(update[0]["weight"], state(3)["weight"])
    assert poller.poll_version(4) is None  # not published again yet
    publish_weights(store, state(4), 4)  # the resumed learner retrains step 4
    assert poller.poll_version(4)[1] == 4


def test_the_newest_version_taken_back_after_the_listing_gives_the_newest_left(run):
    store = LearnerRetractsAfterTheNextListing(run, checkpointed=2)
    update = WeightsPoller(store).poll()
    assert store.retracted == [3, 4] and update[1] == 2


def test_loading_a_version_taken_back_after_the_listing_says_it_is_not_there(run):
    store = LearnerRetractsAfterTheNextListing(run, checkpointed=3)
    with pytest.raises(FileNotFoundError):
        load_published(store, 4)


@pytest.mark.parametrize("run_home, cached", [("local", False), ("s3", False), ("s3", True)],
                         ids=["local", "s3", "s3-machine-cache"], indirect=["run_home"])
def test_damaged_published_weights_are_refused_naming_the_file_and_the_way_out(run_home, tmp_path, cached):
    """A weights file cut short (a disk fault, a copy interrupted by hand) was a safetensors traceback in
    the collector; it is one refusal naming the file, wherever the run lives and however it is read."""
    from rlhf_pipeline.files.machine_cache import MachineCache
    from rlhf_pipeline.files.run_paths import run_paths
    from rlhf_pipeline.files.state_files import StateFileError

    store = run_paths("damaged", run_home).store
    for version in range(2):
        publish_weights(store, state(version), version)
    key = "weights/policy_00000001.safetensors"
    whole = store.read(key)
    for cut in (whole[:4], whole[:50], whole[:-8], b"\0" * len(whole)):
        store.write(key, cut)
        poller = WeightsPoller(store, cache=MachineCache(tmp_path / f"cache-{len(cut)}") if cached else None)
        with pytest.raises(StateFileError) as refused:
            poller.poll()
        message = str(refused.value)
        assert message.startswith(f"cannot read the published weights {store.describe(key)}: "), message
        assert "damaged" in message and "delete it" in message and "\n" not in message
    store.delete(key)  # the way out it names: the newest version left
    assert WeightsPoller(store).poll()[1] == 0


@pytest.mark.parametrize("run_home", ["local", "s3"], indirect=True)
def test_every_bit_flipped_in_published_weights_is_refused(run_home):
    """A bit flipped on disk in a weights file (its header, its metadata or a tensor's bytes) loaded as
    it was, and the collectors sampled with a changed weight: safetensors keeps no checksum. The file
    records a CRC32C of its metadata and tensors, which every read checks. Locally every bit is flipped
    in turn; at a URL (a read of the object's bytes, not of a file) every 97th."""
    from rlhf_pipeline.coordination.weights import CHECKSUM_KEY
    from rlhf_pipeline.files.run_paths import run_paths
    from rlhf_pipeline.files.state_files import StateFileError

    store = run_paths("flipped", run_home).store
    publish_weights(store, state(0), 0)
    publish_weights(store, {"weight": torch.arange(6.0).reshape(2, 3), "bias": torch.ones(3)}, 1)
    key = "weights/policy_00000001.safetensors"
    whole = store.read(key)
    assert CHECKSUM_KEY.encode() in whole
    original, _ = load_published(store, 1)
    silent = []
    for bit in range(0, len(whole) * 8, 1 if run_home == "local" else 97):
        flipped = bytearray(whole)
        flipped[bit // 8] ^= 1 << (bit % 8)
        store.write(key, bytes(flipped))
        try:
            loaded, version = load_published(store, 1)
        except StateFileError as refused:
            assert "cannot read the published weights" in str(refused)
            continue
        if version != 1 or loaded.keys() != original.keys() or any(
                not torch.equal(loaded[name], original[name]) for name in original):
            silent.append(bit)
    assert not silent, f"bits {silent} of {len(whole) * 8} changed what loads without a word"
    store.write(key, whole)
    assert torch.equal(load_published(store, 1)[0]["weight"], original["weight"])


def test_weights_published_before_checksums_still_load(tmp_path):
    """Files a learner published before the checksum (no ``crc32c`` in their metadata) load unchecked."""
    from safetensors.torch import save_file

    (tmp_path / "weights").mkdir()
    save_file(state(7), str(weights_path(tmp_path, 7)), metadata={"version": "7"})
    loaded, version = load_weights_file(weights_path(tmp_path, 7))
    assert version == 7 and torch.equal(loaded["weight"], state(7)["weight"])
