"""A round of requests to the owned vLLM engine (``vllm_engine.py``), whole or streamed.

What :meth:`VLLMEngine.sample` and :meth:`VLLMEngine.stream_batches` share: the requests as they cross the
socket, each with its seed drawn from the collector's generator in submission order (all of them
before anything is sent, so a group's rows never depend on when the others end), and the checks
that turn a completion the engine returned into ours (our stop rule, ``terminated`` read from the
tokens).

Streaming (the server's ``stream`` operation, ``vllm_server.py``): the server adds every request to
vLLM's engine at once (vLLM batches them continuously: a finished sequence's slot goes to a waiting
one) and sends the groups of the requests it reports finished at each step together, then ``done``.
If the engine's process dies under a stream, a new one (``VLLMEngine._restart``) is sent the
requests whose groups did not come yet, with the same seeds; the groups already yielded stand. A consumer that stops
early is not left with replies in the socket: the rest are read and dropped.

Rounds ahead (``collect/overlap.py``). One server stream can carry two rounds: while a round's tail
decodes, :func:`stream_ahead` sends the next round's requests (``extend``, seeds drawn at once) into
the same continuous batch, so the engine's slots stay full across the rounds' boundary. A
:class:`LiveStream` reads the server's replies for both and hands each group to its round (each
request carries a ``key`` that comes back with its group); a round's iterator ends once its own
groups came, and the stream's ``done`` is read by the last round on it. A death restarts the engine
and sends every request still waiting, of both rounds, with their seeds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from rlhf_pipeline.generation.engine import (
    BadAnswer,
    CompletionGroup,
    EngineDied,
    EngineFailed,
    SampleRequest,
    checked_completions,
    draw_seed,
)
from rlhf_pipeline.generation.sampling import SamplingConfig
from rlhf_pipeline.generation.vllm_server import PROGRESS_EVERY_S

if TYPE_CHECKING:
    import torch

    from rlhf_pipeline.generation.ahead import AheadStream
    from rlhf_pipeline.generation.vllm_engine import VLLMEngine


def wire_requests(engine: VLLMEngine, requests: Sequence[SampleRequest], sampling: SamplingConfig,
                  generator: torch.Generator) -> list[dict[str, Any]]:
    """The requests as sent, one seed each drawn in submission order; ValueError for one that does
    not fit the engine's ``max_model_len``."""
    wire = []
    for request in requests:  # seeds in submission order: a resumed collector sends the same
        limit = request.limit(sampling)
        if len(request.prompt_ids) + limit > engine.max_model_len:
            raise ValueError(
                f"a prompt of {len(request.prompt_ids)} tokens with max_new_tokens {limit} exceeds the vLLM "
                f"engine's max_model_len {engine.max_model_len}; shorten the prompt or the limit, or raise "
                f"generation.max_model_len (at most the model's positions)")
        wire.append({"prompt_ids": [int(t) for t in request.prompt_ids], "n": request.n, "max_tokens": limit,
                     "seed": draw_seed(generator)})
    return wire


def wire_sampling(engine: VLLMEngine, sampling: SamplingConfig) -> dict[str, Any]:
    top_k = sampling.top_k if 0 < sampling.top_k < engine.vocab_size else 0
    return {"temperature": sampling.temperature, "top_k": top_k, "top_p": sampling.top_p}


def to_group(engine: VLLMEngine, index: int, request: SampleRequest, sent: dict[str, Any],
             completions: list[dict[str, Any]]) -> CompletionGroup:
    """One request's group as the engine returned it, checked (``engine.checked_completions``) before it
    may become rows; :class:`~rlhf_pipeline.generation.engine.BadAnswer` naming the fault otherwise."""
    try:
        checked = checked_completions([(c.get("token_ids"), c.get("log_probs")) for c in completions], n=request.n,
                                      limit=sent["max_tokens"], vocab_size=engine.vocab_size,
                                      stop_token_ids=engine.stop_token_ids)
    except BadAnswer as fault:
        raise BadAnswer(f"the vLLM engine answered what cannot be a row: {fault}") from None
    return CompletionGroup(index, checked, engine.policy_version, seed=sent["seed"])


