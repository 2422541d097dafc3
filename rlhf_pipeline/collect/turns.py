"""The collector's requests to its engine: each unit (an episode, or a single-turn group) asks for its next
request as soon as it is ready, and the engine's batches do not depend on timing. Our loop decodes what
is queued as one batch when flushed, and which requests share a batch moves the last bits of their
log-probs; so a round flushes once every one of its live units waits for a request none of which has
begun, and one round at a time has requests queued in the engine (a round started ahead keeps its
requests here meanwhile), so two rounds never share a batch. A server begins each request as it comes,
so there this costs nothing. Design: docs/generation.md#rounds-groups-and-turns-as-they-finish.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from rlhf_pipeline.generation.engine import CompletionGroup, GenerationEngine, SampleRequest
from rlhf_pipeline.generation.sampling import SamplingConfig


class RoundCancelled(RuntimeError):
    """The round was abandoned (its collect failed, or the collector closed): no more of its turns run."""


@dataclass(eq=False)
class _Ask:
    round: RoundTurns
    request: SampleRequest
    seed: int
    answer: Future = field(default_factory=Future)  # what the unit waits for
    sent: Future | None = None  # the engine's future, once handed to the engine
    flushed: bool = False


class EngineTurns:
    """The engine's queue as the collector's rounds share it (one per collector)."""

    def __init__(self, engine: GenerationEngine, sampling: SamplingConfig) -> None:
        engine.check_sampling(sampling)  # a setting the engine cannot honour: refused before any round
        self.engine, self.sampling = engine, sampling
        self._lock = threading.Lock()
        self._held: list[_Ask] = []  # asked, not handed to the engine yet, in asking order
        self._sent: list[_Ask] = []  # handed to the engine, not answered
        self._busy = False  # a thread is making the engine calls that are due (one at a time)

    def round(self, units: int) -> RoundTurns:
        """The turns of a round of ``units`` units (episodes, or single-turn groups)."""
        return RoundTurns(self, units)

    # ---------------------------------------------------------------- one thread makes the engine calls
    def _run(self) -> None:
        """Makes every engine call that is due; a thread that finds another making them leaves it to it."""
        with self._lock:
            if self._busy:
                return
            self._busy = True
        while True:
            with self._lock:
                action = self._next()
                if action is None:
                    self._busy = False
                    return
            action()

    def _next(self):
        """The next engine call (under the lock): a held request of the round allowed to queue, or its flush."""
        queued = [a.round for a in self._sent if not (a.sent.running() or a.sent.done())]
        owner = queued[0] if queued else self._held[0].round if self._held else None
        if owner is None:
            return None
        ask = next((a for a in self._held if a.round is owner), None)
        if ask is not None:
            self._held.remove(ask)
            owner.in_transit += 1
            return lambda: self._send(ask)
        if owner.all_wait():
            for waiting in owner.waiting:
                waiting.flushed = True
            return self.engine.flush
        return None

    def _send(self, ask: _Ask) -> None:
        try:
            sent = self.engine.submit(ask.request, ask.seed, self.sampling)
        except BaseException as exc:  # a closed engine: the unit gets it
            with self._lock:
                ask.round.in_transit -= 1
                ask.round.waiting.remove(ask)
            ask.answer.set_exception(exc)
            return
        with self._lock:
            ask.sent = sent
            self._sent.append(ask)
            ask.round.in_transit -= 1
            ask.round.began_busy()
        sent.add_done_callback(lambda _sent: self._answered(ask))

    def _answered(self, ask: _Ask) -> None:
        with self._lock:
            r = ask.round
            if ask in r.waiting:
                r.waiting.remove(ask)
            if ask in self._sent:
                self._sent.remove(ask)
            r.ended_busy()
            others_held = any(a.round is not r for a in self._held)
        sent = ask.sent
        if sent.cancelled() or r.cancelled:
            ask.answer.set_exception(RoundCancelled("the round was abandoned"))
        elif sent.exception() is not None:
            ask.answer.set_exception(sent.exception())
        else:
            ask.answer.set_result(sent.result())
        if others_held:  # their round may queue now: not on the engine's own thread, which answers on
            threading.Thread(target=self._run, name="collector-turns", daemon=True).start()


class RoundTurns:
    """One round's requests: :meth:`ask` one unit's next request, :meth:`ended` when a unit asks for no
    more; :attr:`busy_s` the seconds at least one of its requests was in the engine."""

    def __init__(self, turns: EngineTurns, units: int) -> None:
        self.turns = turns
        self.live = units  # units that may still ask
        self.waiting: list[_Ask] = []  # asked and not answered
        self.in_transit = 0  # being handed to the engine
        self.cancelled = False
        self.busy_s = 0.0
        self._busy_since: float | None = None

    def ask(self, request: SampleRequest, seed: int) -> Future[CompletionGroup]:
        """A unit's next request, its draws from ``seed``; the future holds its group."""
        ask = _Ask(self, request, seed)
        with self.turns._lock:
            if self.cancelled:
                raise RoundCancelled("the round was abandoned")
            self.waiting.append(ask)
            self.turns._held.append(ask)
        self.turns._run()
        return ask.answer

    def ended(self) -> None:
        """One unit asks for no more turns (it ended, failed or never started)."""
        with self.turns._lock:
            self.live -= 1
        self.turns._run()

    def all_wait(self) -> bool:
        """Every live unit waits for a request none of which has begun, and not all were flushed."""
        return (self.live > 0 and len(self.waiting) == self.live and not self.in_transit
                and all(a.sent is not None and not (a.sent.running() or a.sent.done()) for a in self.waiting)
                and not all(a.flushed for a in self.waiting))

    def cancel(self) -> None:
        """Abandons the round: held requests are dropped, queued ones cancelled; units asking fail."""
        with self.turns._lock:
            self.cancelled = True
            held = [a for a in self.turns._held if a.round is self]
            self.turns._held = [a for a in self.turns._held if a.round is not self]
            sent = [a.sent for a in self.waiting if a.sent is not None]
            for ask in held:
                self.waiting.remove(ask)
        for ask in held:
            ask.answer.set_exception(RoundCancelled("the round was abandoned"))
        for future in sent:
            future.cancel()  # what the engine has not begun
        self.turns._run()

    def began_busy(self) -> None:  # under the lock
        if self._busy_since is None:
            self._busy_since = time.perf_counter()

    def ended_busy(self) -> None:  # under the lock
        if self._busy_since is not None and not any(a.sent is not None for a in self.waiting):
            self.busy_s += time.perf_counter() - self._busy_since
            self._busy_since = None
