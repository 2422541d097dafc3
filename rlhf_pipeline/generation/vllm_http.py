"""JSON over HTTP to a vLLM server on the standard library's ``http.client``, with kept-alive connections
and bounded retries (:class:`Retries`): what ``vllm_url.py`` talks through.

A request the server does not answer (refused, reset, timed out, cut short) or answers "not now" (429,
502, 503, 504) is asked again after a doubling pause, then :class:`ServerUnreachable`; safe, since every
request is whole and seeded. Another HTTP error is :class:`ServerError` at once; a reply that is not
JSON or that the caller's ``check`` refuses is a ``BadAnswer``, asked again, then said. With a
``supervisor`` (a server of ours, ``vllm_engine.OwnedServer``), an unanswered request first lets it
replace a dead server.
Design: docs/generation.md#a-vllm-server-you-started-generationurl ("A server that stops answering").
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlhf_pipeline.generation.engine import BadAnswer, EngineDied, EngineFailed

if TYPE_CHECKING:
    from rlhf_pipeline.generation.vllm_engine import OwnedServer

RETRY_STATUSES = frozenset({429, 502, 503, 504})
"""Statuses that say "not now" (overloaded, a proxy without its upstream, restarting): retried."""
MESSAGE_CHARS = 500
MAX_PAUSE_S = 30.0
MAX_RESTART_DELAY_S = 60.0


class ServerUnreachable(EngineFailed):
    """The server did not answer, or kept saying it was unavailable, through every retry."""

    def __init__(self, message: str, last_error: str = "") -> None:
        super().__init__(message)
        self.last_error = last_error
        """What the last try met (``ConnectionRefusedError: [Errno 111] Connection refused``, ``HTTP 503: ...``)."""


class ServerError(EngineFailed):
    """The server answered with an error status that asking again would not change."""

    def __init__(self, message: str, status: int, detail: str) -> None:
        super().__init__(message)
        self.status = status
        self.detail = detail
        """The server's own message (its JSON ``message``/``detail``, or the body's start)."""


def _to_stderr(line: str) -> None:
    # sys.stderr looked up at each call: a partial would keep the stream of import time, and miss a
    # redirection made later (a quiet replay rank's, a test's capture)
    print(line, file=sys.stderr, flush=True)


@dataclass
class Retries:
    """``generation.retries``, ``backoff_s`` and ``timeout_s`` as one client uses them: a request the
    server did not answer is asked again after doubling pauses; a server of ours (``vllm_engine.OwnedServer``)
    that died, or hung past ``timeout_s``, is first started again, at most ``retries`` times in a row."""

    # as GenerationSettings documents them; a pause is at most MAX_PAUSE_S before a retry and
    # MAX_RESTART_DELAY_S before a restart
    retries: int = 5
    backoff_s: float = 1.0
    timeout_s: float | None = 600.0
    announce: Callable[[str], None] = field(default=_to_stderr, repr=False)
    """Where the lines said before each restart and when a server stops answering go (the collector
    sets its console's)."""
    in_a_row: int = 0
    """Restarts since the server last answered."""
    _unanswered_said: bool = field(default=False, init=False, repr=False, compare=False)
    _said_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # here, not as Bounds on GenerationSettings: a value for an engine that does not take it is
        # refused first as one to drop (GenerationSettings.__post_init__), whatever it is
        if self.retries < 0:
            raise ValueError(f"setting 'generation.retries' must be >= 0 (0: one try, never a restart), "
                             f"got {self.retries}")
        if not self.backoff_s >= 0:
            raise ValueError(f"setting 'generation.backoff_s' must be >= 0 (seconds), got {self.backoff_s}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"setting 'generation.timeout_s' must be > 0 (seconds) or none (wait for ever), "
                             f"got {self.timeout_s}")

    @property
    def reply_timeout_s(self) -> float:
        return self.timeout_s if self.timeout_s is not None else 10**9

    def pause(self, attempt: int) -> float:
        """Seconds to wait after failed try number ``attempt`` (0 for the first)."""
        return min(max(self.backoff_s, 1e-3) * 2.0 ** attempt, max(MAX_PAUSE_S, self.backoff_s))

    def next_restart_delay_s(self, died: EngineDied, engine: str = "generation") -> float:
        """Counts one more restart and returns how long to wait before it; EngineFailed, naming the
        setting and keeping ``died``'s message (the server's log), when none is left."""
        if self.in_a_row >= self.retries:
            tried = f"after {self.in_a_row} restarts in a row" if self.in_a_row else "and is not restarted"
            raise EngineFailed(f"the {engine} engine died {tried} (generation.retries={self.retries}; "
                               f"raise it to try more, then rerun to resume): {died}") from None
        self.in_a_row += 1
        return min(self.backoff_s * 2 ** (self.in_a_row - 1), MAX_RESTART_DELAY_S)

    def answered(self) -> None:
        """The server answered: the next death starts a new run of restarts, the next silence is said."""
        self.in_a_row = 0
        self._unanswered_said = False

    def unanswered(self, line: str) -> None:
        """Says ``line`` (a request went unanswered and is asked again) once until the server answers
        again: a round's requests all meet the same silence, and the retries of one may last a minute."""
        with self._said_lock:
            said, self._unanswered_said = self._unanswered_said, True
        if not said:
            self.announce(line)


class JsonClient:
    """GET and POST JSON to ``base_url`` (``http://host:port``), retrying as the module says;
    ``supervisor``: the server is ours, and a dead one is replaced before the request goes again."""

    def __init__(self, base_url: str, retries: Retries | None = None, api_key: str | None = None,
                 supervisor: OwnedServer | None = None) -> None:
        self._base_url = base_url.rstrip("/")
        self.retries = retries or Retries()
        self.supervisor = supervisor
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key:  # a server started with --api-key refuses requests without it
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._idle: list[tuple[str, http.client.HTTPConnection]] = []  # (base URL, connection), kept alive
        self._idle_lock = threading.Lock()
        self.connections_opened = 0
        """TCP connections made so far (with requests sent, how well they are kept alive)."""
        self.requests_sent = 0
        self.request_s = 0.0
        """Seconds from sending a request to having its whole reply, summed over ``requests_sent``."""
        self.silent = False
        """The last request that ended went unanswered through every retry (:class:`ServerUnreachable`)."""

    @property
    def base_url(self) -> str:
        return self.supervisor.base_url if self.supervisor is not None else self._base_url

    @property
    def has_api_key(self) -> bool:
        return "Authorization" in self._headers

    def get(self, path: str, *, retry: bool = True) -> Any:
        return self.call("GET", path, None, retry=retry)

    def post(self, path: str, body: Any = None, *, retry: bool = True,
             check: Callable[[Any], Any] | None = None, text: bool = False) -> Any:
        return self.call("POST", path, {} if body is None else body, retry=retry, check=check, text=text)

    def call(self, method: str, path: str, body: Any, *, retry: bool = True,
             check: Callable[[Any], Any] | None = None, text: bool = False) -> Any:
        """One request; its reply as JSON (None for an empty body), or what ``check`` makes of it.
        ``check`` raises :class:`BadAnswer` (the fault, without the server's name) for a reply it
        cannot use: asked again, then said. ``retry`` False: one try only. ``text``: the reply is
        plain text (vLLM's LoRA endpoints answer so), returned as it came."""
        data = None if body is None else json.dumps(body).encode()
        tries = self.retries.retries + 1 if retry else 1
        started = time.monotonic()
        last = ""
        bad: BadAnswer | None = None  # the last try's fault, when it answered
        attempt = 0
        while attempt < tries:
            if attempt:
                if bad is None:
                    more = range(attempt - 1, tries - 1)
                    self.retries.unanswered(
                        f"the vLLM server at {self.base_url} did not answer {method} {path} ({last}): asking again, "
                        f"{len(more)} more {'try' if len(more) == 1 else 'tries'} over "
                        f"{sum(self.retries.pause(k) for k in more):.0f} s (generation.retries, generation.backoff_s)")
                time.sleep(self.retries.pause(attempt - 1))
            attempt += 1
            seen = self.supervisor.generation if self.supervisor is not None else 0
            bad = None
            try:
                status, reason, raw = self._exchange(method, path, data)
            except (http.client.HTTPException, OSError) as exc:
                # a refused connection and a timeout are OSErrors; a reply cut short of its length an
                # IncompleteRead (an HTTPException)
                last = f"{type(exc).__name__}: {exc}"
                if retry and self.supervisor is not None and self.supervisor.revive(seen, last, path, self.retries):
                    attempt -= 1  # a new server: the same request again, not a retry of a live one's
                continue
            if status >= 400:
                detail = _detail(raw, reason)
                if status not in RETRY_STATUSES:
                    self.silent = False
                    raise ServerError(f"the vLLM server at {self.base_url} answered {method} {path} with HTTP "
                                      f"{status}: {detail}", status, detail) from None
                last = f"HTTP {status}: {detail}"
                continue
            self.retries.answered()
            self.silent = False
            if text:
                return raw.decode("utf-8", errors="replace")
            try:
                answer = json.loads(raw) if raw.strip() else None
            except ValueError:
                bad = BadAnswer(f"a body that is not JSON: {bytes(raw[:60])!r}{'...' if len(raw) > 60 else ''}")
                continue
            if check is None:
                return answer
            try:
                return check(answer)
            except BadAnswer as fault:
                bad = fault
        if bad is not None:
            raise BadAnswer(f"the vLLM server at {self.base_url} answered {method} {path} with what cannot be used: "
                            f"{bad} ({'its only try' if tries == 1 else f'the last of {tries} tries'}; nothing of it "
                            f"stored); check the server (its version, its model), then rerun to resume")
        self.silent = True
        raise ServerUnreachable(
            f"the vLLM server at {self.base_url} did not answer {method} {path} after {tries} "
            f"{'try' if tries == 1 else 'tries'} over {time.monotonic() - started:.0f} s ({last}); check that it "
            f"is running, or raise generation.retries / generation.backoff_s", last)

    def _exchange(self, method: str, path: str, data: bytes | None) -> tuple[int, str, bytes]:
        """One request on a kept-alive connection (a new one where none is idle): the reply's status,
        reason and whole body. A kept connection the server had closed is replaced at once."""
        base_url = self.base_url  # a restarted server of ours has a new one
        while True:
            connection, reused = self._connection(base_url)
            started = time.perf_counter()
            try:
                connection.request(method, connection.target_prefix + path, body=data, headers=self._headers)
                reply = connection.getresponse()
                raw = reply.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                connection.close()
                if reused:  # closed by the server while idle: nothing was answered, ask on a new one
                    continue
                raise
            except BaseException:
                connection.close()  # a reply half read leaves the connection unusable
                raise
            if reply.will_close:
                connection.close()
            with self._idle_lock:  # the request threads of a round all count here
                self.requests_sent += 1
                self.request_s += time.perf_counter() - started
                if not reply.will_close:
                    self._idle.append((base_url, connection))
            return reply.status, reply.reason, raw

    def _connection(self, base_url: str) -> tuple[http.client.HTTPConnection, bool]:
        """An idle connection to ``base_url`` and True, or a new one and False; idle ones to another
        URL (a server of ours that was replaced) are closed."""
        with self._idle_lock:
            while self._idle:
                url, connection = self._idle.pop()
                if url == base_url:
                    connection.timeout = self.retries.reply_timeout_s  # new retries may have changed it
                    if connection.sock is not None:
                        connection.sock.settimeout(self.retries.reply_timeout_s)
                    return connection, True
                connection.close()
            self.connections_opened += 1
        return _new_connection(base_url, self.retries.reply_timeout_s), False

    def close(self) -> None:
        """Closes the idle connections (a later request opens a new one)."""
        with self._idle_lock:
            idle, self._idle = self._idle, []
        for _, connection in idle:
            connection.close()


def _new_connection(base_url: str, timeout_s: float) -> http.client.HTTPConnection:
    """A connection for requests to ``base_url`` (``http[s]://host:port[/prefix]``), through the proxy
    the environment names for it as ``urllib`` would (``http_proxy``, ``https_proxy``, ``no_proxy``);
    ``target_prefix``: what goes before each request's path."""
    parts = urllib.parse.urlsplit(base_url)
    https = parts.scheme == "https"
    kind = http.client.HTTPSConnection if https else http.client.HTTPConnection
    default_port = 443 if https else 80
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and not urllib.request.proxy_bypass(parts.hostname or ""):
        via = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        connection = kind(via.hostname, via.port or default_port, timeout=timeout_s)
        if https:  # a tunnel through the proxy; the request inside names the path alone
            connection.set_tunnel(parts.hostname, parts.port or default_port)
            connection.target_prefix = parts.path
        else:  # a plain proxy takes the whole URL
            connection.target_prefix = base_url
        return connection
    connection = kind(parts.hostname, parts.port or default_port, timeout=timeout_s)
    connection.target_prefix = parts.path
    return connection


def _detail(body: bytes, reason: str) -> str:
    """The server's message from an error reply (vLLM's ``{"error": {"message": ...}}``, FastAPI's
    ``{"detail": ...}``), else the start of the body, else the status line's reason."""
    raw = body.decode("utf-8", errors="replace")
    try:
        parsed = json.loads(raw)
    except ValueError:
        return raw[:MESSAGE_CHARS] or reason
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:MESSAGE_CHARS]
        for key in ("message", "detail", "error"):
            if parsed.get(key):
                return str(parsed[key])[:MESSAGE_CHARS]
    return raw[:MESSAGE_CHARS]
