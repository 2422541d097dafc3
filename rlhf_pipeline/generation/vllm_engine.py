"""``VLLMEngine``: a vLLM server the collector starts and stops (``generation.engine=vllm``), reached
through the same client as a server at a URL (:class:`~rlhf_pipeline.generation.vllm_url.VLLMURLEngine`,
which says what every reply is checked for and how sampling follows our conventions).

What owning the server adds to that client:

* **Its start.** The model's ``save_pretrained`` directory in the engine's scratch directory, served by
  ``python -m vllm.entrypoints.openai.api_server`` under the vLLM environment's Python
  (``generation.python``; ``rlhf-pipeline setup-vllm`` makes one) with the flags the client's checks
  require (``vllm_process.server_command``), on as many OpenMP threads as this process has torch
  threads, its model's worker inside the engine core's process on a CPU (two processes, not three:
  ``server_command``'s ``worker_in_core``); then the client's checks, as for any server. The
  collector starts it while the learner warm-starts, from the model it builds, and gives it the
  warm-started weights as it gives every later version. It is stopped with the collector
  (:meth:`VLLMEngine.close`, also at interpreter exit), and with it, by its group's watcher
  (``vllm_process.WATCHER``), when the collector is killed.
* **One restart path.** A request the server does not answer (its process died: ``kill -9``, the OOM
  killer; or it hung past ``generation.timeout_s``: it is killed) makes the engine start a new server,
  give it the weights the dead one held (their file, ``vllm_url_weights.ServerWeights``), and send
  every unanswered request again, whole, with its seed: the rows are those the dead one would have
  given. Restarts are bounded (``generation/restarts.py``: ``generation.retries`` in a row, backing off
  from ``generation.backoff_s``); past them the collector stops with one line naming the setting.
  A server at a URL is not ours to restart: its requests are retried, then one line.
* **Shapes it can run.** vLLM's CPU attention takes head sizes 32, 64, 80, 96, 112, 128, 160, 192,
  224, 256 and 512: a model with another is refused before the server starts, naming the sizes.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import threading
import time
import weakref
from dataclasses import dataclass
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlhf_pipeline.generation.engine import EngineDied, EngineFailed, EngineStats, UnsupportedSetting
from rlhf_pipeline.generation.restarts import Restarts
from rlhf_pipeline.generation.vllm_http import RetryPolicy
from rlhf_pipeline.generation.vllm_process import (
    ServerProcess,
    engine_environment,
    make_scratch_dir,
    package_path_dir,
    server_command,
)
from rlhf_pipeline.generation.vllm_setup import CPU_HEAD_SIZES
from rlhf_pipeline.generation.vllm_url import VLLMURLEngine

SERVED_NAME = "policy"
WHAT = {"/v1/completions": "sampling", "/collective_rpc": "loading weights", "/reset_prefix_cache": "loading weights"}
"""What the engine was doing, by the request that went unanswered, for the restart's line."""


def head_size(config: Any) -> int:
    """A transformers config's attention head size."""
    explicit = getattr(config, "head_dim", None)
    return int(explicit) if explicit else int(config.hidden_size) // int(config.num_attention_heads)


def check_cpu_head_size(config: Any) -> None:
    """Refuses a model whose head size vLLM's CPU attention does not take, naming the sizes it does."""
    size = head_size(config)
    if size not in CPU_HEAD_SIZES:
        raise UnsupportedSetting(
            f"vLLM's CPU attention takes head sizes {list(CPU_HEAD_SIZES)}; this model's is {size} (hidden_size "
            f"{config.hidden_size} / {config.num_attention_heads} heads): build the model with a head size it takes "
            f"(pipelines/default.py: --set num_heads=2 gives 64/2 = 32), or generate with the loop engine"
        )


@dataclass
class OwnedServerStats(EngineStats):
    """The engine's stats, and its HTTP client's since the last round: ``http_requests`` sent,
    ``http_request_s`` from sending each to having its whole reply (summed: the requests of a round
    are in flight together), ``http_connections`` opened (kept alive, few)."""

    client: Any = None
    http_reported: tuple[int, float, int] = (0, 0.0, 0)

    def update_metrics(self) -> dict[str, float]:
        if self.client is None:  # still starting
            return super().update_metrics()
        now = (self.client.requests_sent, self.client.request_s, self.client.connections_opened)
        before, self.http_reported = self.http_reported, now
        return {**super().update_metrics(), "http_requests": float(now[0] - before[0]),
                "http_request_s": now[1] - before[1], "http_connections": float(now[2] - before[2])}


