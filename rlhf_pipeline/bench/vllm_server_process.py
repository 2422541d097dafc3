"""A vLLM OpenAI-compatible server started as a user starts one (docs/generation.md), with the command
the collector's own engine runs (``generation/vllm_process.py``); stopped (its whole process group) at
:meth:`VLLMServerProcess.stop`.

Used by the tests of ``generation.url`` and by
``rlhf-pipeline bench generation``, which times its start and reads its processes' peak memory.
"""

from __future__ import annotations

from pathlib import Path

from rlhf_pipeline.generation.vllm_process import ServerProcess, engine_environment, server_command
from rlhf_pipeline.processes import free_port

START_TIMEOUT_S = 900.0
"""Server to healthy took 30 s on an idle 2-core machine and 146 s at load 10-16 (docs/generation.md)."""
__all__ = ["START_TIMEOUT_S", "VLLMServerProcess", "free_port", "save_model_dir"]


def save_model_dir(model, tokenizer, path: Path) -> Path:
    """A ``save_pretrained`` directory of ``model`` with ``tokenizer``: what a user serves."""
    from rlhf_pipeline.models.loading import transformers_bars_off

    with transformers_bars_off():  # no "Writing model shards" bar amid the benchmark's report
        model.save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)
    return path


class VLLMServerProcess(ServerProcess):
    """``model_dir`` served as ``served_name``; ``updatable``: started with what weight updates need
    (the dev endpoints and our worker extension); ``logprobs_mode``: vLLM's setting; ``omp_threads``:
    its OpenMP threads (None: vLLM's default, one per core, unless ``OMP_NUM_THREADS`` is set here)."""

    def __init__(self, python: str, model_dir: Path, work_dir: Path, *, served_name: str = "tiny",
                 updatable: bool = True, logprobs_mode: str = "processed_logprobs",
                 omp_threads: int | None = None) -> None:
        env = engine_environment(work_dir, kv_cache_gib=1, device="gpu")  # keeps vLLM's threads
        if omp_threads is not None:  # as the owned engine's
            env["OMP_NUM_THREADS"] = str(omp_threads)
        if not updatable:
            env.pop("VLLM_SERVER_DEV_MODE")
        command = server_command(python, model_dir, served_name=served_name, max_num_seqs=64,
                                 updatable=updatable, logprobs_mode=logprobs_mode)
        super().__init__(command, env, Path(work_dir), START_TIMEOUT_S)