def count_prompt_tokens(engine: VLLMEngine, sent: Sequence[dict[str, Any]], cached: Sequence[int]) -> None:
    engine.stats.counts_cached = True
    engine.stats.prompt_tokens += sum(len(request["prompt_ids"]) for request in sent)
    engine.stats.cached_tokens += sum(cached)


class RoundInStream:
    """One round's requests on a :class:`LiveStream`: its finished groups, read in the order vLLM
    finished them."""

    def __init__(self, live: LiveStream, requests: Sequence[SampleRequest], wire: list[dict[str, Any]]) -> None:
        self.live = live
        self.requests = list(requests)
        self.wire = wire
        self.left = len(requests)  # requests whose group has not come yet
        self.ready: deque[list[CompletionGroup]] = deque()  # groups come, not yet yielded
        self.abandoned = False
        self.error: EngineFailed | None = None  # the stream failed under another round's read

    def batches(self) -> Iterator[list[CompletionGroup]]:
        finished = False
        try:
            while True:
                while self.ready:
                    yield self.ready.popleft()
                if not self.left:
                    break
                if self.error is not None:
                    raise self.error
                self.live.read()
            finished = True
        finally:
            if not finished:  # the consumer stopped early (or a group failed our checks): nothing of it is wanted
                self.abandon()
        self.live.close_if_idle()

    def abandon(self) -> None:
        """This round's groups are not wanted (its consumer failed, its collector rewound): the ones
        still decoding are read and dropped as they come."""
        self.abandoned = True
        self.ready.clear()
        self.live.close_if_idle()


