"""The environment of the vLLM engine's process (no vLLM needed here): on a CPU it computes with as
many torch threads as the collector's process has, not one per core; OpenMP threads left idle spin
between the ops of a decoding step, on the cores the learner and the collector use."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlhf_pipeline.generation.vllm_process import engine_environment


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_a_cpu_engine_gets_this_processs_torch_threads(tmp_path, monkeypatch, torch_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch_threads(1)  # a pipeline's collector: `threads` 1
    env = engine_environment(tmp_path, kv_cache_gib=2, device="cpu")
    assert env["OMP_NUM_THREADS"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    # the server's Python path: our package alone, none of this environment's libraries
    assert [p.name for p in Path(env["PYTHONPATH"]).iterdir()] == ["rlhf_pipeline"]
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # the model's worker inside the engine core
    torch_threads(2)  # `threads` 2 (or none: torch's default)
    assert engine_environment(tmp_path, kv_cache_gib=1, device="cpu")["OMP_NUM_THREADS"] == "2"


def test_omp_num_threads_set_by_the_user_wins_and_a_gpu_engine_keeps_vllms_own(tmp_path, monkeypatch, torch_threads):
    torch_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert engine_environment(tmp_path, kv_cache_gib=1, device="cpu")["OMP_NUM_THREADS"] == "3"
    monkeypatch.delenv("OMP_NUM_THREADS")
    # on a GPU vLLM lowers its torch threads itself (the CPU worker is the one that cannot)
    assert "OMP_NUM_THREADS" not in engine_environment(tmp_path, kv_cache_gib=1, device="cuda")


def test_the_engines_message_queue_sockets_go_in_its_scratch_directory(tmp_path):
    """vLLM names its message queues' Unix sockets in ``VLLM_RPC_BASE_PATH`` (the temporary directory by
    default); a killed server left three there a start. In the engine's scratch directory they go with
    it; where a socket's name there would pass the 107 bytes a socket path may have, vLLM's default stays."""
    import shutil

    from rlhf_pipeline.generation.vllm_process import MAX_SOCKET_PATH, make_scratch_dir

    scratch = make_scratch_dir()  # where an engine of ours runs
    try:
        rpc = Path(engine_environment(scratch, kv_cache_gib=1, device="cpu")["VLLM_RPC_BASE_PATH"])
        assert rpc.is_dir() and rpc.parent == scratch.resolve()
        assert len(str(rpc / "0e6f8a0c-6e3c-4b7a-9d2e-5f1a2b3c4d5e")) <= MAX_SOCKET_PATH
    finally:
        shutil.rmtree(scratch)
    deep = tmp_path / ("d" * (MAX_SOCKET_PATH - len(str(tmp_path.resolve()))))
    assert "VLLM_RPC_BASE_PATH" not in engine_environment(deep, kv_cache_gib=1, device="cpu")
