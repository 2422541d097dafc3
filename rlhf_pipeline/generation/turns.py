"""Requests submitted one at a time, each answered as soon as it is sampled: an agent's next turn
asked for the moment its environment answered, rather than with the round's other turns.

A :class:`TurnSubmitter` takes them for an engine (``collect/agent_turns.py`` picks one). Each :meth:`TurnSubmitter.submit`
carries its own ``torch.Generator`` (the agent collector keeps one per episode, seeded at the round's
start: ``collect/agent_turns.py``), and a request's randomness comes from that generator only, so what
it samples does not depend on which other requests were in flight with it, nor on when it was sent:

* **a vLLM server** (the collector's own or one at ``generation.url``): one HTTP request per turn, each
  seeded with one draw from its generator, as many in flight as ``max_concurrency`` (the server
  batches them continuously: a turn joins the running batch between decoding steps);
* **our loop**: each turn decoded alone (a batch of one), in the order turns come, every token drawn
  from its generator: the same computation whatever else is waiting, so the same bits. Alone, it does
  not batch episodes together: on a CPU with tiny models that is slower than lockstep turns.

Whatever the engine, ``done(group, error)`` is called once per request, from another thread.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from rlhf_pipeline.generation.engine import CompletionGroup, GenerationEngine, SampleRequest

if TYPE_CHECKING:
    import torch

    from rlhf_pipeline.generation.sampling import SamplingConfig

Done = Callable[[CompletionGroup | None, BaseException | None], None]
"""Called once per submitted request: its group, or the error that ended it."""


class TurnSubmitter(ABC):
    """Requests sent as they come, answered as they finish; :attr:`busy_s` is the time at least one was
    in flight (the engine had work), from the first submission to :meth:`close`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight = 0
        self._busy_since: float | None = None
        self.busy_s = 0.0

    @abstractmethod
    def submit(self, request: SampleRequest, generator: torch.Generator, done: Done) -> None:
        """Sends ``request`` (``n`` completions, its randomness from ``generator``); ``done`` gets its group."""

    def close(self) -> None:
        """Waits for nothing: what is still in flight is dropped (its ``done`` may still be called)."""

    # ------------------------------------------------------------------ busy time
    def _started(self) -> None:
        with self._lock:
            self._in_flight += 1
            if self._busy_since is None:
                self._busy_since = time.perf_counter()

    def _ended(self, count: int = 1) -> None:
        with self._lock:
            self._in_flight -= count
            if not self._in_flight and self._busy_since is not None:
                self.busy_s += time.perf_counter() - self._busy_since
                self._busy_since = None


class ThreadedTurns(TurnSubmitter):
    """Each request is one ``engine.sample([request], sampling, generator)`` call on a pool of
    ``workers`` threads: an engine whose calls may overlap (a server) takes many, our loop one."""

    def __init__(self, engine: GenerationEngine, sampling: SamplingConfig, workers: int) -> None:
        super().__init__()
        self.engine, self.sampling = engine, sampling
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix=f"{engine.name}-turns")

    def submit(self, request: SampleRequest, generator: torch.Generator, done: Done) -> None:
        self._started()
        future = self._pool.submit(self.engine.sample, [request], self.sampling, generator)

        def answered(future: Future) -> None:
            self._ended()
            if future.cancelled():
                return
            error = future.exception()
            done(None if error is not None else future.result()[0], error)

        future.add_done_callback(answered)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

