"""A next round submitted while the current one's tail decodes (``GenerationEngine.stream_ahead``;
``collect/overlap.py`` decides when): :class:`AheadStream`, what an engine returns for it, and
:func:`stream_in_background` for an engine whose rounds are independent requests (a vLLM server at
a URL: one HTTP request per prompt), whose stream then runs in a thread of its own from now and is
read later.

Seeds. Such an engine draws one seed per request from the collector's generator, in submission
order (``engine.draw_seed``), before it sends anything. The thread's stream draws them from a copy
of the generator, and the collector's own generator is advanced by the same draws here, before this
returns: both then hold the state the engine's own ``stream_batches`` would have left, and the
thread never touches the collector's generator while the current round is read.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from rlhf_pipeline.generation.engine import CompletionGroup, SampleRequest, draw_seed

if TYPE_CHECKING:
    from rlhf_pipeline.generation.engine import GenerationEngine
    from rlhf_pipeline.generation.sampling import SamplingConfig

_END = object()


def stream_in_background(engine: GenerationEngine, requests: Sequence[SampleRequest], sampling: SamplingConfig,
                         generator: torch.Generator) -> Iterator[list[CompletionGroup]]:
    """``engine.stream_batches(requests, ...)`` started now in a thread; the iterator yields its lists
    of groups (or raises its error) when read. Closing the iterator early stops the thread's stream
    after the requests already sent (their replies are dropped)."""
    own = torch.Generator(device=generator.device)
    own.set_state(generator.get_state())
    for _ in requests:  # the draws the thread's stream makes from its copy, in the same order
        draw_seed(generator)
    stream = BackgroundStream(engine.stream_batches(requests, sampling, own))
    return AheadStream(_read(stream), cancel=stream.stop)


class AheadStream(Iterator[list[CompletionGroup]]):
    """The groups of a round submitted ahead, as lists that finished together; :meth:`cancel` says
    they are not wanted (read or not: the engine drops them as they come, and stops what it can)."""

    def __init__(self, batches: Iterator[list[CompletionGroup]], cancel: Callable[[], None]) -> None:
        self._batches = batches
        self._cancel = cancel

    def __next__(self) -> list[CompletionGroup]:
        return next(self._batches)

    def cancel(self) -> None:
        close = getattr(self._batches, "close", None)
        if close is not None:
            close()
        self._cancel()

    close = cancel  # a reader that stops early, as a generator's close()


class BackgroundStream:
    """A stream of lists of groups consumed by a daemon thread into a queue."""

    def __init__(self, batches: Iterator[list[CompletionGroup]]) -> None:
        self.items: queue.Queue = queue.Queue()
        self.stopped = threading.Event()
        self._batches = batches
        self.thread = threading.Thread(target=self._run, name="round-ahead", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for finished_together in self._batches:
                self.items.put(finished_together)
                if self.stopped.is_set():
                    break
        except BaseException as exc:  # handed to the reader, which raises it where the round is read
            self.items.put(exc)
        finally:
            self._batches.close()  # a stream stopped early cancels what it has not sent
            self.items.put(_END)

    def stop(self) -> None:
        self.stopped.set()


def _read(stream: BackgroundStream) -> Iterator[list[CompletionGroup]]:
    try:
        while True:
            item = stream.items.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stream.stop()
