"""Synthetic GRPO data: valid ``TrajectoryBatch`` objects of any size, for benchmarks and tests.

Groups of ``group_size`` completions share a prompt; lengths are uniform in inclusive ranges,
log-probs ``-Exponential(1)``, rewards 0/1, a response at the maximum length is ``truncated``.
Optional fields: group-normalized ``advantage``, ``ref_log_probs`` (sampling log-prob plus noise),
``kl`` (k1) and ``token_rewards`` (``-0.05 * kl``, the reward on the last token). Everything comes
from one generator seeded with ``seed``: equal arguments give equal batches.
Design: docs/schema.md#fields.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from rlhf_pipeline.schema.ragged import RaggedTensor, lengths_to_offsets
from rlhf_pipeline.schema.batch import TrajectoryBatch
from rlhf_pipeline.schema.fields import OPTIONAL_FIELDS
from rlhf_pipeline.schema.termination import TerminationReason
from rlhf_pipeline.schema.tool_errors import ToolErrorKind
from rlhf_pipeline.schema.turn_messages import encode_turn_messages

DEFAULT_VOCAB_SIZE = 32_000
KL_COEF = 0.05


def synthetic_batches(
    n_completions: int,
    *,
    group_size: int = 8,
    prompt_len: tuple[int, int] = (32, 256),
    response_len: tuple[int, int] = (16, 1024),
    batch_size: int = 512,
    seed: int = 0,
    optional_fields: Sequence[str] = (),
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> Iterator[TrajectoryBatch]:
    """Yields batches of ``batch_size`` rows (the last may be shorter) totalling ``n_completions``."""
    _check_args(n_completions, group_size, prompt_len, response_len, batch_size, optional_fields)
    generator = torch.Generator().manual_seed(seed)
    for first_row in range(0, n_completions, batch_size):
        num_rows = min(batch_size, n_completions - first_row)
        yield _make_batch(
            first_row, num_rows, generator,
            group_size=group_size, prompt_len=prompt_len, response_len=response_len,
            optional_fields=tuple(optional_fields), vocab_size=vocab_size,
        )


def synthetic_batch(n_completions: int, **kwargs) -> TrajectoryBatch:
    """All ``n_completions`` rows as one batch (convenience for tests)."""
    kwargs.setdefault("batch_size", n_completions)
    return TrajectoryBatch.cat(list(synthetic_batches(n_completions, **kwargs)))


def batch_with_lengths(
    prompt_lengths: Sequence[int] | torch.Tensor,
    response_lengths: Sequence[int] | torch.Tensor,
    *,
    group_size: int = 8,
    seed: int = 0,
    optional_fields: Sequence[str] = ("advantage",),
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> TrajectoryBatch:
    """One batch whose row i has exactly ``prompt_lengths[i]`` and ``response_lengths[i]`` tokens.

    For length distributions that ``synthetic_batches``' uniform ranges cannot express (the
    learner benchmark's skewed lengths, tests' very uneven rows). Token ids, log-probs, rewards
    and the optional fields are drawn as the module docstring says; each row has its own prompt
    tokens (group ids are ``row // group_size``).
    """
    prompt_lengths = torch.as_tensor(prompt_lengths, dtype=torch.int64).reshape(-1)
    response_lengths = torch.as_tensor(response_lengths, dtype=torch.int64).reshape(-1)
    if prompt_lengths.shape != response_lengths.shape or prompt_lengths.numel() == 0:
        raise ValueError("prompt_lengths and response_lengths must be two non-empty sequences of one length each")
    if int(prompt_lengths.min()) < 0 or int(response_lengths.min()) < 1:
        raise ValueError("prompt lengths must be >= 0 and response lengths >= 1")
    _check_args(len(prompt_lengths), group_size, (1, 1), (1, 1), 1, optional_fields)
    generator = torch.Generator().manual_seed(seed)
    num_rows = prompt_lengths.numel()
    total_response = int(response_lengths.sum())
    response_offsets = lengths_to_offsets(response_lengths)
    prompt_tokens = RaggedTensor.from_lengths(
        torch.randint(0, vocab_size, (int(prompt_lengths.sum()),), generator=generator, dtype=torch.int32),
        prompt_lengths)
    response_tokens = RaggedTensor(
        torch.randint(0, vocab_size, (total_response,), generator=generator, dtype=torch.int32), response_offsets)
    log_probs = -torch.empty(total_response).exponential_(1.0, generator=generator)
    reward = (torch.rand(num_rows, generator=generator) < 0.5).to(torch.float32)
    row_ids = torch.arange(num_rows, dtype=torch.int64)
    group_of_row = row_ids // group_size
    columns = {
        "prompt_tokens": prompt_tokens,
        "response_tokens": response_tokens,
        "response_log_probs": RaggedTensor(log_probs, response_offsets),
        "group_id": group_of_row,
        "trajectory_id": row_ids,
        "step": torch.zeros(num_rows, dtype=torch.int32),
        "reward": reward,
        "done": torch.ones(num_rows, dtype=torch.bool),
        "terminated": torch.ones(num_rows, dtype=torch.bool),
        "truncated": torch.zeros(num_rows, dtype=torch.bool),
        "policy_version": torch.zeros(num_rows, dtype=torch.int64),
        "prompt_text": [f"prompt {i}" for i in range(num_rows)],
        "response_text": [f"response {i}" for i in range(num_rows)],
    }
    if "advantage" in optional_fields:
        columns["advantage"] = _group_advantage(reward, group_of_row, int(group_of_row[-1]) + 1)
    if "step_advantage" in optional_fields:  # single-turn rows: a turn is the whole trajectory
        columns["step_advantage"] = _group_advantage(reward, group_of_row, int(group_of_row[-1]) + 1)
    ref_log_probs = (log_probs + 0.1 * torch.randn(total_response, generator=generator)).clamp_max(0.0)
    if "ref_log_probs" in optional_fields:
        columns["ref_log_probs"] = RaggedTensor(ref_log_probs, response_offsets)
    if "kl" in optional_fields:
        columns["kl"] = RaggedTensor(log_probs - ref_log_probs, response_offsets)
    if "token_rewards" in optional_fields:
        raise ValueError("batch_with_lengths does not draw token_rewards; use synthetic_batches")
    if "termination_reason" in optional_fields:  # every row ended by EOS (none is marked truncated)
        columns["termination_reason"] = torch.full((num_rows,), int(TerminationReason.ENV_DONE), dtype=torch.int32)
    columns.update(_tool_counts(optional_fields, num_rows))
    return TrajectoryBatch(columns)


def raw_payload_bytes(batch: TrajectoryBatch) -> int:
    """Bytes of the data itself: token values, row values and UTF-8 text; no offsets, no padding."""
    total = 0
    for name in batch.field_names:
        column = batch[name]
        if isinstance(column, RaggedTensor):
            total += column.values.numel() * column.values.element_size()
        elif isinstance(column, torch.Tensor):
            total += column.numel() * column.element_size()
        else:
            total += sum(len(text.encode("utf-8")) for text in column)
    return total


# ---------------------------------------------------------------------------- internals
def _check_args(n_completions, group_size, prompt_len, response_len, batch_size, optional_fields) -> None:
    if n_completions < 1:
        raise ValueError(f"n_completions must be >= 1, got {n_completions}")
    if group_size < 1 or batch_size < 1:
        raise ValueError(f"group_size and batch_size must be >= 1, got {group_size} and {batch_size}")
    for name, (low, high) in (("prompt_len", prompt_len), ("response_len", response_len)):
        if not 1 <= low <= high:
            raise ValueError(f"{name} must be (low, high) with 1 <= low <= high, got {(low, high)}")
    unknown = [f for f in optional_fields if f not in OPTIONAL_FIELDS]
    if unknown:
        raise ValueError(f"unknown optional field(s) {unknown}; choose from {list(OPTIONAL_FIELDS)}")


def _make_batch(
    first_row: int,
    num_rows: int,
    generator: torch.Generator,
    *,
    group_size: int,
    prompt_len: tuple[int, int],
    response_len: tuple[int, int],
    optional_fields: tuple[str, ...],
    vocab_size: int,
) -> TrajectoryBatch:
    row_ids = torch.arange(first_row, first_row + num_rows, dtype=torch.int64)
    group_ids = row_ids // group_size
    first_group = int(group_ids[0])
    group_of_row = group_ids - first_group  # (N,) index into this batch's groups
    num_groups = int(group_of_row[-1]) + 1

    # one prompt per group, repeated for each of its completions
    group_prompt_lengths = torch.randint(prompt_len[0], prompt_len[1] + 1, (num_groups,), generator=generator)
    group_prompts = RaggedTensor.from_lengths(
        torch.randint(0, vocab_size, (int(group_prompt_lengths.sum()),), generator=generator, dtype=torch.int32),
        group_prompt_lengths,
    )
    prompt_tokens = group_prompts.index(group_of_row)

    response_lengths = torch.randint(response_len[0], response_len[1] + 1, (num_rows,), generator=generator)
    total_response = int(response_lengths.sum())
    response_offsets = lengths_to_offsets(response_lengths)
    response_tokens = RaggedTensor(
        torch.randint(0, vocab_size, (total_response,), generator=generator, dtype=torch.int32), response_offsets
    )
    log_probs = -torch.empty(total_response).exponential_(1.0, generator=generator)
    reward = (torch.rand(num_rows, generator=generator) < 0.5).to(torch.float32)
    truncated = response_lengths == response_len[1]

    columns = {
        "prompt_tokens": prompt_tokens,
        "response_tokens": response_tokens,
        "response_log_probs": RaggedTensor(log_probs, response_offsets),
        "group_id": group_ids,
        "trajectory_id": row_ids,
        "step": torch.zeros(num_rows, dtype=torch.int32),
        "reward": reward,
        "done": torch.ones(num_rows, dtype=torch.bool),
        "terminated": ~truncated,
        "truncated": truncated,
        "policy_version": group_ids // 64,  # a new policy every 64 groups, like a real run
        "prompt_text": [f"prompt {g}" for g in group_ids.tolist()],
        "response_text": [f"response {r}" for r in row_ids.tolist()],
    }
    if "termination_reason" in optional_fields:  # single-turn rows: ended by EOS or by length
        columns["termination_reason"] = torch.where(
            truncated, int(TerminationReason.GENERATION_LENGTH), int(TerminationReason.ENV_DONE)
        ).to(torch.int32)
    if "advantage" in optional_fields:
        columns["advantage"] = _group_advantage(reward, group_of_row, num_groups)
    if "step_advantage" in optional_fields:  # single-turn rows: a turn is the whole trajectory
        columns["step_advantage"] = _group_advantage(reward, group_of_row, num_groups)
    ref_log_probs = (log_probs + 0.1 * torch.randn(total_response, generator=generator)).clamp_max(0.0)
    kl = log_probs - ref_log_probs
    if "ref_log_probs" in optional_fields:
        columns["ref_log_probs"] = RaggedTensor(ref_log_probs, response_offsets)
    if "kl" in optional_fields:
        columns["kl"] = RaggedTensor(kl, response_offsets)
    if "token_rewards" in optional_fields:
        token_rewards = -KL_COEF * kl
        token_rewards[response_offsets[1:] - 1] += reward  # scalar reward lands on the last token
        columns["token_rewards"] = RaggedTensor(token_rewards, response_offsets)
    columns.update(_tool_counts(optional_fields, num_rows))
    return TrajectoryBatch(columns)


def _tool_counts(optional_fields, num_rows: int) -> dict[str, torch.Tensor]:
    """Agents' per-turn tool counts, from the row index (no draw, so no other field changes):
    0, 1 or 2 calls, one failed on every fourth row that made one."""
    row = torch.arange(num_rows, dtype=torch.int32)
    calls = row % 3
    out = {}
    if "tool_calls" in optional_fields:
        out["tool_calls"] = calls
    failed = (row % 4 == 1) & (calls > 0)
    if "tool_errors" in optional_fields:
        out["tool_errors"] = failed.to(torch.int32)
    if "tool_error_kinds" in optional_fields:
        out["tool_error_kinds"] = torch.where(failed, int(ToolErrorKind.UNKNOWN_TOOL), 0).to(torch.int32)
    if "turn_messages" in optional_fields:
        out["turn_messages"] = [encode_turn_messages([{"role": "user", "content": f"prompt {i}"},
                                                      {"role": "assistant", "content": f"response {i}"}])
                                for i in range(num_rows)]
    return out


def _group_advantage(reward: torch.Tensor, group_of_row: torch.Tensor, num_groups: int) -> torch.Tensor:
    counts = torch.zeros(num_groups).index_add_(0, group_of_row, torch.ones_like(reward))
    mean = torch.zeros(num_groups).index_add_(0, group_of_row, reward) / counts
    centered = reward - mean[group_of_row]
    var = torch.zeros(num_groups).index_add_(0, group_of_row, centered**2) / (counts - 1).clamp_min(1)
    return centered / (var.sqrt()[group_of_row] + 1e-6)
