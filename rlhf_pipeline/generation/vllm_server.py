"""What runs in a vLLM engine's own process: ``python -m rlhf_pipeline.generation.vllm_server --fd N``.

:class:`~rlhf_pipeline.generation.vllm_engine.VLLMEngine` starts this module under the vLLM
environment's Python with one end of a socket pair as file descriptor ``N``, and talks to it in
pickled dicts over that socket (``multiprocessing.connection``), one request and one reply at a
time. stdout and stderr are vLLM's log, which the client keeps in a file. The process builds a
``vllm.LLM`` in-process (no further worker processes: this process is already the engine's alone, so
vLLM's global side effects -- it seeds the global RNG, binds OpenMP threads, turns
``torch.set_num_threads`` into a no-op -- stay here), answers, and exits when told to or when the
socket closes (its collector died).

It imports the standard library, torch, safetensors and vllm only: the vLLM environment has
neither our dependencies nor our pins (``generation/vllm_setup.py``). Plain lists and dicts cross
the socket, never tensors.

Operations (``op`` of each request; every reply has ``ok`` and, when False, ``error``):

* ``stream``: ``requests`` (``prompt_ids``, ``n``, ``max_tokens``, ``seed``), ``sampling``
  (``temperature``, ``top_k``, ``top_p``), ``stop_token_ids`` -> one reply per engine step at
  which requests finished (``finished``: per request ``position``, its place in ``requests``,
  ``group``: per completion ``token_ids``, ``log_probs``, ``finish_reason``; ``cached_tokens``: its
  prompt tokens found in the prefix cache), a ``progress`` reply every ``progress_every_s`` of
  steps that finished none, then ``done``; an error reply ends it too. A whole round
  (``VLLMEngine.sample``) is a stream read to its end. While a stream runs the client may send
  ``extend`` (the next round's requests, submitted while this one's tail decodes:
  ``generation/vllm_rounds.py``): they join the running batch, the reply ``extended`` says so, and
  ``done`` comes once they finished too; an ``extend`` read after the stream's ``done`` runs as a
  ``stream`` of its own (no ``extended``). A request's ``key``, when given, comes back with its group;
* ``load_weights``: ``path`` of a safetensors file -> loaded through the worker extension
  (``generation/vllm_worker.py``), then the prefix cache is reset;
* ``turns``: a session of requests added one by one while the engine steps (:func:`turns`: an
  agent's next turn sent as soon as its environment answered), replies as in ``stream`` but keyed;
* ``nccl_init`` / ``nccl_start`` / ``nccl_update`` / ``nccl_finish``: vLLM's weight-transfer
  protocol, for the GPU route (``generation/vllm_nccl.py``);
* ``close``: replies, then the process exits.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

WORKER_EXTENSION = "rlhf_pipeline.generation.vllm_worker.PublishedWeightsLoader"
PROGRESS_EVERY_S = 2.0
"""A stream's longest silence while the engine decodes (``stream``), unless the client asks for less
(it asks for a fifth of its ``hung_after_s`` when that is shorter)."""


def build_llm(options: dict[str, Any]):
    """The ``vllm.LLM`` the client asked for (``options``: see ``VLLMEngine._server_options``)."""
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        model=options["model_dir"],
        skip_tokenizer_init=True,  # token ids in and out: no tokenizer, no detokenizing
        dtype=options["dtype"],
        seed=options["seed"],
        max_model_len=options["max_model_len"],
        logprobs_mode="processed_logprobs",  # the sampling distribution's log-probs, as ours
        generation_config="vllm",  # the model directory's generation_config.json must not set defaults
        enable_prefix_caching=True,
        enforce_eager=options["enforce_eager"],
        distributed_executor_backend="uni",
        worker_extension_cls=WORKER_EXTENSION,
        max_num_seqs=options["max_num_seqs"],
    )
    if options.get("gpu_memory_utilization") is not None:
        kwargs["gpu_memory_utilization"] = options["gpu_memory_utilization"]
    if options.get("weight_transfer_backend"):
        kwargs["weight_transfer_config"] = {"backend": options["weight_transfer_backend"]}
    return LLM(**kwargs)


def _requests(message: dict[str, Any]) -> tuple[list[dict[str, Any]], list[Any]]:
    """``(prompts, params)`` of a ``sample`` or ``stream`` message, as ``vllm.LLM`` takes them."""
    from vllm import SamplingParams

    sampling = message["sampling"]
    params, prompts = [], []
    for request in message["requests"]:
        params.append(SamplingParams(
            n=request["n"], temperature=sampling["temperature"], top_k=sampling["top_k"] or 0,
            top_p=sampling["top_p"], max_tokens=request["max_tokens"], seed=request["seed"], logprobs=0,
            stop_token_ids=list(message["stop_token_ids"]), detokenize=False, skip_special_tokens=False,
        ))
        prompts.append({"prompt_token_ids": list(request["prompt_ids"])})
    return prompts, params


def _completions(output) -> list[dict[str, Any]]:
    """One finished request's completions: ids, the sampled tokens' log-probs, vLLM's finish reason."""
    completions = []
    for completion in sorted(output.outputs, key=lambda c: c.index):
        ids = list(completion.token_ids)
        # logprobs=0: each position's dict holds the sampled token's entry only
        log_probs = [float(position[token].logprob) for position, token in zip(completion.logprobs, ids, strict=True)]
        completions.append({"token_ids": ids, "log_probs": log_probs, "finish_reason": completion.finish_reason})
    return completions


