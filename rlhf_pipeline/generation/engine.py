"""The generation engine contract: :class:`GenerationEngine` (token ids in, sampled ids and their sampling
log-probs out, the policy version that produced them beside), the requests and completions it trades
in, one request's seed (:func:`draw_seed`), the check every answer from outside this process passes
before it is a row (:func:`checked_completions`) and the errors an engine raises. Our loop (``loop.py``)
and vLLM (``vllm_url.py``) implement it; a collector never learns which it has.
Design: docs/collector.md#generation-engines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from rlhf_pipeline.generation.sampling import SamplingConfig

SEED_RANGE = 2**31
"""Seeds drawn per request lie in [0, SEED_RANGE): vLLM seeds its ``n`` completions with ``seed + i``,
so they stay well inside 64 bits."""

class UnsupportedSetting(ValueError):
    """A sampling setting this engine cannot honour exactly; the message names it and the fix."""


class UnsupportedCapability(NotImplementedError):
    """A method whose capability this engine does not have (``supports_scoring`` False...)."""


class EngineFailed(RuntimeError):
    """The engine stopped working (its process died, its pipe closed); what it was doing is lost and
    must be asked again (the collector's saved state says from where)."""


class EngineDied(EngineFailed):
    """The engine's process exited or its socket closed (or it hung past ``generation.timeout_s``
    and was killed): a fresh process may do what it could not. An engine that answered with an error
    is not this. ``cause``: what happened, in a few words (the message adds the engine's log)."""

    def __init__(self, message: str, cause: str | None = None) -> None:
        super().__init__(message)
        self.cause = cause or message.splitlines()[0]


class EngineStopped(EngineFailed):
    """A wait of the engine ended because its process is stopping (:attr:`GenerationEngine.stopping`):
    not a failure of the engine or of what it was asked."""


class BadAnswer(EngineFailed):
    """An engine answered with something that cannot be a row (an id outside the vocabulary, a
    log-prob that is not one, a reply of the wrong shape); the message names the engine and the fault."""


@dataclass(frozen=True)
class SampleRequest:
    """``n`` completions of one prompt."""

    prompt_ids: Sequence[int]
    """The prompt as token ids (what the policy's tokenizer and chat template gave)."""
    n: int = 1
    """Completions of this prompt: the GRPO group size for a single-turn collector, 1 per agent turn."""
    max_new_tokens: int | None = None
    """This request's response limit; None: the sampling config's ``max_new_tokens``."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SampleRequest.n must be >= 1, got {self.n}")
        if len(self.prompt_ids) == 0:
            raise ValueError("SampleRequest.prompt_ids is empty; every prompt needs at least one token")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"SampleRequest.max_new_tokens must be >= 1 or None, got {self.max_new_tokens}")

    def limit(self, sampling: SamplingConfig) -> int:
        return sampling.max_new_tokens if self.max_new_tokens is None else self.max_new_tokens


@dataclass
class Completion:
    """One sampled response: ids verbatim and each one's sampling log-prob."""

    token_ids: list[int]
    log_probs: list[float]
    terminated: bool
    """Ended on a stop token, which is its last token; else it reached ``max_new_tokens`` (truncated)."""

    @property
    def truncated(self) -> bool:
        return not self.terminated


def checked_completions(choices: Sequence[tuple[Any, Any]], *, n: int, limit: int, vocab_size: int,
                        stop_token_ids: Sequence[int]) -> list[Completion]:
    """The completions of one request from an engine's answer, ``choices`` as ``(token_ids, log_probs)``
    in the engine's own types; :class:`BadAnswer` naming the choice, the token and what is wrong with it
    (the caller adds which engine answered) when one could not be a row: ids that are not integers
    (a float, a string and a bool are not) inside ``[0, vocab_size)``, a log-prob per id that is a
    finite number <= 0 (up to the rounding the store accepts, ``schema.fields.LOG_PROB_TOLERANCE``),
    at most ``limit`` ids, no stop token but as the last, ``n`` choices."""
    from rlhf_pipeline.schema.fields import LOG_PROB_TOLERANCE  # the store's own rule: a few ulps over 0 pass

    if len(choices) != n:
        raise BadAnswer(f"{len(choices)} completions for a request of n={n}")
    stops = set(stop_token_ids)
    out = []
    for c, (token_ids, log_probs) in enumerate(choices):
        if not isinstance(token_ids, Sequence) or isinstance(token_ids, (str, bytes)) or not token_ids:
            raise BadAnswer(f"choice {c} has token ids {_shown(token_ids)}, not a list of at least one id")
        if not isinstance(log_probs, Sequence) or isinstance(log_probs, (str, bytes)):
            raise BadAnswer(f"choice {c} has log-probs {_shown(log_probs)}, not a list")
        if len(token_ids) > limit:
            raise BadAnswer(f"choice {c} has {len(token_ids)} tokens, over the request's max_new_tokens {limit}")
        if len(log_probs) != len(token_ids):
            raise BadAnswer(f"choice {c} has {len(log_probs)} log-probs for {len(token_ids)} tokens (one per token)")
        for k, (token, log_prob) in enumerate(zip(token_ids, log_probs)):
            if not isinstance(token, numbers.Integral) or isinstance(token, bool):
                raise BadAnswer(f"choice {c} token {k} is {_shown(token)}, not an integer id")
            if not 0 <= token < vocab_size:
                raise BadAnswer(f"choice {c} token {k} is {token}, outside the model's vocabulary of {vocab_size} "
                                f"tokens")
            if not isinstance(log_prob, numbers.Real) or isinstance(log_prob, bool):
                raise BadAnswer(f"choice {c} token {k} has log-prob {_shown(log_prob)}, not a number")
            if not math.isfinite(log_prob) or log_prob > LOG_PROB_TOLERANCE:
                raise BadAnswer(f"choice {c} token {k} has log-prob {log_prob}, not a finite number <= 0 (rounding "
                                f"up to +{LOG_PROB_TOLERANCE:g} is accepted)")
            if token in stops and k < len(token_ids) - 1:
                raise BadAnswer(f"choice {c} token {k} is the stop token {token}, with {len(token_ids) - 1 - k} "
                                f"tokens after it (a completion ends at its stop token)")
        ids = [int(t) for t in token_ids]
        out.append(Completion(ids, [float(p) for p in log_probs], terminated=ids[-1] in stops))
    return out


def _shown(value: Any) -> str:
    """A value from an answer as a message shows it: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass
class CompletionGroup:
    """The completions of one request, with the version that sampled them."""

    completions: list[Completion]
    policy_version: int
    seed: int
    """The request's seed: its draws came from it alone."""
    index: int = 0
    """The request's position in the :meth:`GenerationEngine.sample` call that asked for it (0 for one
    submitted alone)."""


@dataclass
class EngineStats:
    """What an engine measured, for the collector's metrics."""

    weight_updates: int = 0
    last_update_s: float = 0.0
    """Seconds the last :meth:`GenerationEngine.load_weights` took, from call to return."""
    update_s_total: float = 0.0
    starts: int = 0
    """Times an engine with a process of its own started it (0 for our loop, which has none): one
    for a whole run when weights change in place."""
    start_s: float = 0.0
    """Seconds its last start took."""
    restarts: int = 0
    """Times its process died and was started again (each also counts in ``starts``)."""
    prompt_tokens: int = 0
    """Prompt tokens sent so far (each request's once, however many completions it asks for)."""
    cached_tokens: int = 0
    """Of those, the ones an engine with a prefix cache did not compute again (vLLM: blocks of 128
    tokens on a CPU). An agent's turn is its whole conversation so far, so most of it is cached."""
    counts_cached: bool = False
    """True for an engine that reports its prefix cache's hits (vLLM): the round metrics then have
    ``prompt_tokens`` and ``prefix_cached_tokens``."""
    totals_reported: dict[str, float] = dataclasses.field(default_factory=dict)
    """Each total a round's metric counts from, as it stood at the last :meth:`update_metrics`."""

    def since_last_report(self, **totals: float) -> dict[str, float]:
        """How much each of ``totals`` grew since the last report, which then counts from them."""
        since = {name: float(total - self.totals_reported.get(name, 0)) for name, total in totals.items()}
        self.totals_reported.update(totals)
        return since

    def update_metrics(self) -> dict[str, float]:
        """A round's metrics (docs/generation.md's table): seconds spent loading weights since the last
        call (a collector loads at most one version a round), updates so far, an engine process's starts,
        and a prefix cache's prompt tokens since the last call and how many it held."""
        metrics = {**self.since_last_report(weight_update_s=self.update_s_total),
                   "weight_updates": float(self.weight_updates)}
        if self.starts:
            metrics.update(engine_starts=float(self.starts), engine_restarts=float(self.restarts),
                           engine_start_s=self.start_s)
        if self.counts_cached:  # this round's prompt tokens and those found in the prefix cache
            metrics.update(self.since_last_report(prompt_tokens=self.prompt_tokens,
                                                  prefix_cached_tokens=self.cached_tokens))
        return metrics


def draw_seed(generator: torch.Generator) -> int:
    """One request's seed from the collector's generator (advances it by one draw)."""
    import torch

    return int(torch.randint(0, SEED_RANGE, (1,), generator=generator, device=generator.device).item())


class GenerationEngine(ABC):
    """Token ids in, sampled ids and sampling log-probs out, the policy version that produced them beside.

    * **Token-exact**: ids verbatim, each with its log-prob under the distribution that drew it
      (``sampling.py``); a completion ends at a stop token, kept (``terminated``), or at its limit.
    * **One future per request** (:meth:`submit`), its draws from the request's seed alone
      (:func:`draw_seed`, from the generator the collector checkpoints), whatever else is in flight.
    * **One version per group**: weights load only between requests (:meth:`load_weights`).
    * **Checked before it is a row**: what an engine outside this process answers goes through
      :func:`checked_completions`; settings an engine cannot honour are refused by name
      (:class:`UnsupportedSetting`).

    Capabilities are properties, as storages have them (:attr:`supports_scoring`,
    :attr:`supports_weight_updates`); a method whose capability is False raises
    :class:`UnsupportedCapability`."""

    name: str = "engine"
    """Short name for messages and metrics (``loop``, ``vllm``)."""
    retries: Any = None
    """How a server's engine asks again and restarts the server it owns (``vllm_http.Retries``: its
    ``announce`` says each restart); None for our loop."""
    stopping: threading.Event | None = None
    """Set, on this class, by a process of ``run`` that makes engines (``runs/processes.py``): its
    stop (a signal, its launcher gone). A wait of any of its engines with no bound of its own (a shared
    server held on other collectors' weights, the connection check of an engine's construction
    included) then ends with :class:`EngineStopped`."""

    def __init__(self, stop_token_ids: Sequence[int], policy_version: int = 0) -> None:
        if not stop_token_ids:
            raise ValueError(f"{type(self).__name__}: stop_token_ids is empty; pass the tokenizer's EOS id at least")
        self.stop_token_ids: list[int] = sorted(int(t) for t in stop_token_ids)
        """A completion ends at the first of these it samples (kept as its last token)."""
        self._policy_version = int(policy_version)
        self.stats = EngineStats()

    # ------------------------------------------------------------------ capabilities
    @property
    def supports_scoring(self) -> bool:
        """True when :meth:`score` gives teacher-forced log-probs of given responses."""
        return False

    @property
    def supports_weight_updates(self) -> bool:
        """True when :meth:`load_weights` loads new weights in place, without a restart."""
        return True

    @property
    def policy_version(self) -> int:
        """The version of the weights this engine holds: what the next groups are sampled with."""
        return self._policy_version

    # ------------------------------------------------------------------ sampling
    def check_sampling(self, sampling: SamplingConfig) -> None:
        """Raises :class:`UnsupportedSetting` naming a setting this engine cannot honour exactly."""

    @abstractmethod
    def submit(self, request: SampleRequest, seed: int, sampling: SamplingConfig) -> Future[CompletionGroup]:
        """Starts (or queues, until :meth:`flush`) ``request``, its draws from ``seed`` alone; the future
        holds its group, or the :class:`EngineFailed` that ended it."""

    def flush(self) -> None:
        """The caller is about to wait for what it submitted: an engine that batches what is queued
        (our loop) starts it now. Servers start each request on :meth:`submit`: nothing to do."""

    def sample(self, requests: Sequence[SampleRequest], seeds: Sequence[int],
               sampling: SamplingConfig) -> list[CompletionGroup]:
        """One group per request, in request order (``index`` its position): every request submitted,
        then every answer waited for; the first failure is raised once all have ended."""
        if len(seeds) != len(requests):
            raise ValueError(f"sample: {len(seeds)} seeds for {len(requests)} requests (one seed per request)")
        futures = [self.submit(request, seed, sampling) for request, seed in zip(requests, seeds)]
        self.flush()
        wait(futures)
        return [dataclasses.replace(future.result(), index=k) for k, future in enumerate(futures)]

    def holding(self) -> contextlib.AbstractContextManager:
        """Keeps what samples this engine's requests on its weights across every call made in the
        block: a server other collectors share is leased once for the block, not once per request in
        flight, so requests that come one after another (an agent's turns) neither wait for other
        weights nor load theirs again between them. Our loop holds its own weights anyway."""
        return contextlib.nullcontext(self)

    def score(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
              sampling: SamplingConfig | None = None) -> list[list[float]]:
        """Teacher-forced log-prob of each response token given the prompt and the response so far;
        ``sampling`` None: the raw model distribution (temperature 1, no truncation)."""
        raise UnsupportedCapability(f"the {self.name} engine does not score given responses (supports_scoring "
                                    f"is False); score with the loop engine")

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Mapping[str, torch.Tensor] | str | os.PathLike[str], version: int) -> None:
        """Loads ``weights`` (a state dict, or the path of a published safetensors file) as ``version``.

        Versions only move forward. Called between rounds, with nothing of the caller in flight; what
        the engine derived from the old weights (a prefix cache, repacked kernels, a tied head) is
        rebuilt before the next request. Records the time it took in :attr:`stats`."""
        if version < self._policy_version:
            raise ValueError(f"load_weights: version {version} is older than the current {self._policy_version}; "
                             f"weights only move forward")
        started = time.perf_counter()
        self._load(weights, int(version))
        elapsed = time.perf_counter() - started
        self._policy_version = int(version)
        self.stats.weight_updates += 1
        self.stats.last_update_s = elapsed
        self.stats.update_s_total += elapsed

    def _load(self, weights: Mapping[str, torch.Tensor] | str | os.PathLike[str], version: int) -> None:
        raise UnsupportedCapability(f"the {self.name} engine cannot load new weights in place")

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Stops what the engine started (a process, a connection); idempotent."""

    def __enter__(self) -> GenerationEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
