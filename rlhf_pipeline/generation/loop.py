"""Our sampling loop over a ``transformers`` causal LM (:func:`generate`, :func:`decode_steps`,
:func:`teacher_forced_log_probs`) and :class:`LoopEngine`, the default engine around it: it decodes, on
a thread of its own, what was submitted before the caller's flush as one batch, each request's rows
drawn from a generator seeded with its seed. A LoRA run's versions are merged into the base and checked
with the served-policy canary before any row (docs/lora.md#how-the-loop-engine-samples-an-adapter-version).
Why one file: the engine's batches are the loop's rows, its seeds the loop's generators, and the weights
it loads are the model the loop decodes with; apart, each would be read out of the other's context.
Design: docs/collector.md#generation-engines.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from rlhf_pipeline.generation.engine import Completion, CompletionGroup, EngineFailed, GenerationEngine, SampleRequest
from rlhf_pipeline.generation.sampling import SamplingConfig, process_logits
from rlhf_pipeline.models.lora import AdapterMerger, canary_difference, served_policy_failure
from rlhf_pipeline.schema.ragged import RaggedTensor


@dataclass
class Generation:
    """N = num_prompts * num_samples completions; row ``i`` answers prompt ``prompt_index[i]``.

    Rows are grouped by prompt: the ``num_samples`` completions of prompt 0 come first.
    """

    prompt_tokens: RaggedTensor  # N rows, int64
    response_tokens: RaggedTensor  # N rows, int64, EOS included when the row stopped on it
    response_log_probs: RaggedTensor  # N rows, float32, aligned with response_tokens
    terminated: torch.Tensor  # (N,) bool, stopped on EOS
    truncated: torch.Tensor  # (N,) bool, hit max_new_tokens
    prompt_index: torch.Tensor  # (N,) int64


def _ragged_ids(sequences: Sequence[Sequence[int]]) -> RaggedTensor:
    return RaggedTensor.from_sequences([list(s) for s in sequences], dtype=torch.int64)


def left_pad(sequences: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lists of ids -> ``(ids (N, L), mask (N, L))`` padded on the left."""
    return _ragged_ids(sequences).to_padded(pad_value=pad_token_id, side="left")


def _cache_keyword(model) -> str:
    """The name under which ``model``'s forward takes and returns its KV cache: ``cache`` from
    transformers 5.24, ``past_key_values`` before. 5.24 still takes the old name, but warns twice
    on every collector start; an older one given ``cache`` would ignore it and decode from one
    token without context."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in parameters else "past_key_values"


def _positions(mask: torch.Tensor) -> torch.Tensor:
    # left padding: the first real token sits at position 0 (pads get 0 too; they are masked)
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


@dataclass
class DecodeStep:
    """Where :func:`decode_steps` stands after sampling one token for every row (all on the CPU).

    A row is decoded until every row stopped (or ``max_new_tokens``): a stopped row gets the pad token
    from then on, drawn but not kept, so the random stream does not depend on when rows stop."""

    step: int
    """The index of the token just sampled (0 for the first response token)."""
    tokens: list[torch.Tensor]  # step + 1 tensors of (N,), int64
    log_probs: list[torch.Tensor]  # step + 1 tensors of (N,), aligned with tokens
    lengths: torch.Tensor  # (N,) int64: response tokens each row kept so far (its stop token included)
    finished: torch.Tensor  # (N,) bool: the row sampled a stop token
    last: bool
    """No further step follows (every row stopped, or the limit was reached)."""

    def row(self, index: int, limit: int) -> tuple[list[int], list[float]]:
        """Row ``index``'s response so far, cut at ``limit`` tokens: its ids and their log-probs."""
        if self._stacked is None:  # once per step, however many rows are read from it
            self._stacked = (torch.stack(self.tokens, dim=1), torch.stack(self.log_probs, dim=1))  # (N, R) each
        keep = min(int(self.lengths[index]), limit)
        ids, lps = self._stacked
        return ids[index, :keep].tolist(), lps[index, :keep].tolist()

    _stacked: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False, repr=False)


