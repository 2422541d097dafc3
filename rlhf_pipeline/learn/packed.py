"""The packed learner forward: rows laid end to end, log-probs scattered back, the same GRPO loss.

The padded path (``schema/padding.py`` + ``learn/microbatch.py``) runs the model on a (B, T)
rectangle per micro-batch and pays for every pad column. Here a micro-batch is ONE sequence
(1, L) of its rows' real tokens, prompt then response, row after row, planned by
``learn/packing.py`` (first-fit decreasing into ``micro_batch_tokens``):

    packed:     [p0 p0 p0 r0 r0 | p1 p1 r1 r1 r1 r1 | p2 r2 ...]      input_ids     (1, L)
    positions:  [0  1  2  3  4  | 0  1  2  3  4  5  | 0  1  ...]      position_ids  (1, L)
    rows:        cu_seq_lens = [0, 5, 11, ...]                          int32 (n + 1,)

* positions restart at 0 at each row, so rotary embeddings see what the padded forward gives
  a row (its ``cumsum(mask) - 1`` positions);
* no token attends across rows: the model runs with the ``rlhf_packed`` attention
  (``learn/packed_attention.py``: causal within each row, per device);
* logits are computed only where they score a response token (``logits_to_keep``: the token
  before each response token), not for prompts or padding;
* the per-token log-probs and entropies are scattered back into a response-aligned (n, R)
  layout, and the SAME :func:`rlhf_pipeline.learn.loss.grpo_loss` runs on them, with the
  stored sampling/reference log-probs in that layout. The loss is elementwise per row with
  per-row aggregation, so every variant (aggregations, GSPO, KL, entropy, TIS, row feedback,
  importance weights) gives the padded path's value; ``tests/learn/test_packing.py`` checks
  loss and gradients to 1e-5 in float32.

A multi-turn trajectory is one row whose response holds the environment's tokens between its
turns (``learn/trajectories.py``): :attr:`RaggedRows.loss_mask` says which response tokens were
sampled, and only those are scored (``logits_to_keep``) and carry loss; with per-turn
advantages :attr:`RaggedRows.token_advantage` gives each response token its own.

Rows come in as :class:`RaggedRows` (token and log-prob values without padding), taken from
a padded batch (:meth:`RaggedRows.from_padded`), straight from stored rows
(:meth:`RaggedRows.from_trajectory_batch`, what ``store.read_ragged`` gives) or from joined
trajectories (:meth:`RaggedRows.from_joined`). The learner builds its packed micro-batches on
the prefetch thread from the last two, no padded batch in between (``learn/packed_batch.py``).
Every row needs at least one prompt token (its first response token is scored from the last
prompt token's logits).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from rlhf_pipeline.learn.loss import GRPOLossConfig, grpo_loss
from rlhf_pipeline.learn.packing import PackPlan, plan_packs
from rlhf_pipeline.learn.trajectories import TOKEN_ADVANTAGE_KEY, JoinedTrajectories
from rlhf_pipeline.schema.ragged import RaggedTensor, gather_ranges, lengths_to_offsets


# ====================================================================== ragged input rows
@dataclass(frozen=True)
class RaggedRows:
    """The fields a GRPO step reads, one entry per row, without padding."""

    prompt_tokens: RaggedTensor
    response_tokens: RaggedTensor
    response_log_probs: RaggedTensor  # the sampler's, aligned with response_tokens
    advantage: torch.Tensor  # (B,) float32
    ref_log_probs: RaggedTensor | None = None  # reference log-probs (kl_coef > 0)
    sample_weight: torch.Tensor | None = None  # (B,) prioritized sampling's importance weights
    loss_mask: RaggedTensor | None = None  # bool, aligned with response_tokens; None: every response token
    token_advantage: RaggedTensor | None = None  # float32, aligned with response_tokens; None: ``advantage``

    def __len__(self) -> int:
        return len(self.response_tokens)

    def lengths(self) -> torch.Tensor:
        """(B,) tokens of each row, prompt + response."""
        return self.prompt_tokens.lengths() + self.response_tokens.lengths()

    @classmethod
    def from_padded(cls, batch) -> RaggedRows:
        """From a ``pad_batch`` TensorDict (its prompt and response views and masks)."""
        keys = batch.keys(include_nested=True)
        if "sequence_advantage" not in keys:
            raise KeyError("the padded batch has no advantage ('sequence_advantage'); attach the group-advantage "
                           "transform to the buffer's write path so stored rows carry 'advantage'")
        response_mask = batch["masks", "response"]
        ref = ("ref_log_probs", "response")
        prompt_width = batch["tokens", "prompt"].shape[1]
        # a multi-turn batch's loss mask is 0 on the environment's tokens inside the response
        loss = batch["masks", "all_assistant_mask"][:, prompt_width:]
        loss_mask = None if torch.equal(loss, response_mask) else RaggedTensor.from_padded(loss, response_mask)
        token_advantage = (RaggedTensor.from_padded(batch[TOKEN_ADVANTAGE_KEY][:, prompt_width:], response_mask)
                           if TOKEN_ADVANTAGE_KEY in keys else None)
        return cls(
            prompt_tokens=RaggedTensor.from_padded(batch["tokens", "prompt"], batch["masks", "prompt"]),
            response_tokens=RaggedTensor.from_padded(batch["tokens", "response"], response_mask),
            response_log_probs=RaggedTensor.from_padded(batch["log_probs", "response"], response_mask),
            advantage=batch["sequence_advantage"].to(torch.float32),
            ref_log_probs=RaggedTensor.from_padded(batch[ref], response_mask) if ref in keys else None,
            sample_weight=batch["sample_weight"] if "sample_weight" in keys else None,
            loss_mask=loss_mask,
            token_advantage=token_advantage,
        )

    @classmethod
    def from_trajectory_batch(cls, batch, sample_weight: torch.Tensor | None = None) -> RaggedRows:
        """From stored rows (``store.read(positions)``), with no padded batch built at all."""
        if "advantage" not in batch:
            raise KeyError("the rows have no 'advantage'; attach the group-advantage transform to the buffer's "
                           "write path")
        return cls(
            prompt_tokens=batch["prompt_tokens"],
            response_tokens=batch["response_tokens"],
            response_log_probs=batch["response_log_probs"].to(torch.float32),
            advantage=batch["advantage"].to(torch.float32),
            ref_log_probs=batch["ref_log_probs"].to(torch.float32) if "ref_log_probs" in batch else None,
            sample_weight=sample_weight,
        )

    @classmethod
    def from_joined(cls, joined: JoinedTrajectories) -> RaggedRows:
        """From multi-turn trajectories joined into one row each (``learn/trajectories.py``): the
        loss mask on their sampled tokens, per-token advantages in ``turn`` mode."""
        rows = cls.from_trajectory_batch(joined.rows)
        return dataclasses.replace(rows, loss_mask=joined.loss_mask, token_advantage=joined.token_advantage)

    def select(self, index: torch.Tensor) -> RaggedRows:
        """Rows ``index`` (CPU int64), every column alike."""
        def rows_of(value):
            if value is None:
                return None
            return value.index(index) if isinstance(value, RaggedTensor) else value[index]

        return RaggedRows(**{f.name: rows_of(getattr(self, f.name)) for f in dataclasses.fields(self)})


# ====================================================================== one packed micro-batch
@dataclass(frozen=True)
class PackedMicroBatch:
    """One packed sequence and the response-aligned tensors its loss reads (n rows, R = longest response)."""

    rows: torch.Tensor  # (n,) int64: the rows' indices in the step's batch
    input_ids: torch.Tensor  # (1, L) int64
    position_ids: torch.Tensor  # (1, L) int64, restarting at 0 at each row
    cu_seq_lens: torch.Tensor  # (n + 1,) int32 row offsets in the sequence
    max_length: int  # longest row
    logit_positions: torch.Tensor  # (N,) int64: position whose logits score each trained response token
    targets: torch.Tensor  # (N,) int64: the trained response tokens, row after row
    response_mask: torch.Tensor  # (n, R) bool: True on the response tokens that carry loss (all, single-turn)
    sampler_log_probs: torch.Tensor  # (n, R) float32, 0 off the response
    advantages: torch.Tensor  # (n,) float32, or (n, R) per token (per-turn advantages)
    ref_log_probs: torch.Tensor | None  # (n, R) float32
    sample_weight: torch.Tensor | None  # (n,)

    @property
    def num_rows(self) -> int:
        return self.rows.numel()

    @property
    def num_tokens(self) -> int:
        """L: real tokens in the sequence (the forward's size)."""
        return self.input_ids.shape[1]

    @property
    def response_tokens(self) -> int:
        return self.targets.numel()

    def to(self, device, non_blocking: bool = False) -> PackedMicroBatch:
        """Every tensor on ``device`` (``rows`` too; callers that index CPU tensors keep their own)."""
        moved = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            moved[f.name] = value.to(device, non_blocking=non_blocking) if isinstance(value, torch.Tensor) else value
        return PackedMicroBatch(**moved)

    def pin_memory(self) -> PackedMicroBatch:
        """Every tensor in page-locked memory, so a ``non_blocking`` copy to a GPU overlaps compute
        (only where CUDA is available: pinning raises on CPU-only torch builds)."""
        if not torch.cuda.is_available():
            return self
        return PackedMicroBatch(**{f.name: value.pin_memory() if isinstance(value, torch.Tensor) else value
                                   for f in dataclasses.fields(self) for value in (getattr(self, f.name),)})


def pack_rows(rows: RaggedRows, members: torch.Tensor | list[int]) -> PackedMicroBatch:
    """Rows ``members`` of ``rows`` as one packed sequence, in the order given."""
    index = torch.as_tensor(members, dtype=torch.int64).reshape(-1)
    if index.numel() == 0:
        raise ValueError("a packed micro-batch needs at least one row")
    prompt, response = rows.prompt_tokens.index(index), rows.response_tokens.index(index)
    prompt_lengths, response_lengths = prompt.lengths(), response.lengths()  # (n,)
    if int(prompt_lengths.min()) < 1:
        raise ValueError("packing needs every row to have at least one prompt token (row "
                         f"{int(index[int(prompt_lengths.argmin())])} has none): its first response token is "
                         "scored from the last prompt token")
    lengths = prompt_lengths + response_lengths  # (n,)
    offsets = lengths_to_offsets(lengths)  # (n + 1,)
    total = int(offsets[-1])
    prompt_at = gather_ranges(offsets[:-1], prompt_lengths)  # packed positions of prompt tokens
    response_at = gather_ranges(offsets[:-1] + prompt_lengths, response_lengths)  # ... of response tokens
    input_ids = torch.empty(total, dtype=torch.int64)
    input_ids[prompt_at] = prompt.values.to(torch.int64)
    input_ids[response_at] = response.values.to(torch.int64)
    position_ids = torch.arange(total) - offsets[:-1].repeat_interleave(lengths, output_size=total)

    width = int(response_lengths.max())  # R
    response_span = torch.arange(width)[None, :] < response_lengths[:, None]  # (n, R)
    targets = response.values.to(torch.int64)
    if rows.loss_mask is None:  # every response token carries loss (single-turn rows)
        response_mask, trained_at = response_span, response_at
    else:  # only sampled tokens: the environment's tokens in a trajectory's response get no logits
        trained = rows.loss_mask.index(index).values.bool()
        response_mask = torch.zeros_like(response_span).masked_scatter_(response_span, trained)
        trained_at, targets = response_at[trained], targets[trained]

    def response_layout(column: RaggedTensor) -> torch.Tensor:  # ragged -> (n, R), 0 off the response
        values = column.index(index).values.to(torch.float32)
        return torch.zeros(response_span.shape, dtype=torch.float32).masked_scatter_(response_span, values)

    return PackedMicroBatch(
        rows=index,
        input_ids=input_ids[None],
        position_ids=position_ids[None],
        cu_seq_lens=offsets.to(torch.int32),
        max_length=int(lengths.max()),
        logit_positions=trained_at - 1,
        targets=targets,
        response_mask=response_mask,
        sampler_log_probs=response_layout(rows.response_log_probs),
        advantages=(rows.advantage[index] if rows.token_advantage is None
                    else response_layout(rows.token_advantage)),
        ref_log_probs=response_layout(rows.ref_log_probs) if rows.ref_log_probs is not None else None,
        sample_weight=rows.sample_weight[index] if rows.sample_weight is not None else None,
    )


def plan_rows(rows: RaggedRows, budget: int) -> PackPlan:
    """First-fit-decreasing plan of ``rows`` into sequences of ``budget`` tokens (``learn/packing.py``)."""
    return plan_packs(rows.lengths().tolist(), budget)


def packed_micro_batches(rows: RaggedRows, budget: int) -> list[PackedMicroBatch]:
    """``rows`` cut into packed sequences of at most ``budget`` tokens (a longer row: alone)."""
    return [pack_rows(rows, list(members)) for members in plan_rows(rows, budget).sequences]


# ====================================================================== forward and loss
def packed_response_logprobs(model, packed: PackedMicroBatch, temperature: float = 1.0, *,
                             entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_probs (n, R), entropy (n, R))`` of the response tokens, from one packed forward.

    The values :func:`rlhf_pipeline.learn.loss.response_logprobs` gives at the response columns
    of the padded batch, in the response-aligned layout (0 off the response). The model must run
    the ``rlhf_packed`` attention (``use_packed_attention``) or another that reads
    ``cu_seq_lens_q`` (transformers' flash-attention). ``entropy_grad=False`` computes the
    entropy without a graph (it is then only a metric).
    """
    cu, longest = packed.cu_seq_lens, packed.max_length
    out = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False,
                cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest,
                logits_to_keep=packed.logit_positions)
    logits = out.logits[0].float()  # (N, V): only the positions that score a response token
    if temperature != 1.0:  # (a division by 1 is exact: skipping it saves a pass over N x V)
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    token_logp = logp_all.gather(-1, packed.targets[:, None]).squeeze(-1)  # (N,)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp_all.exp() * logp_all).sum(-1)  # (N,)
    mask = packed.response_mask
    log_probs = token_logp.new_zeros(mask.shape).masked_scatter(mask, token_logp)  # (n, R)
    entropy = entropy.new_zeros(mask.shape).masked_scatter(mask, entropy)  # (n, R)
    return log_probs, entropy


def grpo_packed_loss(model, packed: PackedMicroBatch, *, temperature: float = 1.0, token_count=None,
                     row_feedback: str | None = None, **options) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`rlhf_pipeline.learn.loss.grpo_step_loss` on a packed micro-batch: one packed forward, then
    the same :func:`grpo_loss` on (n, R) response-aligned tensors; same options, same outputs."""
    config = GRPOLossConfig.from_options(options)
    log_probs, entropy = packed_response_logprobs(model, packed, temperature, entropy_grad=config.entropy_coef != 0)
    sampler = packed.sampler_log_probs
    old = log_probs.detach() if config.old_policy == "current" else sampler
    return grpo_loss(
        log_probs, old, packed.advantages, packed.response_mask, config,
        ref_log_probs=packed.ref_log_probs, sampler_log_probs=sampler, entropy=entropy, token_count=token_count,
        row_weights=packed.sample_weight, row_feedback=row_feedback,
    )