class OwnedServer:
    """The server a :class:`VLLMEngine` started, and its replacement when it dies: the client's
    ``supervisor`` (``vllm_http.Supervisor``). ``reload``: gives a new server the held weights."""

    def __init__(self, command: list[str], env: dict[str, str], work_dir: Path, start_timeout_s: float,
                 restarts: Restarts, stats: Any, name: str) -> None:
        self._args = (command, env, work_dir, start_timeout_s)
        self.restarts = restarts
        self.stats = stats
        self.name = name
        self.reload: Any = None
        self.hung_after_s: float | None = None
        self.generation = 0
        self._lock = threading.Lock()
        self.process = self._start()

    def _start(self) -> ServerProcess:
        try:
            process = ServerProcess(*self._args)
        except RuntimeError as exc:
            raise EngineDied(f"the vLLM engine did not start: {exc}", cause=str(exc).splitlines()[0]) from None
        except OSError as exc:
            raise EngineFailed(f"could not start the vLLM engine with generation.python={self._args[0][0]!r}: "
                               f"{exc}") from None
        self.stats.starts += 1
        self.stats.start_s = process.start_s
        return process

    @property
    def base_url(self) -> str:
        return self.process.url

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def log_path(self) -> Path:
        return self.process.log_path

    def answered(self) -> None:
        self.restarts.answered()

    def revive(self, seen: int, fault: str, what: str) -> bool:
        with self._lock:
            if self.generation != seen:  # another request's thread replaced it meanwhile
                return True
            ended = self.process.exited()
            doing = WHAT.get(what, what)
            timed_out = "timed out" in fault or "TimeoutError" in fault or "timeout" in fault
            if ended is None and not timed_out:  # a killed server's socket closes a moment before it is reaped
                try:
                    self.process.process.wait(timeout=5.0)
                except subprocess.TimeoutExpired:
                    return False  # alive: a passing fault, for the client's own retries
                ended = self.process.exited()
            if ended is not None:
                cause = f"its process exited ({ended}) while {doing}"
            else:
                cause = f"it did not answer within {self.hung_after_s:g} s while {doing}: killed"
            died = EngineDied(f"the {self.name} engine died: {cause}; its log ends:\n{self.process.log_tail()}",
                              cause=cause)
            while True:
                delay = self.restarts.next_delay_s(died, engine=self.name)  # EngineFailed past generation.retries
                self.restarts.announce(f"the {self.name} generation engine died ({died.cause}); restart "
                                       f"{self.restarts.in_a_row} of at most {self.restarts.max_restarts} in a row in "
                                       f"{delay:g} s (its log: {self.process.log_path})")
                self.process.stop(wait_s=5.0)
                time.sleep(delay)
                try:
                    self.process = self._start()
                    self.generation += 1
                    if self.reload is not None:
                        self.reload()  # the version the dead one held: the new one starts from the model directory
                except EngineDied as again:
                    died = again
                    continue
                self.stats.restarts += 1
                return True

    def stop(self) -> None:
        self.process.stop()


