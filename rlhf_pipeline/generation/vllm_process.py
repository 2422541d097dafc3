"""A vLLM server process started from here (``python -m vllm.entrypoints.openai.api_server`` under the
vLLM environment's Python, on a free loopback port, with the flags our client's checks need, its log
in a file), in a session of its own and stopped with its whole process group. A watcher in that
group (:data:`WATCHER`) ends it when the process that started it dies by any signal: vLLM's API
server, told SIGTERM, was seen to outlive its engine core for minutes.
Design: docs/generation.md#running-a-pipeline-with-it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from rlhf_pipeline.processes import exit_status, free_port

WORKER_EXTENSION = "rlhf_pipeline.generation.vllm_worker.PublishedWeightsLoader"
SCRATCH_PREFIX = "rlhf-vllm-"
LOG_TAIL_CHARS = 3000


MAX_SOCKET_PATH = 107  # bytes of a Unix socket's path (sun_path, less its terminating NUL) on Linux


def engine_environment(work_dir: Path, *, kv_cache_gib: int, device: str) -> dict[str, str]:
    """The environment the server runs in: this one's, less its Python paths, plus vLLM's settings. On
    a CPU, as many OpenMP threads as this process has torch threads (``OMP_NUM_THREADS`` set here wins),
    not one per core: idle threads spinning between a tiny model's ops on the learner's cores made a
    default run take 330 s against 98 s (docs/generation.md)."""
    import torch

    package, package_root = Path(__file__).resolve().parent.parent, Path(work_dir) / "python-path"
    package_root.mkdir(parents=True, exist_ok=True)
    if not (package_root / package.name).exists():
        (package_root / package.name).symlink_to(package, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update({
        # a link to our package alone: its parent may be a site-packages whose libraries would shadow vLLM's
        "PYTHONPATH": str(package_root),
        "VLLM_HOST_IP": "127.0.0.1",  # else its message queue binds a non-loopback address
        "VLLM_CPU_KVCACHE_SPACE": str(int(kv_cache_gib)),
        "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc and /reset_prefix_cache: new weights in place
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        "PYTHONUNBUFFERED": "1",
    })
    # vLLM's message queues are Unix sockets named by a UUID in this directory (the temporary directory by
    # default): a server that is killed leaves them, three a start, and the test suite left hundreds in /tmp.
    # In the engine's scratch directory they go with it (make_scratch_dir); not where the name would pass a
    # socket path's 107 bytes
    rpc = Path(work_dir).resolve() / "rpc"
    if len(str(rpc)) + len("/") + 36 <= MAX_SOCKET_PATH:
        rpc.mkdir(parents=True, exist_ok=True)
        env["VLLM_RPC_BASE_PATH"] = str(rpc)
    if device == "cpu":
        env.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
        # with server_command's worker_in_core: the CPU platform refuses the in-core worker unless this
        # says the engine (not the API server: that always starts its engine core apart) may run one
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def server_command(python: str, model_dir: Path, *, served_name: str, dtype: str = "float32",
                   max_model_len: int | None = None, max_num_seqs: int = 256, enforce_eager: bool = True,
                   seed: int = 0, gpu_memory_utilization: float | None = None,
                   weight_transfer_backend: str | None = None, updatable: bool = True,
                   logprobs_mode: str = "processed_logprobs", worker_in_core: bool = False) -> list[str]:
    """The documented server command (docs/generation.md): token ids in and out, the sampling
    distribution's log-probs, no generation config of the model's, a prefix cache (reset after every
    load), with ``updatable`` our worker extension, on the port :class:`ServerProcess` picks.
    ``worker_in_core`` (a CPU engine of ours, with ``engine_environment``'s variable): the model's
    worker runs in the engine core's process, one process and one boundary per step fewer."""
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", served_name, "--dtype", dtype, "--seed", str(seed),
               "--enable-prefix-caching", "--generation-config", "vllm", "--logprobs-mode", logprobs_mode,
               "--max-num-seqs", str(max_num_seqs), "--host", "127.0.0.1", "--port", "{port}",
               "--enable-prompt-tokens-details", "--disable-uvicorn-access-log"]
    if enforce_eager:
        command.append("--enforce-eager")
    if max_model_len is not None:
        command += ["--max-model-len", str(max_model_len)]
    if gpu_memory_utilization is not None:
        command += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    if weight_transfer_backend:
        command += ["--weight-transfer-config", f'{{"backend": "{weight_transfer_backend}"}}']
    if updatable:
        command += ["--worker-extension-cls", WORKER_EXTENSION]
    if worker_in_core:
        command += ["--distributed-executor-backend", "uni"]
    return command


