"""Default pipeline: GRPO on a toy addition task with a tiny model, on CPU, in minutes.

    rlhf-pipeline run pipelines/default.py                  # 15-45 s on 2 idle CPU cores
    rlhf-pipeline run pipelines/default.py --steps 20 --set group_size=4
    rlhf-pipeline run pipelines/default.py --set generation.engine=vllm --set num_heads=2   # vLLM generates
    rlhf-pipeline run pipelines/default.py --set generation.url=http://127.0.0.1:8000 --set num_heads=2
                                                            # a vLLM server you started (docs/generation.md)

What it wires, top to bottom:

1. model   a tiny Qwen2 (or Llama) causal LM built from a config, with the offline
           character tokenizer; a short supervised warm start teaches it the answer
           format (digits then <|end|>), so sampled groups have reward variance;
2. task    ``a+b=`` prompts (a, b < max_operand) and a verifiable reward with partial
           credit for right digits (``rlhf_pipeline.collect.toy_task``);
3. write   the GRPO group advantage (normalized by the group's std), computed before rows land;
4. collect a ``Collector`` of ``prompts_per_round`` prompts a round, each a group of single-turn
           episodes (``SingleTurn``), over the engine the run's
           ``generation`` settings name (our loop; vLLM, whose CPU attention needs a head size of
           32 or more, so ``num_heads=2`` with the default width; or a server at ``generation.url``).

The run's settings (``RunSettings``: buffer, learner, generation, retention, pacing, Ray) and what
is derived from them are the framework's; ``--list-settings`` shows them all.

Copy this file to start a new pipeline; pipelines do not inherit from each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from rlhf_pipeline.learn.settings import LearnerSettings
from rlhf_pipeline.pipeline import Pipeline, RunPaths, preflight_rewards
from rlhf_pipeline.run_settings import RunSettings
from rlhf_pipeline.setting_checks import Bounds


@dataclass
class Settings(RunSettings):
    """The task's settings; the run's (steps, device, seed, group_size, temperature, buffer, learner,
    generation, retention, ray...) come from RunSettings, with this task's learner defaults below."""

    # ---- model
    arch: Literal["qwen2", "llama"] = "qwen2"
    """Architecture of the tiny model built from a config."""
    hidden_size: Annotated[int, Bounds(ge=1)] = 64
    """Width of the tiny model."""
    num_layers: Annotated[int, Bounds(ge=1)] = 2
    """Transformer layers of the tiny model."""
    num_heads: Annotated[int, Bounds(ge=1)] = 4
    """Attention heads of the tiny model."""
    warm_start_steps: Annotated[int, Bounds(ge=0, why=" (0 skips the warm start)")] = 200
    """Supervised steps on correct examples before RL (0 skips the warm start)."""
    warm_start_lr: Annotated[float, Bounds(gt=0)] = 3e-3
    """Learning rate of the warm start."""

    # ---- task
    num_prompts: Annotated[int, Bounds(ge=1)] = 4096
    """Distinct training prompts (a+b=); the collector cycles over them, reshuffled per epoch."""
    max_operand: Annotated[int, Bounds(ge=1)] = 20
    """Operands are drawn from [0, max_operand); a tenth of the sums is held out for evaluation (none below 4)."""
    prompts_per_round: Annotated[int, Bounds(ge=1)] = 8
    """Prompts per collection round; a round writes prompts_per_round * group_size rows."""
    max_new_tokens: Annotated[int, Bounds(ge=1)] = 6
    """Longest sampled answer, in characters (the tokenizer is character-level)."""

    learner: LearnerSettings = field(default_factory=lambda: LearnerSettings(
        batch_size=64, sampler="exact", uses_per_row=1, sample_window=128, new_rows_per_step=64,
        micro_batch_tokens=4096, lr=3e-4, warmup_steps=5, publish_every=1,
        checkpoint_every=50, log_every=20,
    ))
    """Learner settings (--set learner.lr=3e-4, --list-settings shows them all)."""

    def validate(self) -> None:
        head_size, left = divmod(self.hidden_size, self.num_heads)
        if left or head_size % 2:  # rotary position embeddings turn pairs of a head's dimensions
            raise ValueError(f"settings 'hidden_size' ({self.hidden_size}) and 'num_heads' ({self.num_heads}) must "
                             f"give heads of one even size, got {self.hidden_size / self.num_heads:g}: e.g. "
                             f"num_heads=2 with a hidden_size that is a multiple of 4")
        if self.eval.every_steps and self.max_operand ** 2 < HELD_OUT_SHARE:
            raise ValueError(f"setting 'max_operand' ({self.max_operand}) gives {self.max_operand ** 2} sums, too few to "
                             f"hold a tenth of them out for eval.every_steps: raise max_operand to 4 or more, or "
                             f"leave eval.every_steps at 0")

    def model_head_size(self) -> tuple[int, str]:
        return (self.hidden_size // self.num_heads,
                f" (hidden_size {self.hidden_size} / num_heads {self.num_heads}): add --set num_heads=2")


