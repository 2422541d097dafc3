"""``VLLMEngine``: a vLLM engine the collector owns, in its own process, under the vLLM environment's
Python; a :class:`~rlhf_pipeline.generation.engine.GenerationEngine` like our loop.

Why its own process and its own Python. vLLM in a process seeds the global RNG, binds OpenMP threads
and memory to cores and makes ``torch.set_num_threads`` a no-op for the rest of it; its CPU build
pins ``transformers<5.20`` and pulls a CUDA ``torchvision`` that breaks ``transformers``. So the
engine runs ``python -m rlhf_pipeline.generation.vllm_server`` under another interpreter
(``generation.python``; ``rlhf-pipeline setup-vllm`` makes one), sees only our package's directory
on its path, and talks to this process over a socket pair (``vllm_server.py`` has the protocol). It
is started with the collector and stopped with it (:meth:`VLLMEngine.close`, also at interpreter exit);
if this process dies, the socket closes and the engine exits by itself. If the engine's process dies
(``kill -9``, the OOM killer), it is started again (``generation/restarts.py``: bounded, with backoff),
given the weights it held, and asked again what it was doing, with the same seeds.

What it holds to, beside the engine contract (``engine.py``):

* **Token-exact, our conventions.** Prompts go in as ``prompt_token_ids``; vLLM runs without a
  tokenizer (``skip_tokenizer_init``). Sampled ids and their log-probs come back verbatim, the
  log-probs of the sampling distribution (``logprobs_mode="processed_logprobs"``). Completions stop
  on our stop tokens only (``stop_token_ids``, with ``ignore_eos`` so neither the model's config nor
  its ``generation_config.json`` adds one; ``generation_config="vllm"``), keep the stop token as their
  last, and ``terminated`` is read from the tokens as our loop reads it (a stop token last), not from
  vLLM's ``finish_reason``.
* **Seeds.** One seed per request from the collector's generator, in submission order
  (``engine.draw_seed``); vLLM seeds completion ``i`` of a request with ``seed + i``.
* **Sampling settings, checked against ours** (``generation/sampling.py``). vLLM's sampler divides
  by the temperature, then applies top-k, then top-p, as ours. Top-k keeps ties at the k-th value,
  as ours (``logits < kth`` is masked in both). Top-p keeps a token when the probability of the
  tokens ranked above it is below ``top_p``, the same rule as ours, computed in the other sort
  direction: the kept set can differ only when tokens tie at the boundary or the cumulative sum
  rounds across ``top_p``, and the stored log-prob is then still the one vLLM sampled with. Refused
  by name: a temperature below 1e-5 (vLLM then samples greedily and returns the raw log-probs, not
  the sampling distribution's) or above 2 (vLLM's ``SamplingParams`` refuses it). ``top_k`` >= the vocabulary is sent as 0 (disabled), as ours treats it.
* **Weights in place.** :meth:`update_weights` takes a state dict (written to a safetensors file in
  the engine's scratch directory) or the path of a published safetensors file, and the worker
  extension (``vllm_worker.py``) reloads, re-ties and repacks; the prefix cache is reset after
  every load, since cached prefixes hold the old weights' keys and values (0.07 off in log-prob on a
  224-token prompt when it was not). Loads happen between ``sample`` calls, never under one.
* **Shapes it can run.** vLLM's CPU attention takes head sizes 32, 64, 80, 96, 112, 128, 160, 192,
  224, 256 and 512: a model with another is refused before the process starts, naming the sizes.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from rlhf_pipeline.generation.engine import (
    CompletionGroup,
    EngineDied,
    EngineFailed,
    GenerationEngine,
    SampleRequest,
    UnsupportedSetting,
)
from rlhf_pipeline.generation.restarts import Restarts
from rlhf_pipeline.generation.vllm_rounds import LiveStream, stream_ahead, stream_round
from rlhf_pipeline.generation.sampling import SamplingConfig
from rlhf_pipeline.generation.vllm_held_weights import HeldWeights
from rlhf_pipeline.generation.vllm_process import (
    engine_environment,
    exit_status,
    make_scratch_dir,
    package_path_dir,
    stop_process,
)
from rlhf_pipeline.generation.vllm_setup import CPU_HEAD_SIZES

GREEDY_BELOW = 1e-5
"""vLLM samples greedily below this temperature (its ``_SAMPLING_EPS``)."""
MAX_TEMPERATURE = 2.0
"""vLLM's ``SamplingParams`` refuses a temperature above this."""
LOG_TAIL_CHARS = 3000


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


