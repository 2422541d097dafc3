"""Which file a restarted vLLM engine reloads, when it is written and when it is removed
(``generation/vllm_held_weights.py``), with real files and no engine: the part of a restart both
weight routes share. The restart itself, for real: ``test_vllm_engine.py`` (files route, CPU) and
``test_vllm_nccl.py`` (NCCL route, skipped without a GPU)."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlhf_pipeline.generation import EngineDied, EngineFailed
from rlhf_pipeline.generation.vllm_held_weights import HeldWeights

DIED = EngineDied("the vLLM engine died: its process exited (killed by SIGKILL) while sampling; its log ends:\nOOM",
                  cause="its process exited (killed by SIGKILL) while sampling")


def tied_state_dict(seed: int) -> dict[str, torch.Tensor]:
    embedding = torch.randn(16, 4, generator=torch.Generator().manual_seed(seed))
    return {"model.embed_tokens.weight": embedding, "lm_head.weight": embedding,  # one tensor, as a tied head
            "model.norm.weight": torch.ones(4)}


def test_a_published_file_is_linked_held_and_removed_once_superseded(tmp_path):
    work, published = tmp_path / "engine", tmp_path / "published"
    work.mkdir(), published.mkdir()
    held = HeldWeights(work)
    assert held.restore_path(DIED) is None  # nothing loaded past the model directory yet
    for version in (1, 2):
        save_file({k: v.clone() for k, v in tied_state_dict(version).items()}, published / f"v{version}.safetensors")
    first = held.prepare(published / "v1.safetensors", 1, write_state_dict=False)  # a path is linked whatever the flag
    assert first == work / "weights-00000001.safetensors"
    assert os.stat(first).st_ino == os.stat(published / "v1.safetensors").st_ino  # a link, not a copy
    assert held.restore_path(DIED) is None  # prepared is not held: a restart now reloads what the engine holds
    held.hold(first, 1)
    (published / "v1.safetensors").unlink()  # the learner prunes it: the engine's link keeps the bytes
    assert held.restore_path(DIED) == first
    torch.testing.assert_close(load_file(first)["model.norm.weight"], torch.ones(4))

    second = held.prepare(published / "v2.safetensors", 2)
    held.hold(second, 2)
    assert held.restore_path(DIED) == second and not first.exists()
    assert sorted(p.name for p in work.iterdir()) == ["weights-00000002.safetensors"]
    assert (published / "v2.safetensors").exists()  # the published file is never the engine's to remove


def test_a_state_dict_is_written_only_when_asked_and_reads_back_equal(tmp_path):
    held = HeldWeights(tmp_path)
    state = tied_state_dict(3)
    assert held.prepare(state, 1, write_state_dict=False) is None  # the NCCL route with restarts off: no disk write
    assert list(tmp_path.iterdir()) == []
    path = held.prepare(state, 1)  # a tied head's shared tensor is written as two
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights-00000001.safetensors"]  # no .partial left
    loaded = load_file(path)
    assert loaded.keys() == state.keys()
    for name, tensor in state.items():
        torch.testing.assert_close(loaded[name], tensor)


def test_a_legacy_pt_publication_is_kept_as_safetensors(tmp_path):
    work = tmp_path / "engine"
    work.mkdir()
    state = tied_state_dict(4)
    torch.save({"state_dict": state, "version": 1}, tmp_path / "v1.pt")
    path = HeldWeights(work).prepare(tmp_path / "v1.pt", 1, write_state_dict=False)
    assert path == work / "weights-00000001.safetensors"
    torch.testing.assert_close(load_file(path)["model.embed_tokens.weight"], state["model.embed_tokens.weight"])


def test_a_version_that_failed_to_load_is_discarded_and_the_held_one_stays(tmp_path):
    held = HeldWeights(tmp_path)
    first = held.prepare(tied_state_dict(1), 1)
    held.hold(first, 1)
    failed = held.prepare(tied_state_dict(2), 2)
    held.discard(failed)
    assert not failed.exists() and first.exists() and held.restore_path(DIED) == first
    held.discard(first)  # the held file is never discarded
    assert first.exists()
    again = held.prepare(tied_state_dict(5), 1)  # the same version again: written over the held file in place
    held.hold(again, 1)
    assert again == first and first.exists()
    torch.testing.assert_close(load_file(first)["model.norm.weight"], torch.ones(4))


def test_a_held_version_not_kept_makes_a_restart_refuse_naming_the_setting(tmp_path):
    held = HeldWeights(tmp_path)
    first = held.prepare(tied_state_dict(1), 1)
    held.hold(first, 1)
    held.hold(held.prepare(tied_state_dict(2), 2, write_state_dict=False), 2)  # sent, not kept
    assert not first.exists()  # superseded: the engine no longer holds version 1
    with pytest.raises(EngineFailed, match=r"(?s)holding version 2, sent over NCCL and not kept.*"
                                           r"generation.max_restarts > 0.*killed by SIGKILL.*OOM"):
        held.restore_path(DIED)
    kept = held.prepare(tied_state_dict(3), 3)
    held.hold(kept, 3)  # a later version kept: restarts restore it again
    assert held.restore_path(DIED) == kept
