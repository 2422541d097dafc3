"""The vLLM engine's process, seen from the collector's side: stopping it, saying how it ended, the
environment it runs in (its ``PYTHONPATH``, its threads), the files it is given (``vllm_engine.py``
starts it; ``vllm_server.py`` is what runs in it)."""

from __future__ import annotations

import os
import signal
import subprocess
from multiprocessing.connection import Connection
from pathlib import Path


def exit_status(returncode: int | None) -> str:
    """``exit code 1``, or ``killed by SIGKILL`` for a process a signal ended."""
    if returncode is not None and returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            pass
    return f"exit code {returncode}"


def stop_process(process: subprocess.Popen | None, connection: Connection | None, wait_s: float = 30.0) -> None:
    """Asks the engine to exit, then terminates it, then kills it."""
    if process is None:
        return
    if connection is not None:
        try:
            connection.send({"op": "close"})
            if connection.poll(wait_s):
                connection.recv()
        except (OSError, EOFError):
            pass
        connection.close()
    try:
        process.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def package_path_dir(work_dir: Path) -> Path:
    """A directory holding only a link to our package, for the engine's ``PYTHONPATH``: the package's
    parent may be a site-packages full of this environment's libraries, which must not shadow the
    vLLM environment's."""
    package = Path(__file__).resolve().parent.parent
    root = work_dir / "python-path"
    root.mkdir(exist_ok=True)
    link = root / package.name
    if not link.exists():
        link.symlink_to(package, target_is_directory=True)
    return root


def engine_environment(package_root: Path, *, kv_cache_gib: int, device: str) -> dict[str, str]:
    """The environment the engine's process runs in: this one's, less its Python paths, plus vLLM's
    settings for an engine alone in its process.

    On a CPU the engine computes with as many torch threads as this process has (a pipeline's
    ``threads``, 1 by default), not vLLM's default of one per core: vLLM's CPU worker keeps torch's
    default there (it turns ``torch.set_num_threads`` into a no-op before its own call to lower it),
    and the idle OpenMP threads spin between the tiny ops of each decoding step, on the cores the
    learner and the collector use: a default pipeline's run with vLLM spent 175 s generating that way,
    17 s with one thread, and took 330 s against 98 s (medians of 3, docs/generation.md).
    ``OMP_NUM_THREADS`` set in this process's environment wins."""
    import torch

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update({
        "PYTHONPATH": str(package_root),  # our package alone: none of this environment's libraries
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # in-process: this process is the engine's alone
        "VLLM_HOST_IP": "127.0.0.1",  # else its message queue binds a non-loopback address
        "VLLM_CPU_KVCACHE_SPACE": str(int(kv_cache_gib)),
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        "PYTHONUNBUFFERED": "1",
    })
    if device == "cpu":
        env.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    return env


def hard_link(source: Path, path: Path) -> Path:
    """``path``, made a hard link to ``source`` (atomically: a link beside it, renamed), so the bytes
    outlive ``source``'s removal; ``source`` itself where no link can be made (another file system)."""
    partial = path.with_suffix(".partial")
    try:
        partial.unlink(missing_ok=True)
        os.link(source, partial)
    except OSError:
        return source
    partial.replace(path)
    return path


SCRATCH_PREFIX = "rlhf-vllm-"


def make_scratch_dir() -> Path:
    """A new scratch directory for an engine (its model, weights, log), named after this process, after
    removing those of processes that no longer run: a collector killed with SIGKILL never removes its
    own, and each holds a copy of the model (a real model's is gigabytes)."""
    import shutil
    import tempfile

    for old in Path(tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}*-*"):
        owner = old.name[len(SCRATCH_PREFIX):].split("-", 1)[0]
        if owner.isdigit() and not _running(int(owner)):
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-"))


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