class VLLMEngine(VLLMURLEngine):
    """A vLLM server this engine starts, reached as any server is; see the module docstring.

    Build it with :meth:`from_model`. ``restarts``: how often a server that died is started again
    (default: never); ``timeout_s``: the longest wait for one reply before a live server counts as hung."""

    name = "vllm"

    @classmethod
    def from_model(cls, model: Any, *, python: str, stop_token_ids: Sequence[int], policy_version: int = 0,
                   device: str = "cpu", work_dir: str | os.PathLike[str] | None = None, seed: int = 0,
                   kv_cache_gib: int = 1, max_num_seqs: int = 256,
                   max_model_len: int | None = None, gpu_memory_utilization: float | None = None,
                   weight_transfer_backend: str | None = None, start_timeout_s: float = 900.0,
                   restarts: Restarts | None = None, timeout_s: float | None = 600.0,
                   backoff_s: float = 1.0) -> VLLMEngine:
        """An engine serving ``model`` (a transformers causal LM) with its current weights, as
        ``policy_version``: saved to the engine's scratch directory and served from there."""
        config = model.config
        if device == "cpu":
            check_cpu_head_size(config)
        from rlhf_pipeline.models.loading import transformers_bars_off

        scratch = Path(work_dir) if work_dir is not None else make_scratch_dir()
        scratch.mkdir(parents=True, exist_ok=True)
        model_dir = scratch / "model"
        # no "Writing model shards" bar: it is noise in the collector's console
        with transformers_bars_off():
            model.save_pretrained(model_dir, safe_serialization=True)
        dtype = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32")
        command = server_command(
            os.path.abspath(python), model_dir, 0, served_name=SERVED_NAME, dtype=dtype.removeprefix("torch."),
            max_model_len=max_model_len or int(config.max_position_embeddings), max_num_seqs=max_num_seqs,
            # on a CPU compiling starts 3-4 times slower and gains tiny models nothing; a GPU's graphs pay
            enforce_eager=device == "cpu", seed=seed, gpu_memory_utilization=gpu_memory_utilization,
            weight_transfer_backend=weight_transfer_backend, worker_in_core=device == "cpu")
        command[command.index("--port") + 1] = "{port}"
        engine = cls.__new__(cls)
        engine.work_dir, engine._remove_work_dir = scratch, work_dir is None
        engine.restarts = restarts if restarts is not None else Restarts(max_restarts=0, hung_after_s=timeout_s)
        stats = OwnedServerStats()
        env = engine_environment(package_path_dir(scratch), kv_cache_gib=kv_cache_gib, device=device)
        try:
            server = OwnedServer(command, env, scratch, start_timeout_s, engine.restarts, stats, cls.name)
        except EngineDied as died:
            engine._cleanup()
            raise EngineFailed(str(died)) from None
        except BaseException:
            engine._cleanup()
            raise
        engine.server = server
        engine._guard()
        retry = RetryPolicy(retries=engine.restarts.max_restarts, backoff_s=max(backoff_s, 1e-3), max_backoff_s=max(30.0, backoff_s),
                            timeout_s=timeout_s if timeout_s is not None else 10**9)
        try:
            VLLMURLEngine.__init__(engine, server.base_url, model, stop_token_ids=stop_token_ids,
                                   policy_version=policy_version, served_model=SERVED_NAME,
                                   weights_dir=scratch / "weights", retry=retry, wait_s=start_timeout_s,
                                   supervisor=server, shared=False)
        except BaseException:
            engine.close()
            raise
        stats.client = engine.client
        stats.http_reported = (engine.client.requests_sent, engine.client.request_s, engine.client.connections_opened)
        engine.stats = stats  # the server's starts and restarts, beside the client's figures
        engine.restarts = engine.restarts  # the reply timeout, from the one place a test or a setting sets it
        server.reload = engine.weights.reload
        engine.vllm_version = engine._server_version()
        return engine

    def _server_version(self) -> str:
        try:
            return str(self.client.get("/version").get("version", ""))
        except EngineFailed:
            return ""

    @property
    def restarts(self) -> Restarts:
        return self._restarts

    @restarts.setter
    def restarts(self, value: Restarts) -> None:  # the server's restarts and the reply timeout follow
        import dataclasses

        self._restarts = value
        server = getattr(self, "server", None)
        if server is not None:
            server.restarts = value
            server.hung_after_s = value.hung_after_s
        client = getattr(self, "client", None)
        if client is not None:
            timeout_s = value.hung_after_s if value.hung_after_s is not None else 10**9
            client.retry = dataclasses.replace(client.retry, timeout_s=timeout_s)

    @property
    def pid(self) -> int | None:
        server = getattr(self, "server", None)
        return None if server is None else server.pid

    @property
    def log_path(self) -> Path:
        return self.server.log_path

    @property
    def startup_s(self) -> float:
        return self.stats.start_s

    def _guard(self) -> None:
        """Stops the server at interpreter exit too, without keeping the engine object alive."""
        self._finalizer = weakref.finalize(self, self.server.stop)
        atexit.register(self._finalizer)

    def close(self) -> None:
        super().close()
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            atexit.unregister(finalizer)
            finalizer()  # stops the server, once
        self._cleanup()

    def _cleanup(self) -> None:
        if getattr(self, "_remove_work_dir", False):
            import shutil

            shutil.rmtree(self.work_dir, ignore_errors=True)
            self._remove_work_dir = False