class LiveStream:
    """The server's ``stream`` operation, read for every round submitted on it (module docstring)."""

    def __init__(self, engine: VLLMEngine, sampling: SamplingConfig) -> None:
        self.engine = engine
        self.sampling = sampling
        self.message = {"stop_token_ids": engine.stop_token_ids, "sampling": wire_sampling(engine, sampling),
                        "progress_every_s": progress_every_s(engine.restarts.hung_after_s)}
        self.waiting: dict[int, tuple[RoundInStream, int]] = {}  # key -> (round, its index there)
        self.next_key = 0
        self.open = False  # a server stream whose ``done`` has not come
        self.unacked = 0  # extends neither said ``extended`` nor answered by a stream of their own yet

    @property
    def busy(self) -> bool:
        return self.open or bool(self.waiting)

    def submit(self, requests: Sequence[SampleRequest], generator: torch.Generator) -> RoundInStream:
        """Draws the requests' seeds (in submission order) and sends them: a new stream, or an
        ``extend`` of the running one."""
        wire = wire_requests(self.engine, requests, self.sampling, generator)  # every seed before the first group
        round_ = RoundInStream(self, requests, wire)
        for index, request in enumerate(wire):
            request["key"] = self.next_key
            self.waiting[self.next_key] = (round_, index)
            self.next_key += 1
        try:
            if self.open:
                self.unacked += 1
                self.engine.send("extend", requests=wire, **self.message)
            else:
                self.open = True
                self.engine.send("stream", requests=wire, **self.message)
        except EngineDied as died:
            self._restart(died)
        return round_

    def read(self) -> None:
        """One reply of the engine, its groups handed to their rounds; a death restarts the engine and
        sends again what was waiting."""
        try:
            if self.engine.pid is None:  # closed, or stopped once its restarts gave up
                raise EngineFailed("the vLLM engine is closed")
            reply = self.engine.receive("sampling", hung_is_dead=True)
        except EngineDied as died:  # before EngineFailed, which it is a kind of
            self._restart(died)
            return
        except EngineFailed as failed:  # an error reply ends a stream: its requests are aborted there
            self._stream_ended()
            for round_, _ in self.waiting.values():
                round_.error = failed
            self.waiting.clear()
            raise
        if reply.get("done"):
            self._stream_ended()
            if not self.open:
                self.engine.restarts.answered()
            return
        if "extended" in reply:
            self.unacked -= 1
            return
        if "progress" in reply:  # decoding, nothing finished yet: only the hang clock restarts
            return
        by_round: dict[int, list[CompletionGroup]] = {}
        rounds: dict[int, RoundInStream] = {}
        sent = []
        for item in reply["finished"]:
            entry = self.waiting.pop(int(item["key"]), None)
            if entry is None:  # a request of a stream that failed: nobody waits for it
                continue
            round_, index = entry
            round_.left -= 1
            sent.append(round_.wire[index])
            if round_.abandoned:
                continue
            group = to_group(self.engine, index, round_.requests[index], round_.wire[index], item["group"])
            by_round.setdefault(id(round_), []).append(group)
            rounds[id(round_)] = round_
        count_prompt_tokens(self.engine, sent, [item.get("cached_tokens", 0) for item in reply["finished"]])
        for key, groups in by_round.items():
            rounds[key].ready.append(groups)

    def _stream_ended(self) -> None:
        if self.unacked:  # an extend that came after the stream's end runs as a stream of its own
            self.unacked -= 1
        else:
            self.open = False

    def close_if_idle(self) -> None:
        """Once no round waits for a group (the abandoned ones' are dropped as they come), reads the
        stream's end, so the engine's next operation gets its own replies."""
        if any(not round_.abandoned for round_, _ in self.waiting.values()):
            return
        try:
            while self.busy:
                self.read()
        except EngineFailed:  # died past its restarts or answered with an error: the stream is over
            self.waiting.clear()
            self.open, self.unacked = False, 0

    def _restart(self, died: EngineDied) -> None:
        """A new engine process, sent every request still waiting (both rounds'), with its seed."""
        self.engine._restart(died)  # raises EngineFailed past generation.max_restarts
        self.open, self.unacked = False, 0
        self.waiting = {key: entry for key, entry in self.waiting.items() if not entry[0].abandoned}
        waiting = [self.waiting[key][0].wire[self.waiting[key][1]] for key in sorted(self.waiting)]
        if waiting:
            self.open = True
            try:
                self.engine.send("stream", requests=waiting, **self.message)
            except EngineDied as again:
                self._restart(again)


def stream_round(engine: VLLMEngine, requests: Sequence[SampleRequest], sampling: SamplingConfig,
                 generator: torch.Generator) -> Iterator[list[CompletionGroup]]:
    """The groups vLLM finishes at each step, as it finishes them (see the module docstring)."""
    engine.check_sampling(sampling)
    if not requests:
        return
    yield from _live(engine, sampling).submit(requests, generator).batches()


def stream_ahead(engine: VLLMEngine, requests: Sequence[SampleRequest], sampling: SamplingConfig,
                 generator: torch.Generator) -> AheadStream:
    """The next round's requests sent now, while the round being read still decodes (their seeds
    drawn now); the returned iterator yields their groups, read once that round's are."""
    from rlhf_pipeline.generation.ahead import AheadStream

    engine.check_sampling(sampling)
    round_ = _live(engine, sampling).submit(requests, generator)
    return AheadStream(round_.batches(), cancel=round_.abandon)


def _live(engine: VLLMEngine, sampling: SamplingConfig) -> LiveStream:
    """The engine's running stream when it has one with these settings, else a new one."""
    live = engine.live_stream
    if live is not None and live.busy:
        if live.sampling != sampling:
            raise ValueError("a round with other sampling settings cannot join the running stream: "
                             "read the round ahead first")
        return live
    engine.live_stream = LiveStream(engine, sampling)
    return engine.live_stream


def progress_every_s(hung_after_s: float | None) -> float:
    """How often a decoding engine says so: every 2 s, or five times within ``hung_after_s``."""
    return PROGRESS_EVERY_S if hung_after_s is None else min(PROGRESS_EVERY_S, hung_after_s / 5)
