"""``VLLMEngine``: a vLLM server the collector starts and stops (``generation.engine=vllm``), reached
through the same client as a server at a URL (``vllm_url.py``; docs/generation.md).

What owning the server adds: its start (the model's ``save_pretrained`` directory served under the
vLLM environment's Python, ``vllm_process.py``), and one restart path: a request the server does not
answer (it died, or hung past ``generation.timeout_s`` and was killed) starts a new server, gives it
the weights the dead one held and sends every unanswered request again with its seed: the same rows,
at most ``generation.retries`` restarts in a row (``vllm_http.Retries``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlhf_pipeline.generation.engine import EngineDied, EngineFailed
from rlhf_pipeline.generation.vllm_adapters import RUNTIME_LORA_ENV, AdapterServing
from rlhf_pipeline.generation.vllm_http import Retries
from rlhf_pipeline.generation.vllm_process import (
    ServerProcess,
    engine_environment,
    make_scratch_dir,
    server_command,
)
from rlhf_pipeline.generation.vllm_setup import check_cpu_head_size
from rlhf_pipeline.generation.vllm_url import ServerStats, VLLMURLEngine

SERVED_NAME = "policy"
WHAT = {"/v1/completions": "sampling", "/collective_rpc": "loading weights", "/reset_prefix_cache": "loading weights",
        "/v1/load_lora_adapter": "loading an adapter", "/v1/unload_lora_adapter": "unloading an adapter"}
"""What the engine was doing, by the request that went unanswered, for the restart's line."""


class OwnedServer:
    """The server a :class:`VLLMEngine` starts (healthy once this returns), and its replacement when it
    dies: the client's ``supervisor`` (``vllm_http.JsonClient``), whose ``base_url`` is always the live
    server's and ``generation`` how many servers were started before it (a request remembers it when
    sent). ``reload``: gives a new server the held weights (a ``weakref.WeakMethod``: the engine it
    calls stays collectable while the server lives). ``own_work_dir``: ``work_dir`` is a
    scratch directory of its own, removed at :meth:`stop` (and when the first start fails)."""

    def __init__(self, command: list[str], env: dict[str, str], work_dir: Path, start_timeout_s: float,
                 name: str, *, own_work_dir: bool) -> None:
        self._args = (command, env, work_dir, start_timeout_s)
        self.work_dir, self._own_work_dir = work_dir, own_work_dir
        self.stats = ServerStats()
        self.name = name
        self.reload: weakref.WeakMethod | None = None
        self.generation = 0
        self._lock = threading.Lock()
        try:
            self.process = self._start()
        except BaseException as exc:
            self._remove_work_dir()
            if isinstance(exc, EngineDied):  # a first start that failed is not a death to restart from
                raise EngineFailed(str(exc)) from None
            raise

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

    def revive(self, seen: int, fault: str, what: str, retries: Retries) -> bool:
        """After a request went unanswered: True when the server is (now) newer than ``seen`` (a dead or
        hung one restarted, given the weights it held), so the request goes again at once with its seed;
        False when it lives and answers nothing worse than a pause (the client's own retries go on)."""
        with self._lock:
            if self.generation != seen:  # another request's thread replaced it meanwhile
                return True
            ended = self.process.exited()
            doing = WHAT.get(what, what)
            timed_out = "timed out" in fault or "timeout" in fault.lower()  # TimeoutError, socket.timeout
            if ended is None and not timed_out:  # a killed server's socket closes a moment before it is reaped
                try:
                    self.process.process.wait(timeout=5.0)
                except subprocess.TimeoutExpired:
                    return False  # alive: a passing fault, for the client's own retries
                ended = self.process.exited()
            if ended is not None:
                cause = f"its process exited ({ended}) while {doing}"
            else:
                cause = f"it did not answer within {retries.timeout_s:g} s while {doing}: killed"
            died = EngineDied(f"the {self.name} engine died: {cause}; its log ends:\n{self.process.log_tail()}",
                              cause=cause)
            while True:
                delay = retries.next_restart_delay_s(died, engine=self.name)  # EngineFailed past generation.retries
                retries.announce(f"the {self.name} generation engine died ({died.cause}); restart "
                                 f"{retries.in_a_row} of at most {retries.retries} in a row in "
                                 f"{delay:g} s (its log: {self.process.log_path})")
                self.process.stop(wait_s=5.0)
                time.sleep(delay)
                try:
                    self.process = self._start()
                    self.generation += 1
                    if self.reload is not None and (reload := self.reload()) is not None:
                        reload()  # the version the dead one held: the new one starts from the model directory
                except EngineDied as again:
                    died = again
                    continue
                self.stats.restarts += 1
                return True

    def stop(self) -> None:
        self.process.stop()
        self._remove_work_dir()

    def _remove_work_dir(self) -> None:
        if self._own_work_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)