def stream(llm, message: dict[str, Any], connection: Connection) -> None:
    """A round's requests, added to vLLM's engine at once (``LLM.enqueue``: what ``generate`` does
    before it steps the engine) and stepped here: the groups of the requests vLLM reports finished at a
    step are sent as one reply (``finished``: each with ``position``, its place in ``requests``), then
    ``{"done": True}``. A step that finished no request, ``progress_every_s`` (default
    ``PROGRESS_EVERY_S``) after the last reply, sends ``{"progress": steps}``: the engine is
    decoding, so the collector's ``hung_after_s`` measures time without a decoding step, not a
    round's length. ``cached_tokens``: prompt tokens whose keys and values came from the prefix
    cache (an agent's later turns reuse the earlier ones')."""
    request_ids: list[str] = []
    keys: list[Any] = []
    position: dict[str, int] = {}
    engine, unfinished = llm.llm_engine, set()

    def enqueue(more: dict[str, Any]) -> None:
        prompts, params = _requests(more)
        added = [str(r) for r in llm.enqueue(prompts, params, use_tqdm=False)]
        # enqueue may return vLLM's internal ids ("21-1a2b3c4d"); outputs carry the id it was given ("21")
        for request_id, request in zip(added, more["requests"], strict=True):
            position[external_id(request_id)] = len(request_ids)
            keys.append(request.get("key", len(request_ids)))
            request_ids.append(request_id)
            unfinished.add(request_id)

    enqueue(message)
    try:
        every_s = float(message.get("progress_every_s", PROGRESS_EVERY_S))
        steps, last_reply = 0, time.monotonic()
        while engine.has_unfinished_requests():
            while connection.poll(0):  # the next round's requests, sent while this one's tail decodes
                more = connection.recv()
                if more.get("op") == "close":  # the collector stops: nothing of the stream is wanted
                    raise StreamClosed
                if more.get("op") != "extend":
                    raise ValueError(f"operation {more.get('op')!r} sent under a stream; only extend and close are")
                enqueue(more)
                connection.send({"ok": True, "extended": len(more["requests"])})
            finished = []
            steps += 1
            for output in engine.step():
                if output.finished:
                    k = position[external_id(output.request_id)]
                    unfinished.discard(request_ids[k])
                    finished.append({"position": k, "key": keys[k], "group": _completions(output),
                                     "cached_tokens": int(output.num_cached_tokens or 0)})
            if finished:  # the requests that finished at this step: one reply, one append for the collector
                connection.send({"ok": True, "finished": finished})
                last_reply = time.monotonic()
            elif time.monotonic() - last_reply >= every_s:
                connection.send({"ok": True, "progress": steps})
                last_reply = time.monotonic()
    except (Exception, StreamClosed):  # the error reply ends the stream: nothing of it may stay in the engine
        if unfinished:
            engine.abort_request(sorted(external_id(r) for r in unfinished))  # each with its n completions
        raise
    connection.send({"ok": True, "done": True})


class StreamClosed(BaseException):
    """``close`` came under a stream: its requests are aborted, the reply sent, the process exits."""


def external_id(request_id: str) -> str:
    return str(request_id).split("-", 1)[0]


