"""Which file a restarted vLLM server is given again, when it is written and when it is removed
(``ServerWeights`` in ``generation/vllm_url_weights.py``), with real files and no server: the part of
a restart both weight routes share. The restart itself, for real: ``test_vllm_engine.py`` (files
route, CPU) and ``test_vllm_nccl.py`` (NCCL route, skipped without a GPU)."""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file, save_file

from rlhf_pipeline.generation.vllm_http import JsonClient
from rlhf_pipeline.generation.vllm_url_weights import ServerWeights, VersionFiles


def tied_state_dict(seed: int) -> dict[str, torch.Tensor]:
    embedding = torch.randn(16, 4, generator=torch.Generator().manual_seed(seed))
    return {"model.embed_tokens.weight": embedding, "lm_head.weight": embedding,  # one tensor, as a tied head
            "model.norm.weight": torch.ones(4)}


def held_weights(directory) -> ServerWeights:
    """The owned engine's weights; its client is never called here (no server: files only)."""
    return ServerWeights(JsonClient("http://127.0.0.1:9"), weights_dir=directory, inline=False, lease_s=60.0,
                         version=0, shared=False)


def test_a_published_file_is_linked_held_and_removed_once_superseded(tmp_path):
    work, published = tmp_path / "engine", tmp_path / "published"
    published.mkdir()
    held = held_weights(work)
    for version in (1, 2):
        save_file({k: v.clone() for k, v in tied_state_dict(version).items()}, published / f"v{version}.safetensors")
    first = held.keep(published / "v1.safetensors", 1)
    assert first.parent == work and first.name.startswith("weights-00000001-")
    assert os.stat(first).st_ino == os.stat(published / "v1.safetensors").st_ino  # a link, not a copy
    held.hold(first, 1)
    (published / "v1.safetensors").unlink()  # the learner prunes it: the engine's link keeps the bytes
    assert held.path == first
    torch.testing.assert_close(load_file(first)["model.norm.weight"], torch.ones(4))

    second = held.keep(published / "v2.safetensors", 2)
    held.hold(second, 2)
    assert held.path == second and not first.exists()
    assert [p.name for p in work.iterdir()] == [second.name]
    assert (published / "v2.safetensors").exists()  # the published file is never the engine's to remove


def test_a_state_dict_is_written_and_reads_back_equal(tmp_path):
    held = held_weights(tmp_path)
    state = tied_state_dict(3)
    path = held.keep(state, 1)  # a tied head's shared tensor is written as two
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no .partial left
    loaded = load_file(path)
    assert loaded.keys() == state.keys()
    for name, tensor in state.items():
        torch.testing.assert_close(loaded[name], tensor)


def test_a_legacy_pt_publication_is_kept_as_safetensors(tmp_path):
    work = tmp_path / "engine"
    state = tied_state_dict(4)
    torch.save({"state_dict": state, "version": 1}, tmp_path / "v1.pt")
    path = held_weights(work).keep(tmp_path / "v1.pt", 1)
    assert path.parent == work and path.suffix == ".safetensors"
    torch.testing.assert_close(load_file(path)["model.embed_tokens.weight"], state["model.embed_tokens.weight"])


def test_adapter_directories_share_the_weights_life_cycle_newest_kept_superseded_removed(tmp_path):
    # a LoRA run's versions (vllm_adapters.py) are directories in the same VersionFiles, keep=max_loras
    held = held_weights(tmp_path)
    adapters = VersionFiles(held.files.dir / "adapters", keep=2, tag=held.files.tag)
    for version in (1, 2, 3):
        path = adapters.path(f"v{version}")
        path.mkdir()
        (path / "adapter_config.json").write_text("{}")
        gone = adapters.hold(version, path)
    assert gone == [1] and list(adapters.held) == [2, 3]
    assert sorted(p.name for p in adapters.dir.iterdir()) == [adapters.path("v2").name, adapters.path("v3").name]
    untagged = adapters.dir / "v9"  # not written by this engine (another collector's): never removed
    untagged.mkdir()
    adapters.remove(untagged)
    adapters.close()
    assert [p.name for p in adapters.dir.iterdir()] == ["v9"]


def test_files_in_a_temporary_directory_of_their_own_go_with_it_at_close(tmp_path):
    files = VersionFiles(None, keep=1, tag="t")
    path = files.path("weights-00000001", ".safetensors")
    save_file(tied_state_dict(5) | {"lm_head.weight": torch.zeros(16, 4)}, path)
    files.hold(1, path)
    assert VersionFiles.inline(path)  # what an inline upload sends: the file's bytes, base64
    files.close()
    assert not files.dir.exists()
