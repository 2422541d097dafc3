"""A stand-in for a broken vLLM server at a URL: the part of vLLM's OpenAI-compatible API that
``VLLMURLEngine`` talks to (``/health``, ``/v1/models``, ``/v1/completions``, and for weight updates
``/collective_rpc`` with our worker extension's methods and ``/reset_prefix_cache``), served on
127.0.0.1 by the standard library's ``http.server``. The weights lease is the server side's own
table (``generation/vllm_lease.py``), as our worker extension keeps it inside vLLM.

It answers honestly until told otherwise: each completion is sampled by our own loop engine from the
tiny model it was given, seeded with the request's seed, so the engine's connection check (log-probs of
the sampling distribution) passes as it would against vLLM. ``fault`` then names one way a broken server
answers (:data:`FAULTS`), applied to every ``/v1/completions`` reply from then on; ``completions`` counts
the requests and ``lease_ops`` the weights lease's calls, so a test sees how often the client asked; ``honest_for`` completions requests are
answered honestly before the fault applies (a server that breaks mid-run). vLLM itself is outside the project and does
not run here; what is under test is the client's checking of what any server answers.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from rlhf_pipeline.generation import LoopEngine, SampleRequest, SamplingConfig
from rlhf_pipeline.generation.vllm_lease import WeightsLeases
from rlhf_pipeline.generation.vllm_worker import MODEL_SHAPE_KEYS


def _last_choice(reply: dict[str, Any], change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    change(reply["choices"][-1])
    return reply


def _set_token(value: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def fault(reply):
        return _last_choice(reply, lambda choice: choice["token_ids"].__setitem__(0, value(choice["token_ids"][0])))
    return fault


def _set_log_prob(value: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def fault(reply):
        return _last_choice(reply, lambda choice: choice["logprobs"]["token_logprobs"].__setitem__(0, value))
    return fault


def _lengthen(choice: dict[str, Any]) -> None:
    choice["token_ids"].extend([5] * 64)
    choice["logprobs"]["token_logprobs"].extend([-1.0] * 64)


FAULTS: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    # name: (what the server answers instead, what the client's one line must say)
    "id-outside-vocabulary": (_set_token(lambda _: 10**6), "is 1000000, outside the model's vocabulary of"),
    "negative-id": (_set_token(lambda _: -5), "is -5, outside the model's vocabulary of"),
    "float-id": (_set_token(lambda token: token + 0.7), "not an integer id"),
    "string-id": (_set_token(lambda _: "5"), "is '5', not an integer id"),
    "bool-id": (_set_token(lambda _: True), "is True, not an integer id"),
    "null-log-prob": (_set_log_prob(None), "has log-prob None, not a number"),
    "positive-log-prob": (_set_log_prob(0.5), "has log-prob 0.5, not a finite number <= 0"),
    "nan-log-prob": (_set_log_prob(float("nan")), "has log-prob nan, not a finite number <= 0"),
    "log-prob-missing": (lambda reply: _last_choice(reply, lambda c: c["logprobs"]["token_logprobs"].pop()),
                         "log-probs for"),
    "over-the-limit": (lambda reply: _last_choice(reply, _lengthen), "over the request's max_new_tokens"),
    "no-choices": (lambda reply: {"object": "error", "message": "internal"}, "no 'choices' list in the reply"),
    "garbage-json": (lambda reply: b"<html>502 bad gateway</html>", "a body that is not JSON"),
}


class MisbehavingVLLMServer:
    """Serves ``model`` as ``served_name`` at :attr:`url` (on ``port``, else a free one) until :meth:`stop`;
    see the module docstring."""

    def __init__(self, model: Any, *, stop_token_ids: list[int], pad_token_id: int, port: int = 0,
                 served_name: str = "tiny") -> None:
        self.fault: str | None = None
        self.honest_for = 0
        self.completions = 0
        self.lease_ops: collections.Counter[str] = collections.Counter()  # weights lease calls, by op
        self._model = model
        self._leases = WeightsLeases()
        self._engine = LoopEngine(model, pad_token_id=pad_token_id, eos_token_id=stop_token_ids)
        self._lock = threading.Lock()  # one sampling at a time: the model is shared
        self._max_len = int(model.config.max_position_embeddings)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet: the test's output is the client's
                pass

            def do_GET(self):
                if self.path == "/health":
                    self._send(200, b"")
                elif self.path == "/v1/models":
                    self._send(200, {"data": [{"id": served_name, "max_model_len": server._max_len}]})
                else:
                    self._send(404, {"detail": "Not Found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/v1/completions":
                    self._send(200, server._complete(body))
                elif self.path == "/collective_rpc":
                    self._send(200, {"results": [server._worker(body["method"], *body.get("args", []))]})
                elif self.path == "/reset_prefix_cache":  # it caches nothing
                    self._send(200, {"success": True})
                else:  # /tokenize: a server without a tokenizer
                    self._send(404, {"detail": "Not Found"})

            def _send(self, status: int, body: Any) -> None:
                raw = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="misbehaving-vllm", daemon=True)
        self._thread.start()

    def _complete(self, body: dict[str, Any]) -> Any:
        sampling = SamplingConfig(max_new_tokens=body["max_tokens"], temperature=body["temperature"],
                                  top_k=body["top_k"], top_p=body["top_p"])
        with self._lock:
            self.completions += 1
            fault = self.fault if self.completions > self.honest_for else None
            request = SampleRequest(body["prompt"], n=body["n"], max_new_tokens=body["max_tokens"])
            (group,) = self._engine.sample([request], [body["seed"]], sampling)
        reply = {"choices": [{"index": i, "token_ids": c.token_ids, "logprobs": {"token_logprobs": c.log_probs},
                              "finish_reason": "stop" if c.terminated else "length"}
                             for i, c in enumerate(group.completions)]}
        return reply if fault is None else FAULTS[fault][0](reply)

    def _worker(self, method: str, *args: Any) -> Any:
        """What our worker extension answers (``generation/vllm_worker.py``), for this model."""
        with self._lock:
            if method == "describe_published_model":
                shape = {key: getattr(self._model.config, key, None) for key in MODEL_SHAPE_KEYS}
                return {**shape, "architectures": list(shape["architectures"] or [type(self._model).__name__])}
            if method == "published_lease":
                call = json.loads(args[0])
                self.lease_ops[call["op"]] += 1
                return self._leases.call(call, time.monotonic())
            if method == "load_published_weights":
                from safetensors.torch import load_file

                state = load_file(args[0], device="cpu")
                self._model.load_state_dict(state, strict=False)  # a tied head has no key of its own
                self._model.tie_weights()
                claim = json.loads(args[1]) if len(args) > 1 and args[1] else {}
                self._leases.loaded(claim.get("holder"), claim.get("key"), claim.get("version"),
                                    float(claim.get("ttl_s", 0.0)), time.monotonic())
                return {"tensors": len(state), "epoch": self._leases.epoch}
        raise ValueError(f"no method {method!r}")

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
