"""A collector's side of a shared vLLM server's weights lease (``generation/vllm_lease.py`` is the
server's): :class:`RoundLease` holds the server on this collector's weights for one round.

A round (one ``sample`` or ``stream_batches`` call of ``VLLMURLEngine``) goes:

1. ``acquire`` until granted, pausing between asks (0.02 s doubling to 0.5 s); when the server says
   ``load``, this round uploads its weights (the engine's ``load``: the file, tagged with this round's
   lease), resets the prefix cache, and says ``ready``;
2. while the round's requests run, a thread renews the ticket every ``ttl_s / 4`` (a round may take
   longer than ``ttl_s``; a collector killed mid-round stops renewing and others go on ``ttl_s`` later);
3. every reply is kept only after :meth:`RoundLease.check` read the server's epoch unchanged since the
   grant: no weights were loaded under the round, so the reply is the held version's. A moved epoch
   (this collector stalled past ``ttl_s``, its ticket expired, another loaded) is an
   :class:`~rlhf_pipeline.generation.engine.EngineFailed`: nothing of it is stored;
4. ``release``, whatever happened.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from rlhf_pipeline.generation.engine import EngineFailed
from rlhf_pipeline.generation.vllm_http import JsonClient, ServerError

ROUND_LEASE_S = 60.0
"""A round's lease without renewal: renewed every quarter of it, it runs out only for a collector that
died or stalled mid-round, whose sharers wait this long (a stalled one loses its round, nothing stored)."""
FIRST_PAUSE_S = 0.02
LONGEST_PAUSE_S = 0.5


class LeaseUnsupported(ValueError):
    """The server's worker extension has no lease (a checkout older than this one on its PYTHONPATH)."""


class RoundLease:
    """The server's weights held at ``key`` for one round of this collector (see the module docstring).

    ``load(lease_json)``: uploads this collector's weights, tagged with the lease; ``reset()``: resets
    the server's prefix cache (raises when it cannot)."""

    def __init__(self, client: JsonClient, key: str, version: int, ttl_s: float,
                 load: Callable[[str], None], reset: Callable[[], None]) -> None:
        self.client = client
        self.key, self.version, self.ttl_s = key, int(version), float(ttl_s)
        self.holder = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._load, self._reset = load, reset
        self.epoch: int | None = None
        self.waited_s = 0.0
        """Seconds this round waited for other collectors' rounds on other weights to drain."""
        self.load_s = 0.0
        """Seconds this round spent loading its weights (0 when it joined weights already held)."""
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def _call(self, op: str, **arguments: Any) -> dict[str, Any]:
        body = {"method": "published_lease", "args": [json.dumps({"op": op, "holder": self.holder, **arguments})]}
        try:
            reply = self.client.post("/collective_rpc", body)
        except ServerError as exc:
            if "published_lease" in exc.detail or exc.status == 404:
                raise LeaseUnsupported(f"the vLLM server at {self.client.base_url} has no weights lease in its worker "
                                       f"extension ({exc.detail}): put this checkout on the server's PYTHONPATH and "
                                       f"restart it") from None
            raise
        return reply["results"][0]

    # ------------------------------------------------------------------ the round
    def __enter__(self) -> RoundLease:
        started = time.monotonic()
        pause = FIRST_PAUSE_S
        try:
            while True:
                reply = self._call("acquire", key=self.key, version=self.version, ttl_s=self.ttl_s)
                if reply["state"] == "granted":
                    break
                if reply["state"] == "loading":
                    reply = self._load_and_mark_ready()
                    if reply["state"] == "granted":
                        break
                    continue  # it expired meanwhile: ask again, from the back of the line
                time.sleep(pause)
                pause = min(2 * pause, LONGEST_PAUSE_S)
        except BaseException:
            self._release_quietly()
            raise
        self.epoch = int(reply["epoch"])
        self.waited_s = time.monotonic() - started - self.load_s
        self._renewer = threading.Thread(target=self._renew_until_released, name="vllm-lease", daemon=True)
        self._renewer.start()
        return self

    def _load_and_mark_ready(self) -> dict[str, Any]:
        started = time.monotonic()
        self._renewer = threading.Thread(target=self._renew_until_released, name="vllm-lease", daemon=True)
        self._renewer.start()  # a large model's upload may outlast ttl_s
        try:
            self._load(json.dumps({"holder": self.holder, "key": self.key, "version": self.version,
                                   "ttl_s": self.ttl_s}))
            self._reset()
        finally:
            self._stop.set()
            self._renewer.join()
            self._stop.clear()
        self.load_s += time.monotonic() - started
        return self._call("ready")

    def _renew_until_released(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                self._call("renew", ttl_s=self.ttl_s)
            except Exception:  # a missed renewal is caught by the epoch check, not here
                pass

    def check(self) -> None:
        """Raises :class:`EngineFailed` when weights were loaded since this round was granted: the
        replies come in can no longer be said to be the held version's."""
        reply = self._call("renew", ttl_s=self.ttl_s)
        if int(reply["epoch"]) != self.epoch:
            raise EngineFailed(
                f"the vLLM server at {self.client.base_url} loaded other weights under a round of version "
                f"{self.version} (its lease lapsed: this collector did not renew it within its "
                f"{self.ttl_s:g} s); the round's replies are dropped, nothing of it stored")

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        self._release_quietly()

    def _release_quietly(self) -> None:
        try:
            self._call("release")
        except Exception:  # an unanswered release expires on the server after ttl_s
            pass