def build(settings: Settings, run: RunPaths) -> Pipeline:
    # imports here: loading the file for --list-settings or a bad --set stays fast. The write
    # path's (torchrl, ~1 s) are in the factories that use them: the learner, which builds this
    # too and warm-starts right after, never needs them
    from rlhf_pipeline.collect.toy_task import toy_reward, warm_start
    from rlhf_pipeline.models import char_tokenizer, tiny_causal_lm

    tokenizer = char_tokenizer()
    held_out = held_out_prompts(settings)
    prompts = training_prompts(settings, held_out)
    rewards = {"toy": toy_reward}

    # ---------------------------------------------------------------- model
    def make_model():
        return tiny_causal_lm(
            len(tokenizer), arch=settings.arch, hidden_size=settings.hidden_size,
            num_layers=settings.num_layers, num_heads=settings.num_heads,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, seed=settings.seed,
        )

    def make_policy():
        model = make_model()
        if settings.warm_start_steps:
            result = warm_start(model, tokenizer, settings.warm_start_steps, lr=settings.warm_start_lr,
                                seed=settings.seed, max_operand=settings.max_operand,
                                held_out={p.prompt_id for p in held_out})
            print(f"[run] warm start: {settings.warm_start_steps} steps, loss {result['loss']:.3f}, "
                  f"{result['seconds']:.1f}s", flush=True)
        return model

    # ---------------------------------------------------------------- write path
    def make_write_path(store):
        from rlhf_pipeline.transforms.group_advantage import GroupAdvantage

        return [GroupAdvantage(settings.group_size)]

    # ---------------------------------------------------------------- collector
    def collector(engine, sink, store, collector_index: int):
        from rlhf_pipeline.collect import Collector, CollectorConfig, PromptSource, SamplingConfig, SingleTurn

        config = CollectorConfig(
            tasks_per_round=settings.prompts_per_round, group_size=settings.group_size,
            sampling=SamplingConfig(max_new_tokens=settings.max_new_tokens, temperature=settings.temperature),
            seed=settings.seed, collector_index=collector_index,
        )
        # each collector (one buffer shard each) walks the prompts in its own order
        source = PromptSource(prompts, seed=settings.seed + 1_000_003 * collector_index, required_fields=("answer",))
        return Collector(engine, tokenizer, source, SingleTurn(rewards), sink=sink, config=config)

    return Pipeline(
        settings=settings,
        make_policy=make_policy,
        make_model=make_model,
        tokenizer=tokenizer,
        make_write_path=make_write_path,
        collector=collector,
        preflight=lambda: preflight_rewards(rewards, prompts[:1], settings.group_size),
        eval_sets=lambda: eval_sets(settings, held_out),
    )


# ---------------------------------------------------------------- held-out set
HELD_OUT_SHARE = 10
"""One sum a+b in this many is held out: never a training prompt, evaluated with eval.* settings."""


def held_out_prompts(settings: Settings) -> list:
    """Every tenth of the ``max_operand ** 2`` sums, chosen by a fixed shuffle (the same for every seed,
    so runs of different seeds are evaluated on one set), in a fixed order."""
    import random

    from rlhf_pipeline.collect.prompts import PromptRecord

    pairs = [(a, b) for a in range(settings.max_operand) for b in range(settings.max_operand)]
    random.Random(20_261_126).shuffle(pairs)
    return [PromptRecord(messages=({"role": "user", "content": f"{a}+{b}="},), fields={"answer": str(a + b)},
                         prompt_id=f"add-{a}-{b}") for a, b in pairs[:len(pairs) // HELD_OUT_SHARE]]


def training_prompts(settings: Settings, held_out: list) -> list:
    """``num_prompts`` prompts drawn as ``toy_prompts`` draws them, less the held-out sums."""
    from rlhf_pipeline.collect.toy_task import toy_prompts

    kept = {p.prompt_id for p in held_out}
    drawn = toy_prompts(2 * settings.num_prompts, settings.seed, max_operand=settings.max_operand)
    return [p for p in drawn if p.prompt_id not in kept][:settings.num_prompts]


def eval_sets(settings: Settings, held_out: list) -> list:
    """The held-out sums, scored by the training reward; a completion passes on the exact answer (1.0)."""
    from rlhf_pipeline.collect.toy_task import toy_reward
    from rlhf_pipeline.evaluation.sets import EvalSet

    if not held_out:  # max_operand below 4: too few sums to hold any out
        return []
    return [EvalSet("held_out", prompts=held_out, score=toy_reward, max_new_tokens=settings.max_new_tokens)]
