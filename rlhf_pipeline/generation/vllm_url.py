"""``VLLMURLEngine``: the one vLLM client, through a server's OpenAI-compatible API: a server the user
started (``--set generation.url=http://...``) or the collector's own (``vllm_engine.py``). Nothing about
a server is trusted until checked, before any row (its health, model and length, its tokenizer's ids,
with weight updates its model's shape, one seeded request's log-probs against our model's): a failed
check is one :class:`ServerMismatch` line. Each ``submit`` is one seeded HTTP request, every reply
checked (``engine.checked_completions``). Weights: ``vllm_url_weights.py``; adapters: ``vllm_adapters.py``.
Why one file: the checks at connection sample through the same requests the collector's do, and a
request, the weights lease it holds and :meth:`VLLMURLEngine.holding` share one count of what is in
flight; apart, each part would reach into the others' state.
Design: docs/generation.md#a-vllm-server-you-started-generationurl.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from rlhf_pipeline.generation.engine import (BadAnswer, Completion, CompletionGroup, EngineFailed, EngineStats,
                                             GenerationEngine, SampleRequest, UnsupportedCapability,
                                             UnsupportedSetting, checked_completions)
from rlhf_pipeline.generation.sampling import SamplingConfig
from rlhf_pipeline.generation.vllm_adapters import AdapterServing, ServedAdapters
from rlhf_pipeline.generation.vllm_http import JsonClient, Retries, ServerError, ServerUnreachable
from rlhf_pipeline.generation.vllm_process import WORKER_EXTENSION
from rlhf_pipeline.generation.vllm_url_weights import ROUND_LEASE_S, ServerMismatch, ServerWeights
from rlhf_pipeline.generation.vllm_worker import MODEL_SHAPE_KEYS

API_KEY_ENV = "VLLM_API_KEY"  # a server's --api-key, in vLLM's own variable for it: no key in settings.json
SERVER_COMMAND = ("VLLM_SERVER_DEV_MODE=1 PYTHONPATH=<this checkout> python -m vllm.entrypoints.openai.api_server "
                  "--model <model dir> --logprobs-mode processed_logprobs --generation-config vllm "
                  f"--enable-prefix-caching --worker-extension-cls {WORKER_EXTENSION} --dtype float32")
"""What a server needs for a pipeline that updates weights (docs/generation.md has it in full)."""
PROBE_TEXT = "12+34=46, then 7*8=56."
PROBE_SAMPLING = SamplingConfig(max_new_tokens=6, temperature=0.6)
"""The log-prob check's request: at temperature 0.6 the sampling distribution is far from the raw one."""
NEUTRAL = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0,
           "min_tokens": 0}
"""Sent with every request: the server's generation config would otherwise set them."""
GREEDY_BELOW, MAX_TEMPERATURE = 1e-5, 2.0
"""vLLM samples greedily below the one (its ``_SAMPLING_EPS``); its ``SamplingParams`` refuses a temperature above the other."""


@dataclass
class ServerStats(EngineStats):
    """The engine's stats, and since the last round: ``http_requests`` its client sent,
    ``http_request_s`` from sending each to its whole reply (summed: a round's are in flight together)
    and ``http_connections`` opened (kept alive, few); on a server other collectors may share,
    ``lease_wait_s`` waiting for their rounds on other weights to end and ``server_loads`` of its
    weights (each version once, and again after another's went in)."""

    client: Any = None  # the engine's, not the engine: an owned server holds these stats
    weights: Any = None

    def http_totals(self) -> dict[str, float]:
        client = self.client
        return {"http_requests": client.requests_sent, "http_request_s": client.request_s,
                "http_connections": client.connections_opened}

    def update_metrics(self) -> dict[str, float]:
        metrics = {**super().update_metrics(), **self.since_last_report(**self.http_totals())}
        shared = self.since_last_report(lease_wait_s=self.weights.waited_s, server_loads=self.weights.loads)
        return {**metrics, **shared} if self.weights.shared else metrics


