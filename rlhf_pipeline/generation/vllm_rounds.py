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
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from rlhf_pipeline.generation.engine import Completion, CompletionGroup, EngineDied, EngineFailed, SampleRequest, draw_seed
from rlhf_pipeline.generation.sampling import SamplingConfig
from rlhf_pipeline.generation.vllm_server import PROGRESS_EVERY_S

if TYPE_CHECKING:
    import torch

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
    """One request's group as the engine returned it, checked against our stop rule."""
    stops = set(engine.stop_token_ids)
    out = []
    for completion in completions:
        ids = completion["token_ids"]
        early = [k for k, token in enumerate(ids[:-1]) if token in stops]
        if early or not ids or len(ids) > sent["max_tokens"]:
            raise EngineFailed(f"the vLLM engine returned {len(ids)} tokens with a stop token at "
                               f"{early} for a limit of {sent['max_tokens']}: not our stop rule")
        out.append(Completion(ids, completion["log_probs"], terminated=ids[-1] in stops))
    if len(out) != request.n:
        raise EngineFailed(f"the vLLM engine returned {len(out)} completions for a request of n={request.n}")
    return CompletionGroup(index, out, engine.policy_version, seed=sent["seed"])


def count_prompt_tokens(engine: VLLMEngine, sent: Sequence[dict[str, Any]], cached: Sequence[int]) -> None:
    engine.stats.counts_cached = True
    engine.stats.prompt_tokens += sum(len(request["prompt_ids"]) for request in sent)
    engine.stats.cached_tokens += sum(cached)


def stream_round(engine: VLLMEngine, requests: Sequence[SampleRequest], sampling: SamplingConfig,
                 generator: torch.Generator) -> Iterator[list[CompletionGroup]]:
    """The groups vLLM finishes at each step, as it finishes them (see the module docstring)."""
    engine.check_sampling(sampling)
    if not requests:
        return
    wire = wire_requests(engine, requests, sampling, generator)  # every seed before the first group
    message = {"stop_token_ids": engine.stop_token_ids, "sampling": wire_sampling(engine, sampling),
               "progress_every_s": progress_every_s(engine.restarts.hung_after_s)}
    waiting = list(range(len(requests)))  # requests whose group has not come yet
    while waiting:
        finished = False
        try:
            engine.send("stream", requests=[wire[i] for i in waiting], **message)
            try:
                while True:
                    try:
                        reply = engine.receive("sampling", hung_is_dead=True)
                    except EngineDied:
                        raise
                    except EngineFailed:  # an error reply: the server ended the stream with it
                        finished = True
                        raise
                    if reply.get("done"):
                        finished = True
                        break
                    if "progress" in reply:  # decoding, nothing finished yet: only the hang clock restarts
                        continue
                    groups = []
                    for item in reply["finished"]:
                        index = waiting[item["position"]]  # its position in the list this stream was sent
                        groups.append(to_group(engine, index, requests[index], wire[index], item["group"]))
                    count_prompt_tokens(engine, [wire[g.index] for g in groups],
                                        [item.get("cached_tokens", 0) for item in reply["finished"]])
                    yield groups
                    for item in reply["finished"]:
                        waiting[item["position"]] = -1  # yielded: not asked again after a restart
            finally:
                if not finished:  # the consumer stopped early (or a group failed our checks): read the rest
                    _drain(engine)
        except EngineDied as died:
            engine._restart(died)
            waiting = [i for i in waiting if i >= 0]
            continue
        engine.restarts.answered()
        waiting = []


def progress_every_s(hung_after_s: float | None) -> float:
    """How often a decoding engine says so: every 2 s, or five times within ``hung_after_s``."""
    return PROGRESS_EVERY_S if hung_after_s is None else min(PROGRESS_EVERY_S, hung_after_s / 5)


def _drain(engine: VLLMEngine) -> None:
    """Reads and drops a stream's remaining replies, so the next operation gets its own; a dead engine
    is left to the caller (its restart)."""
    try:
        while not engine.receive("sampling", hung_is_dead=True).get("done"):
            pass
    except EngineFailed:  # died (the caller restarts it) or answered with an error (the stream is over)
        pass
