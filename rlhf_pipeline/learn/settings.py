"""The learner's and the loss's settings: plain dataclasses, importable without torch, that check themselves.

The run's settings hold :class:`LearnerSettings` (``--set learner.lr=1e-4``,
``--set learner.loss.clip_eps_high=0.28``), so loading a pipeline file for ``--list-settings`` or a
bad ``--set`` must not pay for importing torch. Each class refuses a bad value in ``__post_init__``
(every choice is a ``Literal``; ``setting_checks.check_fields``), so one built in Python is checked
as one built from ``--set``. The code that uses them lives in ``learn/learner.py`` and ``learn/loss.py``.
Design: docs/pipelines.md#settings-and-set.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Annotated, Any, ClassVar, Literal

from rlhf_pipeline.setting_checks import Bounds, check_applies, check_fields

Aggregation = Literal["token_mean", "sequence_mean", "constant"]
#: the samplers of learn/samplers/registry.py's SAMPLERS (a test keeps the two equal)
SamplerName = Literal["window", "exact", "groups", "prioritized", "epoch"]
#: priorities of the ``prioritized`` sampler (rlhf_pipeline.storage.prioritized.PRIORITIES)
Priority = Literal["abs_advantage", "group_reward_std", "recency"]
PRIORITY_NAMES = typing.get_args(Priority)
#: learner.keep_best's form: an evaluation summary's name (evaluation/scores.py)
_EVAL_SUMMARY = re.compile(r"^eval/[^/]+/[^/]+$")
#: what the learner feeds back as each trained row's new priority (learn/loss.py, per_row_feedback)
PriorityFeedback = Literal["none", "loss", "ratio_deviation"]


@dataclass(frozen=True)
class GRPOLossConfig:
    """The loss menu; every option is an explicit field (docs/learner.md#which-grpo-variant)."""

    clip_eps_low: Annotated[float, Bounds(ge=0, lt=1)] = 0.2
    """Lower clip: the ratio is clipped at ``1 - clip_eps_low``."""
    clip_eps_high: Annotated[float, Bounds(ge=0)] = 0.2
    """Upper clip: ``1 + clip_eps_high``; 0.28 with 0.2 low is DAPO's clip-higher."""
    aggregation: Aggregation = "token_mean"
    """``token_mean`` | ``sequence_mean`` | ``constant`` (Dr. GRPO, needs ``max_tokens``)."""
    max_tokens: Annotated[int | None, Bounds(ge=1)] = None
    """The constant of ``aggregation="constant"``: the most tokens a learner row can sample, the
    sampler's max_new_tokens for single-turn rows, a trajectory's (max_turns x max_new_tokens) for agents."""
    ratio_level: Literal["token", "sequence"] = "token"
    """``token`` (GRPO) or ``sequence`` (GSPO's length-normalised sequence ratio)."""
    kl_coef: Annotated[float, Bounds(ge=0)] = 0.0
    """Weight of the k3 KL-to-reference term in the loss (needs reference log-probs)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""
    tis_cap: Annotated[float | None, Bounds(gt=0, why=" (none: off)")] = None
    """Truncated importance sampling cap C in ``min(exp(old - sampler), C)``; None disables."""
    old_policy: Literal["sampler", "current"] = "sampler"
    """:func:`grpo_step_loss` only: the old log-probs are the sampler's or the learner's (detached)."""

    def __post_init__(self) -> None:
        check_fields(self, "learner.loss.")
        if self.aggregation == "constant" and self.max_tokens is None:  # its bounds refuse one below 1
            raise ValueError("setting 'learner.loss.aggregation' is 'constant' (Dr. GRPO), which divides by "
                             "'learner.loss.max_tokens': set it too, to the most tokens a row can sample (a single-turn "
                             "pipeline's max_new_tokens), e.g. --set learner.loss.max_tokens=512")
        check_applies(self, "learner.loss.", {"max_tokens": ("aggregation", ("constant",))})

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> GRPOLossConfig:
        """From a dict of keyword options; unknown names raise with the list of valid ones."""
        options = dict(options or {})
        valid = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - valid)
        if unknown:
            raise ValueError(f"unknown GRPO loss option(s) {unknown}; valid options are {sorted(valid)}")
        return cls(**options)


#: every linear layer of a Qwen2 / Llama block; the embeddings and ``lm_head`` stay frozen (vLLM
#: drops an ``lm_head`` adapter's delta from ``prompt_logprobs``, vLLM #51594)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_REFUSED_TARGETS = ("lm_head", "embed_tokens")


@dataclass(frozen=True)
class LoraSettings:
    """LoRA: train a low-rank adapter on a frozen base instead of every weight (``peft``, the
    ``[lora]`` extra; docs/lora.md). The base is the run's initial policy (weights version 0)."""

    rank: int = 0
    """Rank r of each adapter's A (r x in) and B (out x r); 0: full fine-tuning (no adapter)."""
    alpha: Annotated[float, Bounds(gt=0, why=" (the update is scaled by alpha / rank)")] = 16.0
    """The adapter's update is scaled by alpha / rank (peft's lora_alpha)."""
    dropout: Annotated[float, Bounds(ge=0, lt=1)] = 0.0
    """Dropout on each adapter's input while training (peft's lora_dropout), in [0, 1)."""
    target_modules: tuple[str, ...] = LORA_TARGETS
    """Names of the linear layers that get an adapter (each layer whose name ends with one of these)."""

    def __post_init__(self) -> None:
        check_fields(self, "learner.lora.")

        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"setting 'learner.lora.{name}' {why}")

        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise bad("rank", f"must be an integer >= 0 (0: full fine-tuning), got {self.rank!r}")
        targets = tuple(self.target_modules)
        if not targets or not all(isinstance(name, str) and name.strip() for name in targets):
            raise bad("target_modules", f"must name at least one linear layer, e.g. q_proj,v_proj; got {targets!r}")
        if not self.enabled:  # full fine-tuning: no adapter for these to shape
            given = [f.name for f in fields(self) if f.name != "rank" and getattr(self, f.name) != f.default]
            if given:
                raise bad(given[0], "is for a LoRA run (learner.lora.rank > 0); this run trains every weight "
                                    "(learner.lora.rank=0): drop it, or set learner.lora.rank, e.g. 8")
        refused = [name for name in targets if name in LORA_REFUSED_TARGETS]
        if refused:
            raise bad("target_modules", f"names {refused}: the embeddings and lm_head stay frozen (an lm_head delta "
                                        f"is dropped from vLLM's prompt_logprobs, vLLM #51594); target the "
                                        f"block's linear layers, e.g. {','.join(LORA_TARGETS)}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass
class LearnerSettings:
    """How the learner samples, optimizes, publishes and checkpoints."""

    batch_size: Annotated[int, Bounds(ge=1)] = 64
    """Rows (completions) per optimizer step. Multi-turn rows are turns: the drawn rows that end a
    trajectory bring its earlier turns, the others wait for it (learn/trajectories.py)."""
    sampler: SamplerName = "window"
    """How each step picks its rows (learn/samplers/ lists them): window = uniformly from the
    newest sample_window rows, once new_rows_per_step new rows arrived; exact = every fresh row
    in exactly uses_per_row steps, in the order written (no row left out or drawn twice);
    groups = whole groups from that window (see replace_zero_variance); prioritized = rows of the whole buffer by priority,
    the loss weighted by importance weights (see priority); epoch = every row of a recorded buffer
    once per epoch (what `rlhf-pipeline replay` uses)."""
    sample_window: int = 128
    """Each step samples from the newest this-many rows of the buffer (>= batch_size)."""
    epoch_order: Literal["shuffle", "sequential", "with-replacement"] = "shuffle"
    """sampler=epoch (replay): shuffle = reshuffled every epoch, unit window by unit window;
    sequential = store order; with-replacement = uniform draws."""
    epoch_rows: Annotated[int | None, Bounds(ge=1)] = None
    """sampler=epoch: replay positions [0, epoch_rows) of the buffer (None: every row it holds when
    the learner starts). `replay` sets it to the rows it counted, so a resume walks the same rows."""
    shuffle_window_rows: Annotated[int, Bounds(ge=0)] = 65_536
    """sampler=epoch, epoch_order=shuffle: rows are shuffled within windows of whole storage units
    holding at least this many rows (0: the whole buffer). Keep a window's decoded units within a
    Zarr store's cache_bytes."""
    uses_per_row: Annotated[int, Bounds(ge=1)] = 1
    """sampler=exact: every fresh row is trained on by exactly this many consecutive steps (1:
    on-policy GRPO with one step of overlap); new rows per step are then batch_size / this."""
    micro_batch_tokens: Annotated[int, Bounds(ge=1)] = 8192
    """Tokens per forward/backward; gradients accumulate. Packed: the real tokens of one packed
    sequence (a longer row gets one of its own); padded: rows x longest prompt+response."""
    packing: bool = True
    """Micro-batches are packed sequences: rows laid end to end, each attending only to itself, the
    logits computed only where they score a response token (learn/loss.py), so a step costs
    the tokens it trains. false: each micro-batch is padded to its longest row (learn/batch.py).
    Same loss and gradients either way (to float rounding)."""
    turn_advantage: Literal["trajectory", "turn", "mixed"] = "trajectory"
    """Multi-turn rows (learn/trajectories.py): trajectory = the trajectory's advantage (its group-relative
    return) on every sampled token of it; turn = each turn's own advantage (step_advantage where stored,
    else the row's advantage) on that turn's tokens; mixed = (1 - turn_advantage_weight) * trajectory
    + turn_advantage_weight * turn (needs step_advantage stored: GroupAdvantage(step_advantage=True))."""
    turn_advantage_weight: float = 0.5
    """turn_advantage=mixed: the turn's share, in [0, 1] (0 trains as trajectory, 1 as turn)."""
    mask_termination_reasons: tuple[str, ...] = ()
    """Trajectories that ended for one of these reasons (schema/termination.py names, e.g.
    max_turns,token_budget) are left out of the loss, counted as charts/trajectories_masked."""
    lr: Annotated[float, Bounds(gt=0)] = 1e-4
    """Peak AdamW learning rate."""
    weight_decay: Annotated[float, Bounds(ge=0)] = 0.0
    """AdamW weight decay."""
    adam_betas: Annotated[tuple[float, float], Bounds(ge=0, lt=1, why=" (each of the two)")] = (0.9, 0.99)
    """AdamW betas: the decay of its first and second moment estimates, each in [0, 1)."""
    warmup_steps: Annotated[int, Bounds(ge=0)] = 0
    """Linear LR warm-up from 0 over this many steps."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After warm-up: keep the peak LR, or decay it with a cosine to min_lr_ratio * lr at the last step."""
    min_lr_ratio: Annotated[float, Bounds(ge=0, le=1)] = 0.1
    """Final LR of the cosine schedule as a fraction of lr."""
    max_grad_norm: Annotated[float, Bounds(ge=0, why=" (0: no clipping)")] = 1.0
    """Gradient-norm clip (0 disables clipping; the norm is still reported)."""
    new_rows_per_step: Annotated[int, Bounds(ge=0)] = 0
    """Each step waits until the collector has written this many new rows since the previous
    step (an update-to-data ratio: rows are reused ~batch_size / this times). 0 never waits."""
    max_staleness: Annotated[int | None, Bounds(ge=0)] = field(default=None, metadata={"derived_from": "max_lag"})
    """Rows sampled by a policy more than this many versions older than the learner's are not
    used (None: no bound). Set from the run's ``max_lag`` and this sampler's reuses
    (``run_settings.max_staleness``), never on its own."""
    publish_every: Annotated[int, Bounds(ge=1)] = 1
    """Publish the weights as a new version every this many steps."""
    checkpoint_every: Annotated[int, Bounds(ge=1)] = 50
    """Save a checkpoint every this many steps (and always at the end or on stop)."""
    keep_checkpoints: Annotated[int, Bounds(ge=1)] = 2
    """Checkpoints kept on disk (newest first)."""
    checkpoint_keep_every: Annotated[int, Bounds(ge=0, why=" (0 keeps only the newest keep_checkpoints)")] = 0
    """Also save and keep a checkpoint at every step that is a multiple of this (0: none beyond the
    newest keep_checkpoints): the steps `rlhf-pipeline branch` can start a new run from."""
    keep_best: str | None = None
    """Also keep the best checkpoint by an evaluation summary, eval/<set>/<metric> such as
    eval/held_out/pass@1 (needs eval.every_steps; none: off): a checkpoint is saved at every step whose
    version the evaluator scores, and the best-scoring one is never pruned (docs/evaluation.md)."""
    prefetch_depth: Annotated[int, Bounds(ge=1)] = 2
    """Batches prepared ahead by the background thread."""
    data_timeout_s: Annotated[float, Bounds(gt=0, why=" seconds")] = 600.0
    """Give up when no usable batch could be sampled for this long (no collector running?); with
    generation.engine=vllm the run adds generation.start_timeout_s, the engine's start-up allowance."""
    wait_report_s: Annotated[float, Bounds(gt=0, why=" seconds")] = 60.0
    """Say in one line what the learner waits for once it has waited this long for a batch (and
    again each time the wait doubles)."""
    log_every: Annotated[int, Bounds(ge=1)] = 10
    """Print a progress line every this many steps when stderr is not a terminal."""
    loss: GRPOLossConfig = field(default_factory=GRPOLossConfig)
    """GRPO loss options: clip range, aggregation, KL/entropy coefficients, TIS (learn/loss.py)."""
    lora: LoraSettings = field(default_factory=LoraSettings)
    """LoRA adapter training (--set learner.lora.rank=8; rank 0: full fine-tuning; docs/lora.md)."""
    temperature: Annotated[float, Bounds(gt=0)] = field(default=1.0, metadata={"derived_from": "temperature"})
    """The run's sampling temperature, at which log-probs are recomputed: set from the run's
    ``temperature`` (``RunSettings.learner_settings``), never on its own."""
    replace_zero_variance: bool = False
    """sampler=groups: replace each group whose rewards are all equal (no GRPO signal) by an
    informative group kept from earlier steps (charts/groups_replaced counts them)."""
    replay_pool_groups: Annotated[int, Bounds(ge=1)] = 64
    """sampler=groups: informative groups kept for replacement (those of highest reward std)."""
    priority: Priority = "abs_advantage"
    """sampler=prioritized: abs_advantage | group_reward_std | recency (halves every 10 versions)."""
    priority_alpha: Annotated[float, Bounds(ge=0)] = 0.6
    """sampler=prioritized: rows are drawn with probability proportional to priority^alpha (0: uniform)."""
    priority_beta: Annotated[float, Bounds(ge=0)] = 0.4
    """sampler=prioritized: importance-weight exponent; 1 fully corrects the sampling bias."""
    priority_feedback: PriorityFeedback = "none"
    """sampler=prioritized: after each step the learner sets the priority of the rows it trained on
    (prioritized experience replay): none = priorities stay those of `priority`; loss = the row's
    mean |per-token policy loss|; ratio_deviation = the row's mean |ratio - 1| (how far the policy
    moved on it). Draw d then sees the feedback of every step up to draw d - 2."""
    world_size: Annotated[int, Bounds(ge=1)] = 1
    """Data-parallel learner ranks (learn/distributed.py) that `run` and `replay` start, or learner
    actors under `--ray`."""
    parallelism: Literal["ddp", "fsdp"] = "ddp"
    """With several ranks: ddp = every rank holds the whole model (DistributedDataParallel);
    fsdp = parameters, gradients and optimizer state sharded over the ranks (FSDP2 fully_shard
    on each transformer block and the root), for models that do not fit one device."""

    # settings read only where another has one of some values: set otherwise, nothing would read them
    APPLY_WHERE: ClassVar[dict[str, tuple[str, tuple[Any, ...]]]] = {
        "uses_per_row": ("sampler", ("exact",)),
        "epoch_order": ("sampler", ("epoch",)),
        "epoch_rows": ("sampler", ("epoch",)),
        "replay_pool_groups": ("replace_zero_variance", (True,)),
        "priority": ("sampler", ("prioritized",)),
        "priority_alpha": ("sampler", ("prioritized",)),
        "priority_beta": ("sampler", ("prioritized",)),
        "min_lr_ratio": ("lr_schedule", ("cosine",)),
        "turn_advantage_weight": ("turn_advantage", ("mixed",)),
    }

    def __post_init__(self) -> None:
        check_fields(self, "learner.")  # each choice, number and bound

        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"setting 'learner.{name}' {why}")

        if self.sampler == "epoch" and self.max_staleness is not None:
            # an epoch walks recorded rows of old policies: every batch would be dropped as stale,
            # and the sampler would serve the same rows again, forever
            raise bad("max_staleness", f"must be None with sampler=epoch, which replays recorded rows (got "
                                       f"{self.max_staleness}); a run derives it so: pass max_staleness=None")
        if self.sample_window < self.batch_size:
            raise bad("sample_window", f"({self.sample_window}) must be >= batch_size ({self.batch_size})")
        if self.keep_best is not None and not _EVAL_SUMMARY.match(str(self.keep_best)):
            raise bad("keep_best", f"must name an evaluation summary, eval/<set>/<metric> such as "
                                   f"eval/held_out/pass@1 (none: off), got {self.keep_best!r}")
        if self.replace_zero_variance and self.sampler != "groups":
            raise bad("replace_zero_variance", f"needs sampler='groups', which draws whole groups (got "
                                               f"sampler={self.sampler!r})")
        if self.priority_feedback != "none":
            if self.sampler != "prioritized":
                raise bad("priority_feedback", f"needs sampler='prioritized', which keeps priorities "
                                               f"(got sampler={self.sampler!r})")
            if self.priority == "recency":
                raise bad("priority_feedback", "needs priority='abs_advantage' or 'group_reward_std': "
                                               "'recency' is derived from stored versions and takes no updates")
            if self.priority_feedback == "ratio_deviation" and self.loss.old_policy == "current":
                raise bad("priority_feedback", "'ratio_deviation' is always 0 with loss.old_policy='current' "
                                               "(the ratio is 1 by construction); use 'loss'")
        if isinstance(self.turn_advantage_weight, bool) or not isinstance(self.turn_advantage_weight, (int, float)) \
                or not 0.0 <= self.turn_advantage_weight <= 1.0:
            raise bad("turn_advantage_weight", f"must be a number in [0, 1], the turn's share of turn_advantage=mixed "
                                               f"(got {self.turn_advantage_weight!r})")
        from rlhf_pipeline.schema.termination import TerminationReason

        reasons = {r.name.lower() for r in TerminationReason if r is not TerminationReason.NOT_ENDED}
        unknown = [name for name in self.mask_termination_reasons if str(name).lower() not in reasons]
        if unknown:
            raise bad("mask_termination_reasons", f"names unknown reason(s) {unknown}; valid: {sorted(reasons)}")
        check_applies(self, "learner.", self.APPLY_WHERE)
        if self.lora.enabled and self.world_size > 1 and self.parallelism == "fsdp":
            # the adapter is a few MB: every rank holds it whole, and its base frozen, under DDP
            raise bad("parallelism", "'fsdp' shards full fine-tuning; with learner.lora.rank > 0 each rank holds "
                                     "the adapter and its frozen base whole: set learner.parallelism=ddp")
