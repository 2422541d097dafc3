"""Rewards: a registry of verifiable ones (``REWARDS``: ``exact_match``, ``numeric_match``, ``format``,
``length_penalty``), user callables, weighted sums, a reward model (docs/collector.md#rewards).

A reward is any ``fn(prompts, completions, **fields) -> list[float]`` over N strings each, every extra
prompt field (e.g. ``answer``) a keyword holding N values: accept ``**kwargs`` so the fields a reward
does not read pass by. :func:`score` checks each returns N real numbers (text such as ``'1.0'`` is
refused, as an agent's ``StepResult.reward`` is) and sums them with weights; a NaN or infinity is no
error: the collector drops that group. To add one to the registry: a factory taking keyword settings
and returning the reward callable, in ``REWARDS``.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlhf_pipeline.agents.environment import reward_value
from rlhf_pipeline.schema import TrajectoryBatch

RewardFn = Callable[..., Sequence[float]]


class RewardError(ValueError):
    """A reward returned the wrong number of values, or a value that is not a real number."""


# ======================================================================== number extraction
_NUMBER = r"[-+]?(?:\d+(?:,\d{3})*(?:\.\d+)?|\.\d+)"
_BOXED = re.compile(r"\\boxed\{\s*(" + _NUMBER + r")\s*\}")
_HASHES = re.compile(r"####\s*(" + _NUMBER + r")")
_ANY_NUMBER = re.compile(_NUMBER)


def extract_number(text: str) -> float | None:
    """The answer number in ``text``: ``\\boxed{x}``, else ``#### x``, else the last number.

    Thousands separators are removed (``1,234`` -> 1234.0). ``None`` when there is none.
    """
    for pattern in (_BOXED, _HASHES, _ANY_NUMBER):
        if found := pattern.findall(text):
            return float(found[-1].replace(",", ""))
    return None


# ======================================================================== verifiable rewards
def _answers(fields: Mapping[str, Any], name: str) -> Sequence[Any]:
    if "answer" not in fields:
        raise RewardError(
            f"reward {name!r} needs an 'answer' field on every prompt (e.g. {{\"messages\": [...], "
            f"\"answer\": \"42\"}}); the prompts carry {sorted(fields)}"
        )
    return fields["answer"]


def exact_match(prompts: Sequence[str], completions: Sequence[str], **fields) -> list[float]:
    """1.0 when ``completion.strip() == str(answer).strip()``, else 0.0."""
    answers = _answers(fields, "exact_match")
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answers)]


def numeric_match(prompts: Sequence[str], completions: Sequence[str], *, tolerance: float = 1e-6, **fields) -> list[float]:
    """1.0 when :func:`extract_number` of the completion is within ``tolerance`` of ``answer``."""
    answers = _answers(fields, "numeric_match")
    out = []
    for c, a in zip(completions, answers):
        got = extract_number(c)
        want = extract_number(str(a)) if not isinstance(a, (int, float)) else float(a)
        out.append(float(got is not None and want is not None and abs(got - want) <= tolerance))
    return out


def regex_reward(pattern: str, *, full_match: bool = True) -> RewardFn:
    """1.0 for completions matching ``pattern`` (``re.fullmatch`` on the stripped text, or ``re.search``)."""
    compiled = re.compile(pattern, re.DOTALL)

    def format_reward(prompts, completions, **_):
        match = compiled.fullmatch if full_match else compiled.search
        return [float(match(c.strip() if full_match else c) is not None) for c in completions]

    format_reward.__name__ = f"format[{pattern}]"
    return format_reward


def length_penalty(max_chars: int) -> RewardFn:
    """``-max(0, len(completion) - max_chars) / max_chars``: 0 up to the limit, -1 at twice it."""
    if max_chars < 1:
        raise ValueError(f"length_penalty(max_chars=...) must be >= 1, got {max_chars}")

    def penalty(prompts, completions, **_):
        return [-max(0, len(c) - max_chars) / max_chars for c in completions]

    return penalty


REWARDS: dict[str, Callable[..., RewardFn]] = {
    "exact_match": lambda: exact_match,
    "numeric_match": lambda tolerance=1e-6: functools.partial(numeric_match, tolerance=tolerance),
    "format": regex_reward,
    "length_penalty": length_penalty,
}


def get_reward(name: str, **settings) -> RewardFn:
    """A registered reward by name, built with ``settings`` (e.g. ``get_reward("format", pattern=r"\\d+")``)."""
    try:
        factory = REWARDS[name]
    except KeyError:
        raise RewardError(f"unknown reward {name!r}; registered rewards are {sorted(REWARDS)}") from None
    return factory(**settings)


# ======================================================================== reward model
class RewardModelReward:
    """Scores ``prompt + completion`` with a sequence-classification model (one label).

    The text is the rendered prompt followed by the completion; it is tokenized with
    ``tokenizer`` (right-padded internally) and scored in batches of ``batch_size``. The
    reward is the model's single logit. Any ``AutoModelForSequenceClassification`` with
    ``num_labels == 1`` and a ``pad_token_id`` works.
    """

    def __init__(self, model, tokenizer, *, batch_size: int = 32, max_length: int | None = None) -> None:
        if getattr(model.config, "num_labels", None) != 1:
            raise RewardError(
                f"reward model must have num_labels=1 (a scalar score), got {model.config.num_labels}"
            )
        if model.config.pad_token_id is None:
            raise RewardError("reward model config has no pad_token_id; set model.config.pad_token_id")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_length = max_length
        self.__name__ = f"reward_model[{type(model).__name__}]"

    @torch.no_grad()
    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **_) -> list[float]:
        device = next(self.model.parameters()).device
        scores: list[float] = []
        texts = [p + c for p, c in zip(prompts, completions)]
        for start in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(
                texts[start : start + self.batch_size], padding=True, padding_side="right",
                truncation=self.max_length is not None, max_length=self.max_length,
                add_special_tokens=False, return_tensors="pt",
            )
            logits = self.model(input_ids=enc["input_ids"].to(device),
                                attention_mask=enc["attention_mask"].to(device)).logits  # (b, 1)
            scores.extend(logits[:, 0].float().cpu().tolist())
        return scores


# ======================================================================== combining and checking
@dataclass(frozen=True)
class WeightedReward:
    name: str
    fn: RewardFn
    weight: float = 1.0


def as_rewards(rewards: RewardFn | Mapping[str, RewardFn | tuple[RewardFn, float]] | Sequence[WeightedReward]) -> list[WeightedReward]:
    """Normalises a single callable, ``{name: fn}``, ``{name: (fn, weight)}`` or a list of ``WeightedReward``."""
    if callable(rewards):
        return [WeightedReward(getattr(rewards, "__name__", "reward"), rewards, 1.0)]
    if isinstance(rewards, Mapping):
        out = []
        for name, spec in rewards.items():
            fn, weight = spec if isinstance(spec, tuple) else (spec, 1.0)
            if not callable(fn):
                raise RewardError(f"reward {name!r} is not callable (got {type(fn).__name__})")
            out.append(WeightedReward(name, fn, float(weight)))
        return out
    out = list(rewards)
    if not out or not all(isinstance(r, WeightedReward) for r in out):
        raise RewardError("rewards must be a callable, a {name: fn or (fn, weight)} dict, or WeightedReward list")
    return out


def score(
    rewards: Sequence[WeightedReward],
    prompts: Sequence[str],
    completions: Sequence[str],
    fields: Mapping[str, Sequence[Any]] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(total (N,) float32, {name: (N,) float32})``: each reward checked, then the weighted sum.

    Each value must be a real number as the agents' ``StepResult.reward`` must (one check:
    :func:`~rlhf_pipeline.agents.environment.reward_value`): text such as ``'1.0'`` or a bool is
    refused. A NaN or infinite value is no error here: its total is not finite, and the collector
    drops the completion's group (:func:`non_finite_reason` says why), as the agent rollout does."""
    n = len(completions)
    fields = dict(fields or {})
    total = torch.zeros(n, dtype=torch.float32)
    parts: dict[str, torch.Tensor] = {}
    for r in rewards:
        returned = r.fn(list(prompts), list(completions), **fields)
        try:
            values = list(returned)
        except TypeError:
            raise RewardError(f"reward {r.name!r} must return a list of numbers, got {type(returned).__name__}") from None
        if len(values) != n:
            raise RewardError(f"reward {r.name!r} returned {len(values)} values for {n} completions; return one per completion")
        try:
            values = [reward_value(v, f"reward {r.name!r} for completion {i}") for i, v in enumerate(values)]
        except (TypeError, ValueError) as exc:
            raise RewardError(str(exc)) from None
        parts[r.name] = torch.tensor(values, dtype=torch.float32)
        total += r.weight * parts[r.name]
    return total, parts


