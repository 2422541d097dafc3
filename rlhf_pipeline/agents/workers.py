"""Threads for tool calls and environment steps that a hung call cannot starve or keep alive.

:class:`WorkerPool` gives an abandoned call's slot to a new daemon thread at once, up to
``max_abandoned`` (then :class:`PoolExhausted`). Why threads: docs/architecture.md#episodes-are-token-lists.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any


class PoolExhausted(RuntimeError):
    """More than ``max_abandoned`` calls given up on are still running; no new call is taken."""


class _Worker:
    __slots__ = ("abandoned", "thread")

    def __init__(self) -> None:
        self.abandoned = False
        self.thread: threading.Thread | None = None


class WorkerPool(Executor):
    """``max_workers`` daemon threads for calls; a call given up on frees its slot at once.

    As ``ThreadPoolExecutor`` does, a call goes to a thread that is waiting for one when there
    is such a thread, else to a new thread while fewer than ``max_workers`` take calls, else it
    waits in the queue: a turn's calls run at the same time however many threads were idle."""

    def __init__(self, max_workers: int, *, max_abandoned: int = 64, name: str = "worker") -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        if max_abandoned < 0:
            raise ValueError(f"max_abandoned must be >= 0, got {max_abandoned}")
        self.max_workers = max_workers
        self.max_abandoned = max_abandoned
        self.name = name
        self._lock = threading.Lock()
        self._calls: queue.SimpleQueue = queue.SimpleQueue()  # (future, fn, args, kwargs), or None: exit
        self._idle = threading.Semaphore(0)  # threads back from a call, waiting for the next
        self._live = 0  # threads that take calls (not abandoned)
        self._abandoned = 0  # threads still running a call given up on
        self._running: dict[Future, _Worker] = {}
        self._workers: set[_Worker] = set()  # threads alive, abandoned ones included
        self._shutdown = False
        self._started = 0

    @property
    def abandoned_running(self) -> int:
        """Threads still running a call that was given up on."""
        with self._lock:
            return self._abandoned

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot submit to a WorkerPool after shutdown")
            if self._abandoned > self.max_abandoned:
                raise PoolExhausted(f"{self._abandoned} calls that timed out are still running (more than "
                                    f"{self.max_abandoned}); no call is started until some return")
            self._calls.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and self._live < self.max_workers:
                self._start_worker()
        return future

    def abandon(self, future: Future) -> None:
        """The caller stopped waiting for ``future``: cancel it if it has not started, else leave its
        thread to finish alone (taking no more calls) and start another in its slot."""
        if future.cancel():
            return
        with self._lock:
            worker = self._running.get(future)
            if worker is None or worker.abandoned:
                return  # it finished meanwhile, or was abandoned already
            worker.abandoned = True
            self._live -= 1
            self._abandoned += 1
            if not self._shutdown:  # calls queued behind it get a thread now
                self._start_worker()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stops taking calls; queued calls still run unless ``cancel_futures``. ``wait`` joins the
        threads that take calls, never those left running a call given up on."""
        with self._lock:
            if self._shutdown:
                return
            self._shutdown = True
            if cancel_futures:
                while True:
                    try:
                        item = self._calls.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        item[0].cancel()
            threads = [w.thread for w in self._workers if not w.abandoned and w.thread is not None]
            for _ in range(self._live):
                self._calls.put(None)
        if wait:
            for thread in threads:
                if thread is not threading.current_thread():
                    thread.join()

    # ---------------------------------------------------------------- threads
    def _start_worker(self) -> None:
        """Called with the lock held."""
        worker = _Worker()
        self._started += 1
        self._live += 1
        self._workers.add(worker)
        worker.thread = threading.Thread(target=self._work, args=(worker,), daemon=True,
                                         name=f"{self.name}-{self._started}")
        worker.thread.start()

    def _work(self, worker: _Worker) -> None:
        try:
            self._serve(worker)
        finally:
            with self._lock:
                self._workers.discard(worker)

    def _serve(self, worker: _Worker) -> None:
        while True:
            item = self._calls.get()
            if item is None:  # shut down
                return
            future, fn, args, kwargs = item
            if future.set_running_or_notify_cancel():
                with self._lock:
                    self._running[future] = worker
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:  # handed to the caller, as concurrent.futures does
                    future.set_exception(exc)
                else:
                    future.set_result(result)
                del fn, args, kwargs, item
                with self._lock:
                    self._running.pop(future, None)
                    if worker.abandoned:  # its slot went to another thread when it was given up on
                        self._abandoned -= 1
                        return
            self._idle.release()