WATCHER_MARK = "--rlhf-watch-server-group"
"""In the watcher's command line (``ps`` shows it there; the tests tell it apart by it)."""
WATCHER = r"""
import os, signal, sys, time
watch_fd, grace_s, server = int(sys.argv[2]), float(sys.argv[3]), sys.argv[4:]
if os.fork():  # this process becomes the server, the child watches: both in the server's new session
    os.close(watch_fd)
    os.execv(server[0], server)
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group's SIGTERM below is for the others
while os.read(watch_fd, 1):  # end of file: the starter is gone (or stopped the server), whatever killed it
    pass
leader = os.getpgid(0)
os.killpg(leader, signal.SIGTERM)
deadline = time.monotonic() + grace_s
while time.monotonic() < deadline:
    try:
        os.kill(leader, 0)
    except ProcessLookupError:
        break
    time.sleep(0.1)
os.killpg(leader, signal.SIGKILL)  # what is left of the group, this watcher last
"""
"""The start of every server (``python -I -c WATCHER WATCHER_MARK FD GRACE_S SERVER-COMMAND...``, in a
session of its own): it forks a watcher and execs the server, whose pid it keeps. The watcher reads a
pipe whose write end only the starter holds; at its end of file (the starter stopped the server or died,
``kill -9`` included) it sends the group SIGTERM, then SIGKILL after ``GRACE_S`` at most.
``PR_SET_PDEATHSIG`` would follow only the starting thread, and reach only the API server."""
GRACE_S = 5.0


class ServerProcess:
    """One vLLM server: ``command`` (``server_command``'s, with ``{port}`` for the port) under ``env``,
    in ``work_dir`` (its log there); healthy when the constructor returns, else RuntimeError with the
    log's tail (``start_timeout_s`` at most)."""

    def __init__(self, command: list[str], env: dict[str, str], work_dir: Path, start_timeout_s: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.work_dir = Path(work_dir)
        self.log_path = self.work_dir / "server.log"
        if shutil.which(command[0]) is None:  # said here, not by the watcher's exec in the server's log
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), command[0])
        started = time.perf_counter()
        watch_read, self._watch_write = os.pipe()  # the write end is ours alone: not inherited
        command = [str(self.port) if part == "{port}" else part for part in command]
        try:
            with open(self.log_path, "ab") as log:
                self.process = subprocess.Popen(
                    [sys.executable, "-I", "-c", WATCHER, WATCHER_MARK, str(watch_read), str(GRACE_S), *command],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.work_dir,
                    start_new_session=True, pass_fds=(watch_read,))
        except BaseException:
            os.close(self._watch_write)
            raise
        finally:
            os.close(watch_read)
        try:
            self._wait_healthy(start_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.perf_counter() - started

    @property
    def pid(self) -> int:
        return self.process.pid

    def exited(self) -> str | None:
        """How the server's process ended (``killed by SIGKILL``); None while it runs."""
        code = self.process.poll()
        return None if code is None else exit_status(code)

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ended = self.exited()
            if ended is not None:
                raise RuntimeError(f"the vLLM server exited ({ended}) while starting; its log ends:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5):
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)
        raise RuntimeError(f"the vLLM server was not healthy within {timeout_s:g} s (generation.start_timeout_s); "
                           f"its log ends:\n{self.log_tail()}")

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def stop(self, wait_s: float = 30.0) -> None:
        """SIGTERM to its process group (the API server, its engine core, any worker), SIGKILL if it lingers
        (and to the watcher, which ignores SIGTERM)."""
        with contextlib.suppress(ProcessLookupError):  # the group is gone (its leader reaped, its children with it)
            os.killpg(self.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=wait_s)
        # whatever of the group is left (an engine core whose API server was killed, the watcher)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        if self._watch_write >= 0:
            os.close(self._watch_write)
            self._watch_write = -1


def make_scratch_dir() -> Path:
    """A new scratch directory for an engine (its model, weights, log), named after this process, after
    removing those of processes that no longer run: a collector killed with SIGKILL never removes its
    own, and each holds a copy of the model (a real model's is gigabytes)."""
    import tempfile

    from rlhf_pipeline.files.processes import pid_running

    for old in Path(tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}*-*"):
        owner = old.name[len(SCRATCH_PREFIX):].split("-", 1)[0]
        if owner.isdigit() and not pid_running(int(owner)):
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-"))