@torch.no_grad()
def decode_steps(
    model,
    prompts: Sequence[Sequence[int]],
    config: SamplingConfig,
    *,
    pad_token_id: int,
    eos_token_id: int | Sequence[int],
    generator: torch.Generator | Sequence[tuple[int, int, torch.Generator]] | None = None,
) -> Iterator[DecodeStep]:
    """Our sampling loop, one :class:`DecodeStep` per sampled token: one row per prompt, all decoded
    in one batch, every token drawn from ``generator`` (it must live on the model's device), or rows
    ``start:end`` of each ``(start, end, generator)`` from that generator (:class:`LoopEngine`: one
    per request). :func:`generate` drains it; a caller that stops iterating early has drawn fewer
    tokens, never other ones."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate() needs at least one prompt and every prompt needs at least one token")
    device = next(model.parameters()).device
    eos_ids = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), device=device)
    ids, mask = left_pad(prompts, pad_token_id)
    ids, mask = ids.to(device), mask.to(device).long()  # (N, P)
    n = ids.shape[0]
    if generator is None or isinstance(generator, torch.Generator):  # one generator draws every row
        generator = [(0, n, generator)]

    cache_name = _cache_keyword(model)
    out = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), use_cache=True)
    past, next_logits = getattr(out, cache_name), out.logits[:, -1]  # (N, V)
    position = _positions(mask)[:, -1:]  # (N, 1)
    tokens, log_probs = [], []
    finished = torch.zeros(n, dtype=torch.bool, device=device)
    lengths = torch.zeros(n, dtype=torch.int64, device=device)
    for step in range(config.max_new_tokens):
        logp = torch.log_softmax(process_logits(next_logits, config), dim=-1)  # (N, V)
        token = _draw(logp, generator, step)  # (N,)
        token = torch.where(finished, torch.full_like(token, pad_token_id), token)
        tokens.append(token.cpu())
        log_probs.append(logp.gather(-1, token[:, None]).squeeze(-1).float().cpu())
        lengths += (~finished).long()
        finished |= torch.isin(token, eos_ids)
        last = bool(finished.all()) or step == config.max_new_tokens - 1
        yield DecodeStep(step, tokens, log_probs, lengths.cpu(), finished.cpu(), last)
        if last:
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        position = position + 1
        out = model(input_ids=token[:, None], attention_mask=mask, position_ids=position,
                    use_cache=True, **{cache_name: past})
        past, next_logits = getattr(out, cache_name), out.logits[:, -1]


def _draw(logp: torch.Tensor, generators: Sequence[tuple[int, int, torch.Generator | None]], step: int) -> torch.Tensor:
    """One token a row from ``logp`` (N, V), rows ``start:end`` from each generator. Weights that are
    finite but huge (a learning rate far too large) give logits that overflow: an engine failure in one
    line, not torch's traceback; checked only once the draw failed, so a healthy step pays nothing."""
    probs = logp.exp()
    try:
        return torch.cat([torch.multinomial(probs[start:end], 1, generator=own).squeeze(-1)
                          for start, end, own in generators])
    except RuntimeError:
        if bool(torch.isfinite(probs).all()):
            raise
        raise EngineFailed(f"the policy's next-token probabilities are not finite (decoding step {step}): its weights "
                           f"overflow or hold NaN; nothing of this round is stored. Resume from a checkpoint whose "
                           f"weights are sound with a smaller learner.lr") from None


