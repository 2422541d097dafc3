"""Our sampling loop over a ``transformers`` causal LM, and :class:`LoopEngine`, the generation
engine around it (the embedded default: what every collector used before engines existed).

Generation is a plain loop rather than ``model.generate`` so the RNG (a ``torch.Generator`` the
collector checkpoints), the log-prob definition (``generation/sampling.py``) and the stop rule are
ours: prompts are left-padded, ``position_ids = cumsum(mask) - 1``, the KV cache is reused across
steps, a row stops at EOS (EOS kept as its last response token, ``terminated``) or at
``max_new_tokens`` (``truncated``). Nothing after EOS is part of the response.

:class:`LoopEngine` draws every token from the generator it is given, over the whole call as one
batch, so a collector's rows are exactly those of calling :func:`generate` directly (the
exact-resume and determinism tests hold them to it). Requests with their own ``max_new_tokens``
are sampled to the largest limit and each cut at its own (a cut row keeps a stop token that
falls inside its limit), as ``agents/rollout.py``'s ``cut_to_limits`` does.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from rlhf_pipeline.generation.engine import Completion, CompletionGroup, EngineFailed, GenerationEngine, SampleRequest
from rlhf_pipeline.generation.sampling import SamplingConfig, process_logits
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


def left_pad(sequences: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lists of ids -> ``(ids (N, L), mask (N, L))`` padded on the left."""
    ragged = RaggedTensor.from_sequences([list(s) for s in sequences], dtype=torch.int64)
    return ragged.to_padded(pad_value=pad_token_id, side="left")


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
    generator: torch.Generator | None = None,
) -> Iterator[DecodeStep]:
    """Our sampling loop, one :class:`DecodeStep` per sampled token: one row per prompt, all decoded
    in one batch, every token drawn from ``generator`` (it must live on the model's device).

    :func:`generate` drains it; :meth:`LoopEngine.stream_batches` reads rows as they stop. The draws are the
    same either way: a caller that stops iterating early has drawn fewer, never other ones."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate() needs at least one prompt and every prompt needs at least one token")
    device = next(model.parameters()).device
    eos_ids = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), device=device)
    ids, mask = left_pad(prompts, pad_token_id)
    ids, mask = ids.to(device), mask.to(device).long()  # (N, P)
    n = ids.shape[0]

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


def _draw(logp: torch.Tensor, generator: torch.Generator | None, step: int) -> torch.Tensor:
    """One token a row from ``logp`` (N, V). Weights that are finite but huge (a learning rate far too
    large) give logits that overflow: an engine failure in one line, not torch's traceback; checked
    only once the draw failed, so a healthy step pays nothing."""
    probs = logp.exp()
    try:
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
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
        prompt_tokens=RaggedTensor.from_sequences([list(p) for p in repeated], dtype=torch.int64),
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


# ====================================================================== the engine
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


class LoopEngine(GenerationEngine):
    """Our sampling loop as a :class:`~rlhf_pipeline.generation.engine.GenerationEngine`.

    It samples with ``model`` in this process (on the model's device; the generator must live
    there too) and scores with :func:`teacher_forced_log_probs`. New weights are loaded into
    ``model`` itself, so a caller holding it sees them."""

    name = "loop"

    def __init__(self, model, *, pad_token_id: int, eos_token_id: int | Sequence[int], policy_version: int = 0) -> None:
        super().__init__([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id, policy_version)
        self.model = model.eval()
        self.pad_token_id = int(pad_token_id)

    @property
    def supports_scoring(self) -> bool:
        return True

    @property
    def generator_device(self) -> str:
        return str(next(self.model.parameters()).device)

    @property
    def supports_streaming(self) -> bool:
        return True

    def sample(self, requests: Sequence[SampleRequest], sampling: SamplingConfig,
               generator: torch.Generator) -> list[CompletionGroup]:
        if not requests:
            return []
        # one batch of every completion, each request's n rows together: the order (and so the random
        # stream) of generate(prompts, num_samples=n)
        prompts = [list(r.prompt_ids) for r in requests for _ in range(r.n)]
        limits = [r.limit(sampling) for r in requests]
        longest = max(limits)
        config = sampling if longest == sampling.max_new_tokens else dataclasses.replace(sampling, max_new_tokens=longest)
        gen = generate(self.model, prompts, config, pad_token_id=self.pad_token_id, eos_token_id=self.stop_token_ids,
                       generator=generator)
        ids, log_probs = gen.response_tokens.to_list(), gen.response_log_probs.to_list()
        stops = set(self.stop_token_ids)
        groups, row = [], 0
        for index, (request, limit) in enumerate(zip(requests, limits, strict=True)):
            completions = []
            for _ in range(request.n):
                tokens, lps = ids[row].tolist()[:limit], log_probs[row].tolist()[:limit]
                completions.append(Completion(tokens, lps, terminated=bool(tokens) and tokens[-1] in stops))
                row += 1
            groups.append(CompletionGroup(index, completions, self.policy_version))
        return groups

    def stream_batches(self, requests: Sequence[SampleRequest], sampling: SamplingConfig,
                       generator: torch.Generator) -> Iterator[list[CompletionGroup]]:
        """Each request's group once its last row stopped (sampled a stop token or reached the request's
        limit), in the order they stop; the groups that stop at one step together, in request order.

        The whole call is one batch, each request's ``n`` rows together: the order (and so the random
        stream) of ``generate(prompts, num_samples=n)``. Rows that stopped keep being decoded (as pads)
        until the batch's last row stops, so the draws, and the generator's state after the call, are
        those of a call that waits for the end."""
        if not requests:
            return
        prompts = [list(r.prompt_ids) for r in requests for _ in range(r.n)]
        limits = [r.limit(sampling) for r in requests]
        longest = max(limits)
        config = sampling if longest == sampling.max_new_tokens else dataclasses.replace(sampling, max_new_tokens=longest)
        first_row = [0]
        for request in requests:
            first_row.append(first_row[-1] + request.n)
        stops = set(self.stop_token_ids)
        waiting = list(range(len(requests)))  # requests whose group is not yielded yet
        for state in decode_steps(self.model, prompts, config, pad_token_id=self.pad_token_id,
                                  eos_token_id=self.stop_token_ids, generator=generator):
            ended = [i for i in waiting if state.step + 1 >= limits[i]
                     or bool(state.finished[first_row[i]:first_row[i + 1]].all())]
            if not ended:
                continue
            groups = []
            for index in ended:
                completions = []
                for row in range(first_row[index], first_row[index + 1]):
                    tokens, lps = state.row(row, limits[index])
                    completions.append(Completion(tokens, lps, terminated=bool(tokens) and tokens[-1] in stops))
                groups.append(CompletionGroup(index, completions, self.policy_version))
            waiting = [i for i in waiting if i not in ended]
            yield groups

    def score(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
              sampling: SamplingConfig | None = None) -> list[list[float]]:
        scored = teacher_forced_log_probs(
            self.model, RaggedTensor.from_sequences([list(p) for p in prompts], dtype=torch.int64),
            RaggedTensor.from_sequences([list(r) for r in responses], dtype=torch.int64), sampling,
            pad_token_id=self.pad_token_id)
        return [row.tolist() for row in scored.to_list()]

    def _load_weights(self, weights, version: int) -> None:
        if isinstance(weights, (str, os.PathLike)):
            from safetensors.torch import load_file

            weights = load_file(os.fspath(weights))
        load_state_into(self.model, weights)