def turns(llm, message: dict[str, Any], connection: Connection) -> None:
    """Requests added while vLLM's engine steps (an agent's turns, each sent once its environment
    answered: ``generation/vllm_turns.py``). The opening message has ``sampling``, ``stop_token_ids``
    and ``progress_every_s``; then the client sends ``{"add": [requests]}`` (each with a ``key`` of
    its own beside the fields ``stream`` takes) and at last ``{"end": True}``. Between steps, what
    came is added to the running batch; each step that finished requests sends ``{"finished": [...]}``
    (per request its ``key``, ``group``, ``cached_tokens``). Silence (no step finished one, or nothing
    to decode while the client's environments work) sends ``{"progress": steps}`` every
    ``progress_every_s``, so the client tells a hang from a wait. After ``end``, once nothing is left
    to decode, ``{"done": True}``."""
    every_s = float(message.get("progress_every_s", PROGRESS_EVERY_S))
    engine, keys = llm.llm_engine, {}  # vLLM's request id -> the client's key
    ending, steps, last_reply = False, 0, time.monotonic()
    try:
        while True:
            busy = engine.has_unfinished_requests()
            if not busy and ending:
                break
            wait_s = 0.0 if busy else max(0.0, every_s - (time.monotonic() - last_reply))
            while connection.poll(wait_s):  # EOFError when the client is gone: the serve loop ends
                added = connection.recv()
                if added.get("end"):
                    ending = True
                if added.get("add"):
                    prompts, params = _requests({**message, "requests": added["add"]})
                    for request, request_id in zip(added["add"], llm.enqueue(prompts, params, use_tqdm=False)):
                        keys[external_id(str(request_id))] = request["key"]
                wait_s = 0.0
            finished = []
            if engine.has_unfinished_requests():
                steps += 1
                for output in engine.step():
                    if output.finished:
                        finished.append({"key": keys.pop(external_id(output.request_id)), "group": _completions(output),
                                         "cached_tokens": int(output.num_cached_tokens or 0)})
            if finished:
                connection.send({"ok": True, "finished": finished})
                last_reply = time.monotonic()
            elif time.monotonic() - last_reply >= every_s:
                connection.send({"ok": True, "progress": steps})
                last_reply = time.monotonic()
    except (EOFError, OSError):  # the client is gone: drop its requests, the serve loop then ends
        if keys:
            engine.abort_request(sorted(keys))
        return
    except Exception:  # the error reply ends the session: nothing of it may stay in the engine
        if keys:
            engine.abort_request(sorted(keys))
        raise
    connection.send({"ok": True, "done": True})


def load_weights(llm, message: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()
    (loaded,) = llm.collective_rpc("load_published_weights", args=(message["path"],))
    if not llm.reset_prefix_cache():  # cached prefixes hold the old weights' keys and values
        raise RuntimeError("reset_prefix_cache() failed after loading new weights (requests in flight?)")
    return {"loaded": loaded, "seconds": time.perf_counter() - started}


def nccl(llm, op: str, message: dict[str, Any]) -> dict[str, Any]:
    """vLLM's four-phase weight transfer, driven by the trainer side (``generation/vllm_nccl.py``)."""
    if op == "nccl_init":
        llm.init_weight_transfer_engine({"init_info": message["init_info"]})
    elif op == "nccl_start":
        llm.start_weight_update()
    elif op == "nccl_update":
        llm.update_weights({"update_info": message["update_info"]})
    elif op == "nccl_finish":
        llm.finish_weight_update()
        llm.collective_rpc("retie_published_head")
        if not llm.reset_prefix_cache():
            raise RuntimeError("reset_prefix_cache() failed after a weight transfer (requests in flight?)")
    return {}


def serve(connection: Connection, options: dict[str, Any]) -> int:
    started = time.perf_counter()
    try:
        llm = build_llm(options)
    except BaseException as exc:  # the client shows this, then the log's tail
        connection.send({"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        return 1
    import vllm

    connection.send({"ok": True, "seconds": time.perf_counter() - started, "vllm_version": vllm.__version__})
    while True:
        try:
            message = connection.recv()
        except (EOFError, OSError):  # the collector is gone: nobody to serve
            return 0
        op = message.get("op")
        try:
            if op == "close":
                connection.send({"ok": True})
                return 0
            if op in ("stream", "extend"):  # several replies, sent as requests finish
                stream(llm, message, connection)
                continue
            if op == "turns":  # requests added while the engine steps, replies as they finish
                turns(llm, message, connection)
                continue
            if op == "load_weights":
                reply = load_weights(llm, message)
            elif op is not None and op.startswith("nccl_"):
                reply = nccl(llm, op, message)
            else:
                raise ValueError(f"unknown operation {op!r}")
            connection.send({"ok": True, **reply})
        except StreamClosed:
            connection.send({"ok": True})
            return 0
        except Exception as exc:  # one failed request: said to the client, the engine keeps serving
            connection.send({"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fd", type=int, required=True, help="the socket to the collector")
    args = parser.parse_args(argv)
    connection = Connection(args.fd)
    options = connection.recv()
    try:
        return serve(connection, options)
    finally:
        connection.close()


if __name__ == "__main__":  # vLLM spawns nothing here (in-process), but keep the guard it asks for
    sys.exit(main())