def generate(
    model,
    prompts: Sequence[Sequence[int]],
    config: SamplingConfig,
    *,
    pad_token_id: int,
    eos_token_id: int | Sequence[int],
    num_samples: int = 1,
    generator: torch.Generator | None = None,
) -> Generation:
    """Samples ``num_samples`` completions of each prompt (token-id lists) in one batch.

    ``generator`` drives every draw (pass the collector's so a restart resumes the
    same random stream); it must live on the model's device.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    prompt_index = torch.arange(len(prompts)).repeat_interleave(num_samples)  # (N,)
    repeated = [prompts[i] for i in prompt_index.tolist()]
    for state in decode_steps(model, repeated, config, pad_token_id=pad_token_id, eos_token_id=eos_token_id,
                              generator=generator):
        pass
    response = torch.stack(state.tokens, dim=1)  # (N, R)
    response_lp = torch.stack(state.log_probs, dim=1)  # (N, R)
    valid = torch.arange(response.shape[1])[None, :] < state.lengths[:, None]  # (N, R)
    terminated = state.finished
    return Generation(
        prompt_tokens=_ragged_ids(repeated),
        response_tokens=RaggedTensor.from_padded(response, valid),
        response_log_probs=RaggedTensor.from_padded(response_lp, valid),
        terminated=terminated,
        truncated=~terminated,
        prompt_index=prompt_index,
    )


@torch.no_grad()
def teacher_forced_log_probs(
    model,
    prompt_tokens: RaggedTensor,
    response_tokens: RaggedTensor,
    config: SamplingConfig | None = None,
    *,
    pad_token_id: int = 0,
) -> RaggedTensor:
    """Log-prob of each response token given prompt + earlier response, one forward pass.

    ``config`` applies the same temperature / top-k / top-p processing as sampling;
    ``None`` means the raw model distribution (temperature 1, no truncation), which is
    what a reference-model log-prob usually is. Rows are left-padded with
    ``position_ids = cumsum(mask) - 1``, as in :func:`generate`.
    """
    device = next(model.parameters()).device
    full = RaggedTensor.cat([prompt_tokens, response_tokens])  # 2N rows; interleave below
    n = len(prompt_tokens)
    order = torch.stack([torch.arange(n), torch.arange(n) + n], dim=1).reshape(-1)
    paired = full.index(order)  # prompt_i, response_i, ...
    joined = RaggedTensor.from_lengths(paired.values, paired.lengths().reshape(n, 2).sum(1))
    ids, mask = joined.to_padded(pad_value=pad_token_id, side="left")  # (N, L)
    ids, mask = ids.to(device).long(), mask.to(device).long()
    logits = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits  # (N, L, V)
    if config is not None:
        logits = process_logits(logits, config)
    logp = torch.log_softmax(logits.float()[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (N, L-1)
    resp_len = response_tokens.lengths().to(device)
    width = ids.shape[1] - 1
    # response tokens are the last resp_len positions of each left-padded row
    valid = torch.arange(width, device=device)[None, :] >= (width - resp_len)[:, None]
    return RaggedTensor.from_padded(logp.cpu(), valid.cpu())


def log_prob_gap(model, prompts: Sequence[Sequence[int]], completions: Sequence[Completion],
                 config: SamplingConfig | None) -> float:
    """How far an engine's answer is from sampling with ``model``: the largest difference between the
    log-probs of ``completions`` (``completions[i]`` answers ``prompts[i]``) and ``model``'s
    teacher-forced ones under ``config`` (None: the raw distribution)."""
    again = teacher_forced_log_probs(model, _ragged_ids(prompts), _ragged_ids([c.token_ids for c in completions]),
                                     config)
    served = torch.tensor([p for c in completions for p in c.log_probs])
    return float((again.values.float() - served).abs().max())


# ====================================================================== the engine
class ServedPolicyMismatch(EngineFailed):
    """A LoRA version the engine does not serve as the learner published it (models/lora.py's canary):
    refused on load, before any row of it is sampled; the collector stops saying so in one line."""


def load_state_into(model, state_dict) -> None:
    """Loads published weights into ``model`` (every key must match; a tied ``lm_head`` may be
    absent) and sets eval mode."""
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    # tied embeddings may be saved once; anything else missing means the wrong checkpoint
    missing = [k for k in missing if k != "lm_head.weight" or not model.config.tie_word_embeddings]
    if missing or unexpected:
        raise ValueError(
            f"set_policy_state: weights do not match the collector's model "
            f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    model.eval()


class MergedPolicy:
    """``model`` holding the version an engine serves: whole weights loaded into it, a LoRA run's adapter
    versions merged into the base it holds (docs/lora.md), each then checked with the served-policy
    canary: ``model`` must score the learner's fixed tokens as the learner did, or the version is refused
    before any row of it is sampled. ``scored``: what the canary compares, for the refusal's line;
    ``holds_base``: ``model`` holds the base already (else an adapter waits for whole weights)."""

    def __init__(self, model, scored: str, *, holds_base: bool = False) -> None:
        self.model, self.scored = model, scored
        self._merger = AdapterMerger()
        if holds_base:
            self._merger.set_base()
        self.last_canary_difference: float | None = None
        """The canary of the last adapter version loaded: its largest log-prob difference."""

    def load(self, weights, version: int) -> None:
        """``weights`` (a state dict, a ``PolicyAdapter`` or the path of a safetensors file) as ``version``."""
        from rlhf_pipeline.models.lora import PolicyAdapter

        if isinstance(weights, (str, os.PathLike)):
            from safetensors.torch import load_file

            weights = load_file(os.fspath(weights))
        if not isinstance(weights, PolicyAdapter):
            load_state_into(self.model, weights)
            self._merger.set_base()
            return
        try:
            if weights.base is not None:  # a collector started past version 0: the base first
                load_state_into(self.model, weights.base)
                self._merger.set_base()
            self._merger.apply(self.model, weights, version)
            self.model.eval()
            difference, tolerance = canary_difference(self.model, weights, version)
        except ValueError as exc:
            raise ServedPolicyMismatch(f"weights version {version} cannot be served: {exc}") from None
        if not difference <= tolerance:
            raise ServedPolicyMismatch(served_policy_failure(version, difference, tolerance, self.scored))
        self.last_canary_difference = difference


class LoopEngine(GenerationEngine):
    """Our sampling loop as a :class:`~rlhf_pipeline.generation.engine.GenerationEngine`.

    It samples with ``model`` in this process, on a thread of its own (see the module docstring), on
    the model's device, and scores with :func:`teacher_forced_log_probs`. New weights are loaded into
    ``model`` itself, so a caller holding it sees them."""

    name = "loop"

    def __init__(self, model, *, pad_token_id: int, eos_token_id: int | Sequence[int], policy_version: int = 0) -> None:
        super().__init__([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id, policy_version)
        self.model = model.eval()
        self.pad_token_id = int(pad_token_id)
        self.policy = MergedPolicy(self.model, "the engine's log-probs of the canary tokens")
        self._queue: list[_Queued] = []
        self._ready = 0  # queued requests a flush let go
        self._closed = False
        # one lock for the queue and for handing out a batch's answers: a flush sees a batch answered
        # whole or not at all (re-entrant: a done-callback may submit)
        self._wake = threading.Condition(threading.RLock())
        self._decoding = threading.Lock()  # held while a batch decodes: weights change between batches
        self._thread = threading.Thread(target=self._serve, name="loop-engine", daemon=True)
        self._thread.start()

    @property
    def supports_scoring(self) -> bool:
        return True

    def submit(self, request: SampleRequest, seed: int, sampling: SamplingConfig) -> Future[CompletionGroup]:
        future: Future[CompletionGroup] = Future()
        with self._wake:
            if self._closed:
                raise EngineFailed("the loop engine is closed; no request is taken")
            self._queue.append(_Queued(request, int(seed), sampling, future))
        return future

    def flush(self) -> None:
        with self._wake:
            self._ready = len(self._queue)
            self._wake.notify()

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not self._ready and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                batch, self._queue = self._queue[:self._ready], self._queue[self._ready:]
                self._ready = 0
            with self._decoding:
                # one batch per sampling distribution (temperature, top-k, top-p): process_logits takes one
                kinds: dict[tuple, list[_Queued]] = {}
                for item in batch:
                    if item.future.set_running_or_notify_cancel():
                        kinds.setdefault(_distribution(item.sampling), []).append(item)
                for items in kinds.values():
                    try:
                        self._decode(items)
                    except BaseException as exc:  # the batch's callers get it; the thread serves on
                        with self._wake:
                            for item in items:
                                if not item.future.done():
                                    item.future.set_exception(exc)

    def _decode(self, items: list[_Queued]) -> None:
        """One padded batch of every queued request's ``n`` rows, each request's from its own generator,
        each answered at the step its rows all stopped (those of one step together, under the queue's
        lock: a flush sees them answered together or not at all)."""
        device = next(self.model.parameters()).device
        prompts, draws, limits = [], [], []
        for item in items:
            first = len(prompts)
            prompts += [list(item.request.prompt_ids)] * item.request.n
            draws.append((first, len(prompts), torch.Generator(device=device).manual_seed(item.seed)))
            limits.append(item.request.limit(item.sampling))
        config = dataclasses.replace(items[0].sampling, max_new_tokens=max(limits))
        stops = set(self.stop_token_ids)
        waiting = list(range(len(items)))
        for state in decode_steps(self.model, prompts, config, pad_token_id=self.pad_token_id,
                                  eos_token_id=self.stop_token_ids, generator=draws):
            ended = [k for k in waiting if state.step + 1 >= limits[k]
                     or bool(state.finished[draws[k][0]:draws[k][1]].all())]
            if not ended:
                continue
            answers = []
            for k in ended:
                completions = []
                for row in range(draws[k][0], draws[k][1]):
                    tokens, lps = state.row(row, limits[k])
                    completions.append(Completion(tokens, lps, terminated=bool(tokens) and tokens[-1] in stops))
                answers.append((items[k], CompletionGroup(completions, self.policy_version, items[k].seed)))
            waiting = [k for k in waiting if k not in ended]
            with self._wake:
                for item, group in answers:
                    item.future.set_result(group)

    def score(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
              sampling: SamplingConfig | None = None) -> list[list[float]]:
        with self._decoding:
            scored = teacher_forced_log_probs(self.model, _ragged_ids(prompts), _ragged_ids(responses), sampling,
                                              pad_token_id=self.pad_token_id)
        return [row.tolist() for row in scored.to_list()]

    def _load(self, weights, version: int) -> None:
        with self._decoding:
            self.policy.load(weights, version)

    def close(self) -> None:
        """Stops the thread; requests still queued fail with :class:`EngineFailed`."""
        with self._wake:
            if self._closed:
                return
            self._closed = True
            left, self._queue = self._queue, []
            self._wake.notify()
        for item in left:
            if item.future.set_running_or_notify_cancel():
                item.future.set_exception(EngineFailed("the loop engine was closed before this request was decoded"))
        if self._thread is not threading.current_thread():
            self._thread.join()


@dataclass
class _Queued:
    request: SampleRequest
    seed: int
    sampling: SamplingConfig
    future: Future


def _distribution(sampling: SamplingConfig) -> tuple:
    """What decides a batch's sampling distribution (its length limit does not)."""
    return sampling.temperature, sampling.top_k, sampling.top_p