class VLLMEngine(VLLMURLEngine):
    """A vLLM server this engine starts, reached as any server is; see the module docstring.

    Build it with :meth:`from_model`, which starts ``server``; the engine checks it and gives it the
    model's weights as a URL engine does, but does not wait for its health again (its start did).
    ``retries``: how often a server that died (or hung past its ``timeout_s``) is started again;
    default: never, 600 s."""

    name = "vllm"

    def __init__(self, server: OwnedServer, model: Any, *, stop_token_ids: Sequence[int], policy_version: int = 0,
                 retries: Retries | None = None, adapters: AdapterServing | None = None) -> None:
        self.server = server
        # at close, when the engine is collected or at interpreter exit (``weakref.finalize`` runs then too),
        # without keeping the engine object alive: the server stops and a scratch directory of its own goes
        self._finalizer = weakref.finalize(self, server.stop)
        super().__init__(server.base_url, model, stop_token_ids=stop_token_ids, policy_version=policy_version,
                         served_model=SERVED_NAME, weights_dir=server.work_dir / "weights",
                         retries=retries or Retries(retries=0), server=server, adapters=adapters)
        # weakly: the server (which the finalizer holds) must not keep the engine alive
        server.reload = weakref.WeakMethod(self.reload_held)
        try:
            self.vllm_version = str(self.client.get("/version").get("version", ""))
        except EngineFailed:
            self.vllm_version = ""

    @classmethod
    def from_model(cls, model: Any, *, python: str, stop_token_ids: Sequence[int], policy_version: int = 0,
                   device: str = "cpu", work_dir: str | os.PathLike[str] | None = None, seed: int = 0,
                   kv_cache_gib: int = 1, max_num_seqs: int = 256,
                   max_model_len: int | None = None, gpu_memory_utilization: float | None = None,
                   weight_transfer_backend: str | None = None, start_timeout_s: float = 900.0,
                   retries: Retries | None = None, adapters: AdapterServing | None = None) -> VLLMEngine:
        """An engine serving ``model`` (a transformers causal LM) with its current weights, as
        ``policy_version``: saved to the engine's scratch directory and served from there. ``adapters``:
        a LoRA run's (``vllm_adapters.py``): the server is started to load them by name."""
        config = model.config
        if device == "cpu":
            size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            check_cpu_head_size(int(size), f" (hidden_size {config.hidden_size} / {config.num_attention_heads} heads; "
                                           f"pipelines/default.py: --set num_heads=2 gives 32)")
        from rlhf_pipeline.models.loading import transformers_bars_off

        scratch = Path(work_dir) if work_dir is not None else make_scratch_dir()
        scratch.mkdir(parents=True, exist_ok=True)
        model_dir = scratch / "model"
        # no "Writing model shards" bar: it is noise in the collector's console
        with transformers_bars_off():
            model.save_pretrained(model_dir, safe_serialization=True)
        dtype = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32")
        command = server_command(
            os.path.abspath(python), model_dir, served_name=SERVED_NAME, dtype=dtype.removeprefix("torch."),
            max_model_len=max_model_len or int(config.max_position_embeddings), max_num_seqs=max_num_seqs,
            # on a CPU compiling starts 3-4 times slower and gains tiny models nothing; a GPU's graphs pay
            enforce_eager=device == "cpu", seed=seed, gpu_memory_utilization=gpu_memory_utilization,
            weight_transfer_backend=weight_transfer_backend, worker_in_core=device == "cpu")
        env = engine_environment(scratch, kv_cache_gib=kv_cache_gib, device=device)
        if adapters is not None:
            command += adapters.server_flags()
            env[RUNTIME_LORA_ENV] = "1"  # /v1/load_lora_adapter and /v1/unload_lora_adapter
        server = OwnedServer(command, env, scratch, start_timeout_s, cls.name, own_work_dir=work_dir is None)
        return cls(server, model, stop_token_ids=stop_token_ids, policy_version=policy_version, retries=retries,
                   adapters=adapters)

    def reload_held(self) -> None:
        """What a restarted server is given: the held weights, and a LoRA run's adapters."""
        self.weights.reload()
        if self.adapters is not None:
            self.adapters.reload(self.policy_version)

    @property
    def pid(self) -> int:
        return self.server.process.pid

    def close(self) -> None:
        super().close()
        self._finalizer()  # once
