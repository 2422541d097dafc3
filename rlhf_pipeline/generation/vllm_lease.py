"""The weights lease of a vLLM server shared by several collectors, server side: kept by our worker
extension (``vllm_worker.py``) inside the server's process, so it imports the standard library only.
The rules are docs/generation.md's "Several collectors on one server": rounds ask for the weights
they need (``key``, a digest of their bytes) in order; a round is granted beside the others on the
held weights, or, once those drained, told to load its own; every load bumps ``epoch``, and a client
keeps a reply only if the epoch did not move since its grant (``vllm_url_weights.RoundLease``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field


@dataclass
class Ticket:
    """One round's claim on the server's weights."""

    holder: str
    key: str
    version: int
    order: int
    expires_at: float
    state: str = "waiting"
    """``waiting``, ``loading`` (told to load, until ``ready``) or ``granted``."""


@dataclass
class WeightsLeases:
    """The server's lease table; every method takes ``now`` (a monotonic clock's seconds)."""

    held_key: str | None = None
    held_version: int | None = None
    ready: bool = False
    """The held weights' prefix cache was reset after their load: rounds may sample on them."""
    epoch: int = 0
    """Loads so far: a round's replies are its weights' only while this has not moved."""
    tickets: dict[str, Ticket] = field(default_factory=dict)
    _orders: itertools.count = field(default_factory=itertools.count)

    # ------------------------------------------------------------------ what the server reports
    def _state(self, ticket: Ticket | None, **extra) -> dict:
        granted = sum(t.state == "granted" for t in self.tickets.values())
        return {"state": ticket.state if ticket is not None else "lost", "epoch": self.epoch,
                "held_version": self.held_version, "rounds_in_flight": granted,
                "waiting": sum(t.state == "waiting" for t in self.tickets.values()), **extra}

    def expire(self, now: float) -> None:
        """Drops the tickets not renewed in time."""
        for ticket in [t for t in self.tickets.values() if t.expires_at < now]:
            del self.tickets[ticket.holder]
            if ticket.state == "loading":  # maybe loaded, maybe not reset: whoever goes next loads again
                self.held_key, self.held_version, self.ready = None, None, False

    # ------------------------------------------------------------------ a round's calls
    def acquire(self, holder: str, key: str, version: int, ttl_s: float, now: float) -> dict:
        """``holder``'s round asks for the weights ``key``: ``granted``, ``load`` (upload them now) or
        ``waiting`` (ask again soon); each call also renews the ticket."""
        self.expire(now)
        ticket = self.tickets.get(holder)
        if ticket is None:
            ticket = self.tickets[holder] = Ticket(holder, key, int(version), next(self._orders), now + ttl_s)
        elif ticket.key != key:
            raise ValueError(f"lease holder {holder!r} asked for weights {key[:12]} after {ticket.key[:12]}: one "
                             f"round, one set of weights")
        ticket.expires_at = now + ttl_s
        if ticket.state != "waiting":
            return self._state(ticket)
        earlier = [t for t in self.tickets.values() if t.order < ticket.order and t.state != "granted"]
        if self.ready and key == self.held_key and not any(t.key != key for t in earlier):
            ticket.state = "granted"
        elif not earlier and not any(t.state in ("granted", "loading") for t in self.tickets.values()):
            ticket.state = "loading"  # drained, and first in line: its weights go in next
        return self._state(ticket)

    def loaded(self, holder: str | None, key: str | None, version: int | None, ttl_s: float = 0.0,
               now: float = 0.0) -> None:
        """Weights were loaded (by ``holder``'s round, or by a client of no lease): a new epoch. The
        loader's ticket lives ``ttl_s`` from the load's end: its renewals wait behind the load (the
        server answers one call at a time), so an upload longer than ``ttl_s`` does not expire it."""
        ticket = self.tickets.get(holder) if holder is not None else None
        if ticket is not None and ticket.state == "loading":
            ticket.expires_at = max(ticket.expires_at, now + ttl_s)
        self.epoch += 1
        self.held_key, self.held_version = key, version
        self.ready = holder is None  # a leased load is ready once its loader reset the prefix cache

    def mark_ready(self, holder: str, now: float) -> dict:
        """The loader reset the prefix cache: its round and every waiting one on these weights, in order
        up to the first that waits for others, are granted."""
        self.expire(now)
        ticket = self.tickets.get(holder)
        if ticket is None or ticket.state != "loading" or ticket.key != self.held_key:
            return self._state(ticket, refused="this round is not the one loading the held weights")
        self.ready = True
        ticket.state = "granted"
        for other in sorted(self.tickets.values(), key=lambda t: t.order):
            if other.state == "waiting":
                if other.key != self.held_key:
                    break
                other.state = "granted"
        return self._state(ticket)

    def renew(self, holder: str, ttl_s: float, now: float) -> dict:
        """Keeps ``holder``'s ticket alive ``ttl_s`` more; ``lost`` when it had expired."""
        self.expire(now)
        ticket = self.tickets.get(holder)
        if ticket is not None:
            ticket.expires_at = now + ttl_s
        return self._state(ticket)

    def release(self, holder: str, now: float) -> dict:
        """``holder``'s round is over (or gives up waiting)."""
        self.expire(now)
        ticket = self.tickets.pop(holder, None)
        if ticket is not None and ticket.state == "loading":  # its load failed or was given up: load again
            self.held_key, self.held_version, self.ready = None, None, False
        return self._state(ticket)

    def call(self, request: dict, now: float) -> dict:
        """One client call, as the worker extension receives it: ``op`` and that op's arguments."""
        op = request.get("op")
        holder = str(request.get("holder", ""))
        if op == "acquire":
            return self.acquire(holder, str(request["key"]), int(request["version"]), float(request["ttl_s"]), now)
        if op == "ready":
            return self.mark_ready(holder, now)
        if op == "renew":
            return self.renew(holder, float(request["ttl_s"]), now)
        if op == "release":
            return self.release(holder, now)
        if op == "describe":
            self.expire(now)
            return {**self._state(None, held_key=self.held_key, ready=self.ready), "state": None}
        raise ValueError(f"unknown lease operation {op!r}")