class VLLMURLEngine(GenerationEngine):
    """A vLLM server at ``url``, checked against ``model`` (and ``tokenizer``); see the module docstring.

    ``model``: the pipeline's policy as a transformers causal LM, at ``policy_version``: the server is
    checked against it and, with ``weight_updates``, given its weights. ``served_model``: the model
    name to request (None: the only one the server serves). ``server``: one of ours, healthy already
    (``vllm_engine.OwnedServer``), shared with no one, restarted when it dies: ``url`` follows it."""

    name = "vllm-url"

    def __init__(self, url: str, model: Any, *, stop_token_ids: Sequence[int], tokenizer: Any = None,
                 policy_version: int = 0, served_model: str | None = None, weight_updates: bool = True,
                 weights_dir: str | Path | None = None, inline_weights: bool = False,
                 retries: Retries | None = None, wait_s: float = 300.0, max_concurrency: int = 64,
                 check_tolerance: float = 1e-3, api_key: str | None = None,
                 lease_s: float = ROUND_LEASE_S, server: Any = None, adapters: AdapterServing | None = None) -> None:
        super().__init__(stop_token_ids, policy_version)
        self.client = JsonClient(url, retries, api_key=api_key, supervisor=server)
        self.vocab_size = int(model.config.vocab_size)
        self._weight_updates = bool(weight_updates)
        # the weights this engine's rounds sample with, held on a server other collectors may share
        self.weights = ServerWeights(self.client, weights_dir=weights_dir, inline=inline_weights, lease_s=lease_s,
                                     version=policy_version, shared=server is None)
        self.stats = server.stats if server is not None else ServerStats()
        self.stats.client, self.stats.weights = self.client, self.weights
        self._counting = threading.Lock()  # replies are checked on the request threads
        self._rounds_in_flight = 0  # requests sent and not answered, and blocks of holding()
        self._closed = False
        self._leasing = threading.Lock()
        self._lease: Any = None
        self.adapters: ServedAdapters | None = None
        # one pool for the engine's life: up to max_concurrency requests in flight, the rest queue here
        self._pool = ThreadPoolExecutor(max_workers=int(max_concurrency), thread_name_prefix=f"{self.name}-requests")
        try:
            if server is None:  # a server of ours was healthy when its start returned
                self._wait_until_healthy(wait_s)
            self.served_model, server_len = self._find_model(served_model)
            self.max_model_len = min(server_len, int(model.config.max_position_embeddings))
            if tokenizer is not None:
                self._check_tokenizer(tokenizer)
            if self._weight_updates:
                self._check_shape(model)
                self._load(model.state_dict(), self.policy_version)  # the server now holds our policy
            self._check_log_probs(model, tokenizer, check_tolerance)
            if adapters is not None:  # a LoRA run: its versions are adapters the server loads by name
                self.adapters = ServedAdapters(
                    self.client, adapters, model, self.weights, max_model_len=self.max_model_len,
                    served_model=self.served_model,
                    sample=lambda *request: self._post_completions(self._body(*request)))
                self.adapters.check_server()
        except BaseException:
            self.close()
            raise
        # a round's figures, not the connection checks', but for the first load of this engine's weights
        self.stats.totals_reported.update(self.stats.http_totals(), prompt_tokens=self.stats.prompt_tokens,
                                          prefix_cached_tokens=self.stats.cached_tokens, lease_wait_s=0.0,
                                          server_loads=0)

    @property
    def url(self) -> str:
        """The server's base URL: a restarted server of ours has a new one."""
        return self.client.base_url

    # ------------------------------------------------------------------ checks at connection
    def _wait_until_healthy(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.client.get("/health", retry=False)
                return
            except ServerUnreachable as exc:
                if time.monotonic() >= deadline:
                    raise ServerUnreachable(f"generation.url: no vLLM server answered at {self.url} within {wait_s:g} s "
                                            f"({exc.last_error}); start one with: "
                                            f"{SERVER_COMMAND}, or raise generation.start_timeout_s") from None
            except ServerError as exc:  # answers, but not as vLLM does
                raise ServerMismatch(f"generation.url: {self.url}/health answered HTTP {exc.status} ({exc.detail}): "
                                     f"not a vLLM server; point generation.url at one") from None
            except BadAnswer as exc:
                raise ServerMismatch(f"generation.url: {exc}: not a vLLM server; point generation.url at one") from None
            time.sleep(1.0)

    def _find_model(self, wanted: str | None) -> tuple[str, int]:
        try:  # the first request a server started with --api-key guards
            listing = self.client.get("/v1/models")
        except ServerError as exc:
            if exc.status != 401:
                raise
            given = "refused the key in" if self.client.has_api_key else "wants an API key: set"
            raise ServerMismatch(f"generation.url: the server at {self.url} {given} ${API_KEY_ENV} (its --api-key)") from None
        # LoRA adapters loaded there (another collector's) are listed with their base as "parent": not models
        served = {entry["id"]: entry for entry in listing.get("data", []) if entry.get("parent") is None}
        if wanted is not None and wanted not in served:
            raise ServerMismatch(f"generation.url_model={wanted!r}: the server at {self.url} serves {sorted(served)}; "
                                 f"set generation.url_model to one of them")
        if wanted is None and len(served) != 1:
            raise ServerMismatch(f"generation.url: the server at {self.url} serves {sorted(served) or 'no model'}; "
                                 f"set generation.url_model to the pipeline's")
        name = wanted if wanted is not None else next(iter(served))
        return name, int(served[name].get("max_model_len") or 0) or 2**31

    def _check_tokenizer(self, tokenizer: Any) -> None:
        """The server's tokenizer must give our ids for the probe (unless it has none)."""
        ours = list(tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"])
        try:
            theirs = self.client.post("/tokenize", {"model": self.served_model, "prompt": PROBE_TEXT,
                                                    "add_special_tokens": False})["tokens"]
        except ServerError:  # started without a tokenizer (--skip-tokenizer-init): it reads only our ids
            return
        if list(theirs) != ours:
            raise ServerMismatch(f"generation.url: the server's tokenizer ({self.served_model!r} at {self.url}) gives "
                                 f"{theirs} for {PROBE_TEXT!r}, the pipeline's gives {ours}: serve a model directory "
                                 f"holding the pipeline's tokenizer (tokenizer.save_pretrained)")

    def _check_shape(self, model: Any) -> None:
        try:
            reply = self.client.post("/collective_rpc", {"method": "describe_published_model"})
        except ServerError as exc:
            missing = ("the dev endpoints (VLLM_SERVER_DEV_MODE=1)" if exc.status == 404
                       else f"our worker extension ({exc.detail})")
            raise ServerMismatch(f"generation.url: the server at {self.url} was started without {missing}, which "
                                 f"weight updates need; start it with: {SERVER_COMMAND}") from None
        theirs = reply["results"][0]
        ours = {key: getattr(model.config, key, None) for key in MODEL_SHAPE_KEYS}
        # a model built in code names no architecture until save_pretrained writes its class's name
        ours["architectures"] = list(ours["architectures"] or [type(model).__name__])
        differ = [key for key in MODEL_SHAPE_KEYS if theirs.get(key) != ours[key]]
        if differ:
            def show(values):
                return ", ".join(f"{key}={values.get(key)}" for key in differ)
            raise ServerMismatch(f"generation.url: the server at {self.url} serves {self.served_model!r} with "
                                 f"{show(theirs)}; the pipeline's model has {show(ours)}: serve a model of the "
                                 f"pipeline's shape (its save_pretrained directory)")

    def _check_log_probs(self, model: Any, tokenizer: Any, tolerance: float) -> None:
        from rlhf_pipeline.generation.loop import log_prob_gap

        prompt = (list(tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]) if tokenizer is not None
                  else [i % self.vocab_size for i in range(2, 12)])
        (group,) = self.sample([SampleRequest(prompt, n=2)], [0], PROBE_SAMPLING)
        prompts = [prompt] * len(group.completions)
        processed, raw = (log_prob_gap(model, prompts, group.completions, config) for config in (PROBE_SAMPLING, None))
        if processed <= tolerance:
            return
        if raw <= tolerance:
            raise ServerMismatch(f"generation.url: the server at {self.url} returns the raw log-probs, not the sampling "
                                 f"distribution's; start it with --logprobs-mode processed_logprobs")
        where = "after loading the pipeline's weights" if self._weight_updates else "(no weights sent to it)"
        raise ServerMismatch(
            f"generation.url: the server at {self.url} ({self.served_model!r}) answers with log-probs up to "
            f"{processed:.3g} away from the pipeline's model's {where}, beyond generation.url_check_tolerance="
            f"{tolerance:g}: it serves other weights, or log-probs of "
            f"another kind (start it with --logprobs-mode processed_logprobs); raise the tolerance for a server "
            f"in lower precision")

    # ------------------------------------------------------------------ sampling
    @property
    def retries(self) -> Retries:
        """How often an unanswered request is asked again (a server of ours started again first)."""
        return self.client.retries

    @retries.setter
    def retries(self, value: Retries) -> None:
        self.client.retries = value

    @property
    def supports_weight_updates(self) -> bool:
        return self._weight_updates

    def check_sampling(self, sampling: SamplingConfig) -> None:
        if not GREEDY_BELOW <= sampling.temperature <= MAX_TEMPERATURE:
            raise UnsupportedSetting(
                f"sampling.temperature={sampling.temperature:g}: a vLLM server samples greedily below "
                f"{GREEDY_BELOW:g} (then returning raw log-probs) and takes none above {MAX_TEMPERATURE:g}; use one in "
                f"[{GREEDY_BELOW:g}, {MAX_TEMPERATURE:g}], or the loop engine")

    def submit(self, request: SampleRequest, seed: int, sampling: SamplingConfig) -> Future[CompletionGroup]:
        """One HTTP request with ``seed``, sent from the engine's pool at once (the server batches what
        is in flight continuously); its reply is checked before it is a group."""
        self.check_sampling(sampling)
        limit = request.limit(sampling)
        if len(request.prompt_ids) + limit > self.max_model_len:
            raise ValueError(f"a prompt of {len(request.prompt_ids)} tokens with max_new_tokens {limit} exceeds "
                             f"{self.max_model_len} tokens, the server's max_model_len (or the model's positions); "
                             f"shorten the prompt or the limit")
        with self._counting:
            if self._closed:
                raise EngineFailed(f"the {self.name} engine is closed; no request is taken")
            version = self.policy_version
            # a LoRA run's request names the adapter of the version its rows name (version 0: the base)
            model = self.served_model if self.adapters is None else self.adapters.name(version)
            body = self._body(request.prompt_ids, request.n, seed, sampling, limit, model)
            self._rounds_in_flight += 1
        try:
            lease = self._lease_in_flight()
        except BaseException:
            self._ended(None)
            raise
        return self._pool.submit(self._ask, body, version, lease)

    def _body(self, prompt: Sequence[int], n: int, seed: int, sampling: SamplingConfig, limit: int,
              model: str) -> dict[str, Any]:
        top_k = sampling.top_k if 0 < sampling.top_k < self.vocab_size else 0  # as ours: k >= V keeps all
        return {
            "model": model, "prompt": [int(t) for t in prompt], "n": n,
            "max_tokens": limit, "seed": int(seed), "temperature": sampling.temperature,
            "top_k": top_k, "top_p": sampling.top_p, "logprobs": 0, "stop_token_ids": self.stop_token_ids,
            "ignore_eos": True, "skip_special_tokens": False, "return_token_ids": True,
            "return_tokens_as_token_ids": True, "stream": False, **NEUTRAL,
        }

    def _post_completions(self, body: dict[str, Any]) -> list[Completion]:
        return self.client.post("/v1/completions", body, check=partial(self._completions, body=body))

    def _ask(self, body: dict[str, Any], version: int, lease: Any) -> CompletionGroup:
        try:
            # checked as it comes, inside the client's retries: a bad reply is asked again, with its seed
            completions = self._post_completions(body)
            if lease is not None:  # kept only if no weights went in under it
                lease.check()
            return CompletionGroup(completions, version, body["seed"])
        finally:
            self._ended(lease)

    @contextlib.contextmanager
    def holding(self) -> Iterator[VLLMURLEngine]:
        # counted as a request in flight: the lease its first request takes lasts to the block's end
        with self._counting:
            self._rounds_in_flight += 1
        try:
            yield self
        finally:
            self._ended(self._lease)

    def _lease_in_flight(self) -> Any:
        """A server other collectors may share holds this engine's weights while any request of it is in
        flight: one lease from the first request sent to the last answered (``vllm_url_weights.RoundLease``)."""
        if not (self._weight_updates and self.weights.shared):
            return None
        with self._leasing:
            if self._lease is None:
                lease = self.weights.round_lease()
                lease.__enter__()
                self.weights.waited_s += lease.waited_s
                self.stats.update_s_total += lease.load_s  # another collector's weights went in meanwhile
                self._lease = lease
            return self._lease

    def _ended(self, lease: Any) -> None:
        with self._counting:
            self._rounds_in_flight -= 1
            last = self._rounds_in_flight == 0
        if lease is not None and last:
            with self._leasing:
                with self._counting:
                    if self._rounds_in_flight or self._lease is not lease:
                        return
                    self._lease = None
                lease.__exit__(None, None, None)

    def _completions(self, reply: Any, body: dict[str, Any]) -> list[Completion]:
        """A ``/v1/completions`` reply's completions, checked (``engine.checked_completions``);
        :class:`BadAnswer` naming the fault, or :class:`ServerMismatch` for a server that stops on
        tokens that are not ours."""
        choices = reply.get("choices") if isinstance(reply, dict) else None
        if not isinstance(choices, list):
            has = f"keys {sorted(reply)}" if isinstance(reply, dict) else f"a {type(reply).__name__}"
            raise BadAnswer(f"no 'choices' list in the reply (it holds {has})")
        if not all(isinstance(c, dict) and isinstance(c.get("logprobs"), dict) for c in choices):
            raise BadAnswer("a choice without its 'logprobs' object")
        indices = [c.get("index") for c in choices]
        if not all(type(i) is int for i in indices) or sorted(indices) != list(range(len(choices))):
            raise BadAnswer(f"choices numbered {indices[:8]}, not 0 to {len(choices) - 1}")
        choices = sorted(choices, key=lambda c: c["index"])
        completions = checked_completions([(c.get("token_ids"), c["logprobs"].get("token_logprobs")) for c in choices],
                                          n=body["n"], limit=body["max_tokens"], vocab_size=self.vocab_size,
                                          stop_token_ids=self.stop_token_ids)
        for choice, completion in zip(choices, completions):
            if not completion.terminated and len(completion.token_ids) < body["max_tokens"]:
                raise ServerMismatch(
                    f"generation.url: the server at {self.url} stopped a completion on token "
                    f"{completion.token_ids[-1]} (finish_reason {choice.get('finish_reason')!r}), which is not among "
                    f"the pipeline's stop tokens {self.stop_token_ids}: its generation config adds stop tokens; start "
                    f"it with --generation-config vllm")
        details = (reply.get("usage") or {}).get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:  # a server started with --enable-prompt-tokens-details
            with self._counting:
                self.stats.counts_cached = True
                self.stats.prompt_tokens += len(body["prompt"])
                self.stats.cached_tokens += int(details["cached_tokens"])
        return completions

    # ------------------------------------------------------------------ weights
    def _load(self, weights: Mapping[str, torch.Tensor] | str | Path, version: int) -> None:
        if not self._weight_updates:
            raise UnsupportedCapability(f"the {self.name} engine was made without weight updates")
        if self._rounds_in_flight:  # a lease holds a shared server, none our own: between requests only
            raise EngineFailed(f"new weights (version {version}) under requests in flight: wait for their "
                               f"answers first")
        if self.adapters is not None:
            self.adapters.load(weights, version)
        else:
            self.weights.take(weights, version)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Stops the request pool (what it still holds is not sent), closes the kept connections and
        removes the weight files this engine wrote; the server is the user's and keeps running."""
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        # requests cancelled there never end as answered ones do, so the lease they held is let go
        # here: a server shared with other collectors would otherwise stay held on our weights
        with self._leasing:
            lease, self._lease = self._lease, None
        if lease is not None:
            lease.__exit__(None, None, None)
        if self.adapters is not None:
            self.adapters.close()
        self.weights.close()
        self.client.close()

