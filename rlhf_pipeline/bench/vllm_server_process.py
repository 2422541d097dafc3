"""A vLLM OpenAI-compatible server started as a user starts one (docs/generation.md): ``python -m
vllm.entrypoints.openai.api_server`` under the vLLM environment's Python, on a free loopback port, its
log in a file; stopped (its whole process group) at :meth:`VLLMServerProcess.stop`.

Used by the tests of ``generation.url`` (``tests/vllm_server_process.py`` re-exports it) and by
``rlhf-pipeline bench generation``, which times its start and reads its processes' peak memory.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from rlhf_pipeline.generation.vllm_process import package_path_dir
from rlhf_pipeline.generation.vllm_server import WORKER_EXTENSION

START_TIMEOUT_S = 900.0
"""Server to healthy took 30 s on an idle 2-core machine and 146 s at load 10-16 (docs/generation.md)."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def save_model_dir(model, tokenizer, path: Path) -> Path:
    """A ``save_pretrained`` directory of ``model`` with ``tokenizer``: what a user serves."""
    from rlhf_pipeline.models.loading import transformers_bars_off

    with transformers_bars_off():  # no "Writing model shards" bar amid the benchmark's report
        model.save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)
    return path


class VLLMServerProcess:
    """``model_dir`` served as ``served_name``; ``updatable``: started with what weight updates need
    (the dev endpoints and our worker extension); ``logprobs_mode``: vLLM's setting; ``omp_threads``:
    its OpenMP threads (None: vLLM's default, one per core)."""

    def __init__(self, python: str, model_dir: Path, work_dir: Path, *, served_name: str = "tiny",
                 updatable: bool = True, logprobs_mode: str = "processed_logprobs",
                 omp_threads: int | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = work_dir / "server.log"
        package_dir = package_path_dir(work_dir)  # our package alone: no library of the project's venv
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env.update({"PYTHONPATH": str(package_dir), "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1",
                    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                    "DO_NOT_TRACK": "1"})
        if omp_threads is not None:  # as the owned engine's: vLLM's default is one thread per core
            env["OMP_NUM_THREADS"] = str(omp_threads)
        command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                   "--served-model-name", served_name, "--dtype", "float32", "--enforce-eager",
                   "--enable-prefix-caching", "--generation-config", "vllm", "--logprobs-mode", logprobs_mode,
                   "--max-num-seqs", "64", "--host", "127.0.0.1", "--port", str(self.port)]
        if updatable:
            env["VLLM_SERVER_DEV_MODE"] = "1"
            command += ["--worker-extension-cls", WORKER_EXTENSION]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            env=env, cwd=work_dir, start_new_session=True)
        try:
            self._wait_healthy(START_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the vLLM server exited with {self.process.returncode}; its log ends:\n"
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5):
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(1.0)
        raise RuntimeError(f"the vLLM server was not healthy within {timeout_s:g} s; its log ends:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")[-chars:]

    def stop(self) -> None:
        """SIGTERM to its process group (the API server and its engine core), SIGKILL if it lingers."""
        if self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