def drop_non_finite_groups(batch: TrajectoryBatch, parts: Mapping[str, torch.Tensor], group_of_row: torch.Tensor,
                           completions: Sequence[str]) -> tuple[TrajectoryBatch, dict[str, torch.Tensor], list[tuple[int, str]]]:
    """``batch`` (and its reward ``parts``) less every group with a non-finite reward, and each dropped
    group's ``(group_id, why)``. ``group_of_row``: (N,) the group each row belongs to.

    As the agent rollout drops a group whose environment gave a NaN reward: the group's ids stay
    unused and its prompt consumed, so the rows a round writes follow from its prompts and sampling
    RNG alone, and a collector resumed before the round drops the same groups."""
    bad = ~torch.isfinite(batch["reward"])
    if not bool(bad.any()):
        return batch, dict(parts), []
    groups = torch.unique(group_of_row[bad])
    dropped = []
    for group in groups.tolist():
        row = int(torch.nonzero(bad & (group_of_row == group))[0])
        dropped.append((int(batch["group_id"][row]), non_finite_reason(parts, row, completions[row])))
    keep = torch.nonzero(~torch.isin(group_of_row, groups)).flatten()
    return batch.select(keep), {name: values[keep] for name, values in parts.items()}, dropped


def non_finite_reason(parts: Mapping[str, torch.Tensor], row: int, completion: str) -> str:
    """Why row ``row``'s total reward is not finite: the first reward that gave NaN or infinity for it
    (or, every part finite, a weighted sum that overflowed float32)."""
    for name, values in parts.items():
        value = float(values[row])
        if not math.isfinite(value):
            # a finite float beyond float32's range became infinite when stored: say so, not only "inf"
            beyond = "" if math.isnan(value) else " (or a value beyond ±3.4e38, float32's range, in which rewards are stored)"
            return f"reward {name!r} gave {value}{beyond} for completion {completion!r}"
    return f"the weighted sum of the rewards of completion {completion!r} is not finite"


class EpisodeFailureRateError(RuntimeError):
    """More groups were dropped (an episode failed, or a reward was not finite) than
    ``max_failed_group_fraction`` allows; the round that crossed it is written, then the run stops."""


def check_failure_rate(dropped: int, emitted: int, limit: float | None, min_groups: int, last: str | None,
                       over: str) -> None:
    """Raise :class:`EpisodeFailureRateError` once ``dropped`` of ``emitted`` groups is past ``limit``,
    the fraction taken over at least ``min_groups`` groups (so a few drops at the start stop nothing);
    ``over``: what drops a group (the episodes' ``drops_over``), for the message."""
    if limit is None or not dropped or dropped <= limit * max(emitted, min_groups):
        return
    why = f"; the last: {last}" if last else ""
    # before min_groups have run, stopping early says that even the groups still to come cannot bring it back
    counted = (f"counted over at least {min_groups} groups: {dropped} of {min_groups} is past it already"
               if emitted < min_groups else f"counted over at least {min_groups} groups")
    raise EpisodeFailureRateError(
        f"{dropped} of {emitted} groups were dropped over {over}, more than max_failed_group_fraction={limit:g} allows "
        f"({counted}){why}; fix the reward or environment, or raise CollectorConfig.max_failed_group_fraction")