class VLLMEngine(GenerationEngine):
    """A vLLM engine in its own process; see the module docstring.

    ``model_dir``: a ``save_pretrained`` directory (config and safetensors weights) the engine loads
    first, as ``policy_version``. ``python``: the interpreter with vLLM (``generation/settings.py``
    finds one). ``work_dir``: the engine's scratch directory (its log, the weight files it is
    sent); a temporary one by default, removed at :meth:`close`. ``restarts``: how often, and after how
    long, a process that died is started again (``generation/restarts.py``; default: never)."""

    name = "vllm"

    def __init__(self, model_dir: str | os.PathLike[str], *, python: str, stop_token_ids: Sequence[int],
                 vocab_size: int, policy_version: int = 0, device: str = "cpu", dtype: str = "float32",
                 max_model_len: int, seed: int = 0, kv_cache_gib: int = 1, max_num_seqs: int = 256,
                 enforce_eager: bool = True, gpu_memory_utilization: float | None = None,
                 weight_transfer_backend: str | None = None, start_timeout_s: float = 900.0,
                 work_dir: str | os.PathLike[str] | None = None, remove_work_dir: bool | None = None,
                 restarts: Restarts | None = None) -> None:
        super().__init__(stop_token_ids, policy_version)
        self.vocab_size = int(vocab_size)
        self.max_model_len = int(max_model_len)
        self.device = device
        self.work_dir = Path(work_dir) if work_dir is not None else make_scratch_dir()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._remove_work_dir = work_dir is None if remove_work_dir is None else remove_work_dir
        self.log_path = self.work_dir / "vllm.log"
        self.held_weights = HeldWeights(self.work_dir)  # what a restarted process is given again
        self.restarts = restarts if restarts is not None else Restarts(max_restarts=0)
        self._process: subprocess.Popen | None = None
        self._connection: Connection | None = None
        self.live_stream: LiveStream | None = None  # the server stream rounds are read from (vllm_rounds.py)
        self.startup_s = 0.0
        self.vllm_version = ""
        options = {
            "model_dir": str(Path(model_dir).resolve()), "dtype": dtype, "seed": int(seed),
            "max_model_len": self.max_model_len, "enforce_eager": bool(enforce_eager),
            "max_num_seqs": int(max_num_seqs), "gpu_memory_utilization": gpu_memory_utilization,
            "weight_transfer_backend": weight_transfer_backend,
        }
        self._start_args = (python, options, kv_cache_gib, start_timeout_s)  # a restart starts the same
        try:
            self._start(*self._start_args)
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_model(cls, model, *, python: str, stop_token_ids: Sequence[int], policy_version: int = 0,
                   device: str = "cpu", work_dir: str | os.PathLike[str] | None = None, **options: Any) -> VLLMEngine:
        """An engine serving ``model`` (a transformers causal LM) with its current weights: saved to
        the engine's scratch directory, loaded there. ``options``: as the constructor's."""
        config = model.config
        if device == "cpu":
            check_cpu_head_size(config)
        from rlhf_pipeline.models.loading import transformers_bars_off

        scratch = Path(work_dir) if work_dir is not None else make_scratch_dir()
        model_dir = scratch / "model"
        # no "Writing model shards" bar: it is noise in the collector's console, and its tqdm lock is a
        # named semaphore the resource tracker warns about at exit
        with transformers_bars_off():
            model.save_pretrained(model_dir, safe_serialization=True)
        dtype = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32")
        options.setdefault("max_model_len", int(config.max_position_embeddings))
        return cls(model_dir, python=python, stop_token_ids=stop_token_ids, vocab_size=int(config.vocab_size),
                   policy_version=policy_version, device=device, dtype=dtype.removeprefix("torch."),
                   work_dir=scratch, remove_work_dir=work_dir is None, **options)

    # ------------------------------------------------------------------ the process
    def _start(self, python: str, options: dict[str, Any], kv_cache_gib: int, timeout_s: float) -> None:
        env = engine_environment(package_path_dir(self.work_dir), kv_cache_gib=kv_cache_gib, device=self.device)
        python = os.path.abspath(python)  # the engine runs in its work directory; a venv's link stays a link
        ours, theirs = socket.socketpair()
        started = time.perf_counter()
        with open(self.log_path, "ab") as log:
            try:
                self._process = subprocess.Popen(
                    [python, "-m", "rlhf_pipeline.generation.vllm_server", "--fd", str(theirs.fileno())],
                    pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    env=env, cwd=self.work_dir,
                    start_new_session=True,  # a Ctrl-C in the terminal reaches the collector, which stops it
                )
            except OSError as exc:
                ours.close()
                raise EngineFailed(f"could not start the vLLM engine with generation.python={python!r}: {exc}") from None
            finally:
                theirs.close()
        self._connection = Connection(ours.detach())
        self._guard()
        self._connection.send(options)
        reply = self._receive(timeout_s, what=f"starting (its log: {self.log_path})")
        self.startup_s = time.perf_counter() - started
        self.stats.starts += 1
        self.stats.start_s = self.startup_s
        self.vllm_version = reply.get("vllm_version", "")

    def _guard(self) -> None:
        """Stops this process's engine at interpreter exit too, without keeping the engine object alive."""
        old = getattr(self, "_finalizer", None)
        if old is not None:
            old.detach()
            atexit.unregister(old)
        self._finalizer = weakref.finalize(self, stop_process, self._process, self._connection)
        atexit.register(self._finalizer)

    def _receive(self, timeout_s: float | None, what: str, hung_is_dead: bool = False) -> dict[str, Any]:
        """The engine's next reply; EngineDied when its process exited or its socket closed (or, with
        ``hung_is_dead``, it hung past ``timeout_s``: it is killed), else EngineFailed when it hung or
        answered with an error."""
        assert self._connection is not None and self._process is not None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._connection.poll(0.2):
            if self._process.poll() is not None:
                cause = f"its process exited ({exit_status(self._process.returncode)}) while {what}"
                raise EngineDied(f"the vLLM engine died: {cause}; its log ends:\n{self.log_tail()}", cause=cause)
            if deadline is not None and time.monotonic() > deadline:
                if hung_is_dead:
                    self._process.kill()
                    cause = f"it did not answer within {timeout_s:g} s while {what}: killed"
                    raise EngineDied(f"the vLLM engine hung: {cause}; its log ends:\n{self.log_tail()}", cause=cause)
                self.close()
                raise EngineFailed(f"the vLLM engine did not answer within {timeout_s:g} s while {what}; "
                                   f"its log ends:\n{self.log_tail()}")
        try:
            reply = self._connection.recv()
        except (EOFError, OSError) as exc:
            try:  # its socket closes as it dies: the exit status says more than the EOF
                code = self._process.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                code = None
            cause = (f"its process exited ({exit_status(code)}) while {what}" if code is not None
                     else f"its socket closed while {what} ({type(exc).__name__})")
            raise EngineDied(f"the vLLM engine died: {cause}; its log ends:\n{self.log_tail()}", cause=cause) from None
        if not reply.get("ok"):
            raise EngineFailed(f"the vLLM engine failed while {what}: {reply.get('error')}\n"
                               f"{reply.get('traceback', '')}{self.log_tail()}")
        return reply

    def call(self, op: str, timeout_s: float | None = None, hung_is_dead: bool = False, **message: Any) -> dict[str, Any]:
        """Sends one operation to the engine's process and returns its reply (``vllm_server.py``)."""
        self.send(op, **message)
        return self._receive(timeout_s, what=op, hung_is_dead=hung_is_dead)

    def send(self, op: str, **message: Any) -> None:
        """Sends one operation; its replies are read with :meth:`receive` (``stream`` has several)."""
        if self._connection is None:
            raise EngineFailed("the vLLM engine is closed")
        try:
            self._connection.send({"op": op, **message})
        except OSError as exc:
            cause = f"its socket closed before {op} ({type(exc).__name__})"
            raise EngineDied(f"the vLLM engine died: {cause}; its log ends:\n{self.log_tail()}", cause=cause) from None

    def receive(self, what: str, hung_is_dead: bool = True) -> dict[str, Any]:
        """The next reply, waiting at most ``restarts.hung_after_s`` (a hang then counts as a death)."""
        return self._receive(self.restarts.hung_after_s, what=what, hung_is_dead=hung_is_dead)

    def call_restarting(self, op: str, **message: Any) -> dict[str, Any]:
        """:meth:`call`, and when the engine's process died (or hung: ``restarts.hung_after_s``), the same
        call again in a new one given the weights this one held, as :attr:`restarts` allows: the same
        message, so the same seeds."""
        while True:
            try:
                reply = self.call(op, timeout_s=self.restarts.hung_after_s, hung_is_dead=True, **message)
            except EngineDied as died:
                self._restart(died)
                continue
            self.restarts.answered()
            return reply

    def _restart(self, died: EngineDied) -> None:
        """A new process in place of the dead one, holding the same weights; EngineFailed when
        :attr:`restarts` gives up (the message names the setting)."""
        while True:
            delay = self.restarts.next_delay_s(died, engine=self.name)  # raises EngineFailed past the limit
            restore = self.held_weights.restore_path(died)  # EngineFailed when the held version was not kept
            self.restarts.announce(f"the {self.name} generation engine died ({died.cause}); restart "
                                   f"{self.restarts.in_a_row} of at most {self.restarts.max_restarts} in a row "
                                   f"in {delay:g} s (its log: {self.log_path})")
            stop_process(self._process, self._connection, wait_s=5.0)  # reaps it (or ends a half-dead one)
            self._process = self._connection = None
            time.sleep(delay)
            try:
                self._start(*self._start_args)
                if restore is not None:  # the model directory holds the first version only
                    self.call("load_weights", path=str(restore))
            except EngineDied as again:
                died = again
                continue
            self.stats.restarts += 1
            return

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"
        return text[-chars:]

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    # ------------------------------------------------------------------ sampling
    def check_sampling(self, sampling: SamplingConfig) -> None:
        if sampling.temperature < GREEDY_BELOW:
            raise UnsupportedSetting(
                f"sampling.temperature={sampling.temperature:g}: vLLM samples greedily below {GREEDY_BELOW:g} and "
                f"then stores the raw log-probs, not the sampling distribution's; use a temperature >= "
                f"{GREEDY_BELOW:g} (top_k=1 for greedy), or the loop engine")
        if sampling.temperature > MAX_TEMPERATURE:
            raise UnsupportedSetting(
                f"sampling.temperature={sampling.temperature:g}: vLLM takes temperatures up to {MAX_TEMPERATURE:g}; "
                f"use one in [{GREEDY_BELOW:g}, {MAX_TEMPERATURE:g}], or the loop engine")

    @property
    def supports_streaming(self) -> bool:
        return True

    def sample(self, requests: Sequence[SampleRequest], sampling: SamplingConfig,
               generator: torch.Generator) -> list[CompletionGroup]:
        # a stream read to its end: the engine says it is decoding while nothing finishes, so a hang
        # (restarts.hung_after_s) is told from a long round; same seeds, same rows as the stream's
        groups = [group for batch in stream_round(self, requests, sampling, generator) for group in batch]
        return sorted(groups, key=lambda group: group.index)

    def stream_batches(self, requests: Sequence[SampleRequest], sampling: SamplingConfig,
                       generator: torch.Generator) -> Iterator[list[CompletionGroup]]:
        """The groups vLLM finishes at each step, from one continuous batch (``generation/vllm_rounds.py``)."""
        return stream_round(self, requests, sampling, generator)

    @property
    def supports_overlap(self) -> bool:
        return True

    def stream_ahead(self, requests: Sequence[SampleRequest], sampling: SamplingConfig,
                     generator: torch.Generator) -> Iterator[list[CompletionGroup]]:
        """Sent into the running stream (``extend``): one continuous batch for both rounds."""
        return stream_ahead(self, requests, sampling, generator)

    # ------------------------------------------------------------------ weights
    def _load_weights(self, weights: Mapping[str, torch.Tensor] | str | os.PathLike[str], version: int) -> None:
        self.check_no_requests_in_flight(version)
        # kept in the scratch directory: a restart needs it after the learner may have pruned it
        path = self.held_weights.prepare(weights, version)
        try:
            self.call_restarting("load_weights", path=str(path))
        except BaseException:
            self.held_weights.discard(path)
            raise
        self.held_weights.hold(path, version)

    def check_no_requests_in_flight(self, version: int) -> None:
        if self.live_stream is not None and self.live_stream.busy:
            raise EngineFailed(f"new weights (version {version}) under requests in flight: read the round "
                               f"submitted ahead first")

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        process, connection = self._process, self._connection
        self._process = self._connection = None
        stop_process(process, connection)
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()
            atexit.unregister(finalizer)
        if self._remove_work_dir:
            import shutil

            shutil.rmtree(self.work_dir, ignore_errors=True)
            self._remove_work_dir = False
