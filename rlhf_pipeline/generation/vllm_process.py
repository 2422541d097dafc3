"""The vLLM engine's process, seen from the collector's side: stopping it, saying how it ended, the
``PYTHONPATH`` it runs with, the files it is given (``vllm_engine.py`` starts it; ``vllm_server.py`` is
what runs in it)."""

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
