"""A thread that prepares the learner's batches ahead of time.

``Prefetcher`` runs ``produce(step)`` (a sampler's draw + the read) in a background thread
``depth`` steps ahead, so the model does not wait on disk reads, padding or packing. A draw
names rows by their store positions. With ``learner.packing`` (the default) the learner reads
them ragged (``store.read_ragged``; multi-turn trajectories joined ragged) and plans and packs
the step's micro-batches here (``learn/packed_batch.py``), so its training thread only runs the
model; without it, it reads them straight into a padded batch (``PaddedCollator.read`` ->
``store.read_padded``, the fused path). On CUDA the learner's ``produce`` pins what it made
(the packed micro-batches, or the padded batch) in this thread, and the learner copies it to
the device with ``non_blocking=True``, so the copy overlaps with compute.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any


class Prefetcher:
    """Runs ``produce(i)`` for ``i = start, start+1, ...`` in a thread, ``depth`` items ahead."""

    def __init__(self, produce: Callable[[int], Any], start_step: int, *, depth: int = 2,
                 stop: threading.Event | None = None, on_exit: Callable[[], None] | None = None,
                 keep_every_item: bool = False) -> None:
        self._produce = produce
        # run by the thread as it ends, however it ends (a data-parallel rank's last word to the
        # others, learn/distributed.py DataParallel.draw_producer)
        self._on_exit = on_exit
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = stop or threading.Event()
        # keep_every_item: a stop request neither ends the thread nor drops what it made; only close()
        # does. Data-parallel ranks: a draw rank 0 shared is trained by every rank or by none, so
        # whether a step happens is decided by what produce() gives (MainStopped), on every rank alike
        self._keep_every_item = keep_every_item
        self._closing = threading.Event() if keep_every_item else self._stop
        # set while the consumer waits for an item: a producer that polls for its input (a sampler
        # waiting for rows, rlhf_pipeline/coordination/polling.py) polls fast only then
        self.consumer_waiting = threading.Event()
        self._thread = threading.Thread(target=self._work, args=(start_step,), daemon=True,
                                        name="learner-prefetch")
        self._thread.start()

    def _work(self, step: int) -> None:
        try:
            self._loop(step)
        finally:
            if self._on_exit is not None:
                self._on_exit()

    def _loop(self, step: int) -> None:
        while not self._closing.is_set():
            try:
                item = (step, self._produce(step), None)
            except BaseException as exc:  # handed to the consumer, which re-raises it
                item = (step, None, exc)
            while not self._closing.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return
            step += 1

    def next(self, on_wait: Callable[[], None] | None = None) -> tuple[int, Any, float]:
        """``(i, item, seconds the caller waited for it)``; re-raises the producer's error.

        ``on_wait()`` is called every 0.1 s while nothing has come (the learner then tells
        collectors it is waiting, and renews that while it still is,
        ``rlhf_pipeline/coordination/pacing.py``). Raises InterruptedError once
        the stop event is set while nothing is queued: the producer drops what it was making
        when stopped, so waiting on could never end.
        """
        start = time.perf_counter()
        try:
            step, item, exc = self._queue.get_nowait()
        except queue.Empty:
            self.consumer_waiting.set()
            try:
                step, item, exc = self._wait(on_wait)
            finally:
                self.consumer_waiting.clear()
        waited = time.perf_counter() - start
        if exc is not None:
            raise exc
        return step, item, waited

    def _wait(self, on_wait: Callable[[], None] | None) -> tuple[int, Any, BaseException | None]:
        while True:
            try:
                return self._queue.get(timeout=0.1)
            except queue.Empty:
                if (self._stop.is_set() and not self._keep_every_item) or not self._thread.is_alive():
                    raise InterruptedError("prefetching stopped") from None
                if on_wait is not None:
                    on_wait()

    def close(self, timeout_s: float | None = None) -> None:
        """Stops the thread and waits for it to end; ``timeout_s``: at most that long (a thread still
        in a data-parallel broadcast whose other side failed is woken by destroying the process group)."""
        self._stop.set()
        self._closing.set()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        # drain so a producer blocked on a full queue sees the stop flag
        while self._thread.is_alive() and (deadline is None or time.monotonic() < deadline):
            try:
                self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.1)
