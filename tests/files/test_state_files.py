"""State files load with ``weights_only=True``: a planted file that would run code is refused,
older checkpoints still resume, damaged files get an error that says what to do."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from rlhf_pipeline.files.atomic import save_torch_atomic
from rlhf_pipeline.learn.checkpoint import CheckpointManager, Progress, capture_rng_state, restore_rng_state
from rlhf_pipeline.files.state_files import StateFileError


class RunsCode:
    """Unpickles as a call to ``os.system``: what an attacker would plant."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def plant(path, marker) -> None:
    torch.save({"progress": {"seed": 0, "step": 99}, "model": {"w": torch.zeros(1)}, "x": RunsCode(marker)}, path)


def test_the_planted_payload_is_real(tmp_path):
    """Loaded the old way it runs its command, so the refusals below refuse something real."""
    plant(tmp_path / "bad.pt", tmp_path / "ran")
    torch.load(tmp_path / "bad.pt", weights_only=False)
    assert (tmp_path / "ran").exists()


def test_a_planted_checkpoint_is_refused_and_runs_nothing(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints")
    manager.save(Progress(seed=0, step=3), {"rng": capture_rng_state()})
    plant(tmp_path / "checkpoints" / "step_00000099.pt", tmp_path / "ran")
    with pytest.raises(StateFileError) as info:
        manager.load()
    message = str(info.value)
    assert "step_00000099.pt" in message and "posix.system" in message and "could run code" in message
    assert "delete it" in message
    assert not (tmp_path / "ran").exists()
    assert manager.load(manager.paths()[0])[0].step == 3  # the checkpoint we wrote still loads


def test_a_planted_collector_state_is_refused(tmp_path):
    """A writer state planted in a shared buffer (the collector's position and pending groups) is
    refused by whatever resumes from it, and runs nothing."""
    from rlhf_pipeline.schema import StoreSchema
    from rlhf_pipeline.storage import create_store
    from rlhf_pipeline.storage.writer_state import decode

    plant(tmp_path / "bad.pt", tmp_path / "ran")
    with create_store(tmp_path / "shard-0000", "memmap", schema=StoreSchema()) as store:
        store.append(None, writer_state=(tmp_path / "bad.pt").read_bytes())
        with pytest.raises(StateFileError, match=r"writer state .*shard-0000.*could run code"):
            decode(store.writer_state, store.location)
    assert not (tmp_path / "ran").exists()


def test_format_1_checkpoints_with_numpy_rng_arrays_still_resume_exactly(tmp_path):
    """Older runs kept np.random.get_state()'s tuple (a NumPy array inside): still read, RNG exact."""
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    old_rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    expected = (random.random(), float(np.random.rand()), torch.rand(2))
    directory = tmp_path / "checkpoints"
    save_torch_atomic({"rng": old_rng, "progress": Progress(seed=0, step=7).to_dict(), "format": 1},
                      directory / "step_00000007.pt")
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    progress, state = CheckpointManager(directory).load()
    restore_rng_state(state["rng"])
    assert progress.step == 7
    got = (random.random(), float(np.random.rand()), torch.rand(2))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


def test_numpy_arrays_do_not_open_the_door_for_anything_else(tmp_path):
    path = tmp_path / "step_00000001.pt"
    torch.save({"rng": {"numpy": np.random.get_state()}, "x": RunsCode(tmp_path / "ran"), "progress": {}}, path)
    with pytest.raises(StateFileError, match="posix.system"):
        CheckpointManager(tmp_path).load()
    assert not (tmp_path / "ran").exists()


def test_new_checkpoints_hold_only_tensors_and_plain_values(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    manager = CheckpointManager(tmp_path)
    path = manager.save(Progress(seed=0, step=1), {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                                   "rng": capture_rng_state()})
    assert torch.serialization.get_unsafe_globals_in_checkpoint(path) == []
    torch.load(path, weights_only=True)  # the strict loader, nothing allowed beyond its defaults


def test_a_damaged_state_file_says_so(tmp_path):
    manager = CheckpointManager(tmp_path)
    path = manager.save(Progress(seed=0, step=1), {"rng": capture_rng_state()})
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(StateFileError, match=r"cannot read the learner checkpoint .*step_00000001\.pt.*damaged"):
        manager.load()


def test_a_flipped_bit_inside_a_tensor_is_refused_by_the_crc32_torch_stored(tmp_path):
    """torch's reader never checks the CRC32 it writes beside each member: a checkpoint with one bit of
    its weights flipped resumed with that weight changed. Each load now checks it, path and bytes alike."""
    import io
    import zipfile

    from rlhf_pipeline.files.state_files import load_state_bytes

    manager = CheckpointManager(tmp_path)
    weights = torch.arange(256, dtype=torch.float32)
    path = manager.save(Progress(seed=0, step=1), {"model": {"w": weights}, "rng": capture_rng_state()})
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as archive:
        member = next(info for info in archive.infolist() if info.file_size == weights.numel() * 4)
    with open(path, "rb") as f:  # where the member's bytes start: past its local header
        f.seek(member.header_offset + 26)
        name_length, extra_length = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
    data[member.header_offset + 30 + name_length + extra_length + 400] ^= 0x01  # one bit of one weight
    path.write_bytes(bytes(data))
    with pytest.raises(StateFileError, match=rf"step_00000001\.pt: its {member.filename} fails the CRC32 torch stored"):
        manager.load()
    with pytest.raises(StateFileError, match="fails the CRC32"):
        load_state_bytes(bytes(data), what="learner checkpoint", where="s3://bucket/run/checkpoints/step_00000001.pt")
