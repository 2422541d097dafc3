"""Tool-use pipeline: GRPO on multi-turn calculator episodes with a tiny model, on CPU, in minutes.

    rlhf-pipeline run pipelines/tool_use.py       # 55 s on 2 idle cores, 90-280 s at load 5-11: mostly warm start
    rlhf-pipeline run pipelines/tool_use.py --steps 10 --set warm_start_steps=150 --set warm_start_more_stages=0
                                                  # a short warm start, too short: the check after it warns
    rlhf-pipeline run pipelines/tool_use.py --set generation.engine=vllm     # vLLM samples the turns

What it wires, top to bottom:

1. model   a tiny Qwen2 built from a config, with the character tokenizer extended for tools
           (``models.char_tool_tokenizer``: a ``<|tool|>`` role, ``<tool_call>`` tokens, a short
           append-only template); a supervised warm start on demonstration episodes, 90% calling
           the tool and 10% guessing, 600 steps on a decaying rate, for the model to learn to copy
           the factors into its call and the tool's answer into its reply, so calls pay and RL has
           a choice to reinforce. Copying is learned abruptly, on some seeds and machines not in
           600 steps, so greedy episodes on 64 tasks of their own check it, and stages of 300 steps
           more run while fewer than 90% of the calls carry the factors (``warm_start_policy``);
2. task    products of two 2-digit numbers, which the model cannot do in its head, and the
           ``multiply`` tool (``rlhf_pipeline.agents.calculator``): an episode is the model's turns,
           each either Hermes-style tool calls (answered by the tool) or a final answer (reward);
3. collect a ``Collector`` over ``Environments``: ``group_size`` episodes per task run to their
           ends, each episode's next turn asked as soon as its environment answered; each group of
           whole trajectories goes through the write path once it and every group before it ended
           (one row per model turn, ``step`` = turn index);
4. buffer  a memmap buffer per collector; the write path's group advantage sums each trajectory's
           turn rewards into its return and writes the group-relative advantage on every turn;
5. learner GRPO with the settings in ``learner``: each trajectory trains as one sequence (its
           turns joined, the loss on the model's sampled tokens only, every turn in the context it
           was sampled in), ``batch_size`` rows (turns) a step.

Copy this file to start a new pipeline; pipelines do not inherit from each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from rlhf_pipeline.evaluation.settings import EvalSettings
from rlhf_pipeline.learn.settings import LearnerSettings
from rlhf_pipeline.pipeline import Pipeline, PipelineError, RunPaths
from rlhf_pipeline.run_settings import RunSettings
from rlhf_pipeline.setting_checks import Bounds


@dataclass
class Settings(RunSettings):
    """The task's settings; the run's (steps, device, seed, group_size, temperature, buffer, learner,
    generation, retention, ray...) come from RunSettings, with this task's defaults below."""


    steps: int = 30
    """Learner steps (optimizer updates); --steps sets it."""
    group_size: int = 4
    """Episodes per task (GRPO's G)."""

    # ---- model
    hidden_size: Annotated[int, Bounds(ge=1)] = 64
    """Width of the tiny model."""
    num_layers: Annotated[int, Bounds(ge=1)] = 2
    """Transformer layers of the tiny model."""
    num_heads: Annotated[int, Bounds(ge=1)] = 2
    """Attention heads of the tiny model (2: a head size of 32, which vLLM's CPU attention takes)."""
    warm_start_steps: Annotated[int, Bounds(ge=0, why=" (0 skips the warm start)")] = 600
    """Supervised steps on demonstration episodes before RL (0 skips the warm start); fewer than
    about 300 teach only the format, not copying the factors into the call."""
    warm_start_lr: Annotated[float, Bounds(gt=0)] = 1e-2
    """Peak learning rate of the warm start (linear warm-up over its first tenth, then a cosine down
    to a tenth of it; gradients clipped to norm 1)."""
    warm_start_target: Annotated[float, Bounds(ge=0, le=1)] = 0.9
    """Share of greedy check episodes whose call has the question's factors that ends the warm start;
    below it, another stage of warm_start_steps / 2 runs (up to warm_start_more_stages)."""
    warm_start_more_stages: Annotated[int, Bounds(ge=0)] = 2
    """Stages of warm_start_steps / 2 more steps the warm start may add while the check is below
    warm_start_target (0: one stage, whatever the check says; without the check, one stage)."""
    warm_start_tool_fraction: Annotated[float, Bounds(ge=0, le=1)] = 0.9
    """Share of demonstrations that call the tool; the rest answer with a guess."""
    warm_start_copy_weight: Annotated[float, Bounds(gt=0)] = 5.0
    """Weight in the warm start's loss of the digits a demonstration copies (the factors into its
    call, the tool's answer into its reply), the other tokens of the model's turns weighing 1. At 1,
    once the held-out products left the demonstrations, seed 0 copied the factors but not the tool's
    answer (3 of 64 exact answers after 900 steps); at 5 seeds 0-2 copy both within 600 steps
    (docs/evaluation.md)."""
    warm_start_check_tasks: Annotated[int, Bounds(ge=0, why=" (0: none)")] = 64
    """Greedy episodes on tasks of their own after the warm start, to print what it reached (0: none)."""
    init_weights: str = ""
    """A state dict saved with torch.save to start from instead of the warm start (empty: warm start).
    ``bench tool-use`` gives this run and TRL's trainer the same warm-started weights this way."""

    # ---- task
    num_tasks: Annotated[int, Bounds(ge=1)] = 4096
    """Distinct training tasks (a * b); the collector cycles over them, reshuffled per epoch."""
    low: Annotated[int, Bounds(ge=1)] = 10
    """Smallest factor."""
    high: int = 99
    """Largest factor."""
    partial_credit: bool = True
    """Reward a wrong final answer by its right digits (0.5 * right-aligned matching digits / length),
    so a tiny model's near misses still rank within a group; false: 1 for the product, else 0."""
    tasks_per_round: Annotated[int, Bounds(ge=1)] = 4
    """Tasks per collection round; a round writes tasks_per_round groups."""
    max_turns: Annotated[int, Bounds(ge=1)] = 3
    """Model turns per episode at most."""
    max_new_tokens: Annotated[int, Bounds(ge=1)] = 64
    """Tokens per model turn at most (characters: a tool call is about 50)."""
    context_length: int = 384
    """Tokens of a whole episode at most (the tiny model's positions)."""
    max_tool_errors: Annotated[int, Bounds(ge=1)] = 2
    """Failed tool calls that end an episode (TOOL_ERROR)."""
    max_failed_group_fraction: Annotated[float | None, Bounds(ge=0, le=1)] = 0.1
    """An episode whose environment raises, or whose reward is not finite, drops its group; past this
    fraction of the groups run (over at least 32) the collector stops the run (none: never)."""
    log_rounds_every: Annotated[int, Bounds(ge=0, why=" (0: never)")] = 5
    """The collector prints a line of its round metrics every this many rounds, with the first failed
    tool call of each kind since the line before (0: never; a round whose every call failed is
    still reported)."""

    learner: LearnerSettings = field(default_factory=lambda: LearnerSettings(
        batch_size=32, sampler="exact", uses_per_row=1, sample_window=64, new_rows_per_step=32,
        micro_batch_tokens=4096, lr=3e-4, warmup_steps=3, publish_every=1,
        checkpoint_every=25, log_every=5,
    ))
    """Learner settings (--set learner.lr=1e-4, --list-settings shows them all). lr 3e-4: at 1e-3, on
    seeds 0-2 the warm-started model lost reward over the 30 steps (docs/pipelines.md)."""
    eval: EvalSettings = field(default_factory=lambda: EvalSettings(samples=4, temperature=1.0))
    """Evaluation of the held-out products (--set eval.every_steps=50): 4 episodes per task sampled at
    the training temperature, where GRPO moves the policy. Greedy (eval.temperature=0 eval.samples=1)
    left no room: the warm start already answers 86-91% of them greedily, the misses are digits of
    the tool's answer miscopied, and 150 steps did not change them (docs/evaluation.md)."""

    def validate(self) -> None:
        if self.low > self.high:
            raise ValueError(f"settings 'low' and 'high' must satisfy 1 <= low <= high, got {self.low}, {self.high}")
        head_size, left = divmod(self.hidden_size, self.num_heads)
        if left or head_size % 2:  # rotary position embeddings turn pairs of a head's dimensions
            raise ValueError(f"settings 'hidden_size' ({self.hidden_size}) and 'num_heads' ({self.num_heads}) must "
                             f"give heads of one even size, got {self.hidden_size / self.num_heads:g}: e.g. "
                             f"num_heads=2 with a hidden_size that is a multiple of 4")
        if self.max_new_tokens + 64 > self.context_length:
            raise ValueError(f"setting 'context_length' ({self.context_length}) leaves no room for the opening "
                             f"prompt and a turn of max_new_tokens ({self.max_new_tokens})")

    def model_head_size(self) -> tuple[int, str]:
        return (self.hidden_size // self.num_heads,
                f" (hidden_size {self.hidden_size} / num_heads {self.num_heads}): add --set num_heads=2")


def check(settings: Settings) -> None:
    """What the settings point at: ``run`` calls this before it starts any process."""
    if settings.init_weights and not Path(settings.init_weights).is_file():
        raise ValueError(f"setting 'init_weights': {settings.init_weights!r} is not a file")


def build(settings: Settings, run: RunPaths) -> Pipeline:
    # imports here: loading the file for --list-settings or a bad --set stays fast
    from rlhf_pipeline.agents.calculator import CalculatorEnv
    from rlhf_pipeline.agents.episode import AGENT_ROW_FIELDS
    from rlhf_pipeline.models import char_tool_tokenizer, tiny_causal_lm
    from rlhf_pipeline.models.loading import ModelLoadError, load_state_dict_file

    tokenizer = char_tool_tokenizer()
    held_out = held_out_tasks(settings)
    tasks = training_tasks(settings, held_out)

    # ---------------------------------------------------------------- model
    def make_model():
        return tiny_causal_lm(
            len(tokenizer), hidden_size=settings.hidden_size, num_layers=settings.num_layers,
            num_heads=settings.num_heads, max_position_embeddings=settings.context_length,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, seed=settings.seed,
        )

    def make_policy():
        model = make_model()
        if settings.init_weights:
            try:
                load_state_dict_file(model, settings.init_weights, "setting 'init_weights'")
            except ModelLoadError as exc:
                raise PipelineError(str(exc)) from None
            print(f"[run] initial weights from {settings.init_weights} (no warm start)", flush=True)
        elif settings.warm_start_steps:
            warm_start_policy(model, tokenizer, settings, held_out)
        return model

    # ---------------------------------------------------------------- write path
    def make_write_path(store):
        from rlhf_pipeline.transforms.group_advantage import GroupAdvantage

        # trajectory_return="sum": a trajectory's turn rewards summed, its advantage on every turn;
        # each turn's own group-normalized advantage beside it, so that --set
        # learner.turn_advantage=turn or =mixed works on this buffer (one made before it had
        # the field goes on without it)
        return [GroupAdvantage(settings.group_size, trajectory_return="sum",
                               step_advantage="step_advantage" in store.schema.field_names)]

    # ---------------------------------------------------------------- collector
    def collector(engine, sink, store, collector_index: int):
        from rlhf_pipeline.agents.calculator import multiply
        from rlhf_pipeline.agents.episode import EpisodeLimits
        from rlhf_pipeline.agents.tools import ToolBox, parse_hermes
        from rlhf_pipeline.collect import Collector, CollectorConfig, Environments, SamplingConfig, TaskSource
        from rlhf_pipeline.collect.console import agent_round_printer

        toolbox = ToolBox([multiply], timeout_s=5.0, max_output_chars=100)  # shared by every episode

        def make_env():
            return CalculatorEnv(toolbox, max_tool_errors=settings.max_tool_errors,
                                 partial_credit=settings.partial_credit)

        config = CollectorConfig(
            tasks_per_round=settings.tasks_per_round, group_size=settings.group_size,
            sampling=SamplingConfig(temperature=settings.temperature), seed=settings.seed,
            collector_index=collector_index, max_failed_group_fraction=settings.max_failed_group_fraction,
        )
        episodes = Environments(
            make_env, parser=parse_hermes,
            limits=EpisodeLimits(max_turns=settings.max_turns, max_new_tokens=settings.max_new_tokens,
                                 context_length=settings.context_length),
            # a buffer created before some of the agents' row fields existed goes on without them
            row_fields=tuple(f for f in AGENT_ROW_FIELDS if f in store.schema.field_names),
        )
        # each collector (one buffer shard each) walks the tasks in its own order
        source = TaskSource(tasks, seed=settings.seed + 1_000_003 * collector_index,
                            required_fields=("question", "answer"))
        # a line every log_rounds_every rounds, with what failed tool calls said (collect/console.py)
        hooks = [agent_round_printer(settings.log_rounds_every, collector_index, toolbox)]
        return Collector(engine, tokenizer, source, episodes, sink=sink, config=config, hooks=hooks)

    def preflight():  # before any model is built or anything written:
        from rlhf_pipeline.agents.calculator import multiply
        from rlhf_pipeline.agents.templates import check_chat_template
        from rlhf_pipeline.collect import TaskSource

        TaskSource(tasks, required_fields=("question", "answer"))  # the tasks have what the environment reads
        check_chat_template(tokenizer, tools=[multiply])  # the template renders user, assistant and tool turns

    return Pipeline(
        settings=settings,
        make_policy=make_policy,
        make_model=make_model,
        tokenizer=tokenizer,
        make_write_path=make_write_path,
        row_fields=("advantage", "step_advantage", "termination_reason", *AGENT_ROW_FIELDS),
        collector=collector,
        preflight=preflight,
        eval_sets=lambda: eval_sets(settings, held_out),
    )


# ---------------------------------------------------------------- held-out set
HELD_OUT_TASKS = 64
"""Products held out of training: never a training task, evaluated with eval.* settings."""


def held_out_tasks(settings: Settings) -> list[dict[str, str]]:
    """``HELD_OUT_TASKS`` distinct products from a seed of their own (the same for every run seed, so
    runs of different seeds are evaluated on one set), in a fixed order."""
    from rlhf_pipeline.agents.calculator import product_tasks

    distinct = {t["question"]: t for t in product_tasks(4 * HELD_OUT_TASKS, low=settings.low, high=settings.high,
                                                       seed=8_000_000)}
    pairs = (settings.high - settings.low + 1) ** 2  # a narrow range keeps nine in ten for training
    return list(distinct.values())[:min(HELD_OUT_TASKS, pairs // 10)]


def training_tasks(settings: Settings, held_out: list[dict[str, str]]) -> list[dict[str, str]]:
    """``num_tasks`` tasks drawn as ``product_tasks`` draws them, less the held-out products."""
    from rlhf_pipeline.agents.calculator import product_tasks

    kept = {t["question"] for t in held_out}
    drawn = product_tasks(2 * settings.num_tasks, low=settings.low, high=settings.high, seed=settings.seed)
    return [t for t in drawn if t["question"] not in kept][:settings.num_tasks]


def eval_sets(settings: Settings, held_out: list[dict[str, str]]) -> list:
    """The held-out products in whole episodes, scored by the exact answer only (no partial credit,
    whatever ``partial_credit`` trains with): an episode passes when its final number is the product."""
    from rlhf_pipeline.agents.calculator import CalculatorEnv, multiply
    from rlhf_pipeline.agents.episode import EpisodeLimits
    from rlhf_pipeline.agents.tools import ToolBox, parse_hermes
    from rlhf_pipeline.evaluation.sets import EvalSet

    if not held_out:
        return []
    toolbox = ToolBox([multiply], timeout_s=5.0, max_output_chars=100)
    limits = EpisodeLimits(max_turns=settings.max_turns, max_new_tokens=settings.max_new_tokens,
                           context_length=settings.context_length)
    return [EvalSet("held_out", tasks=held_out, limits=limits, parser=parse_hermes,
                    make_env=lambda: CalculatorEnv(toolbox, max_tool_errors=settings.max_tool_errors))]


USABLE_RIGHT_FACTORS = 0.5
"""Below this share of greedy calls with the question's factors, calls pay no better than guesses
and GRPO has little to reinforce: the run says so before RL starts."""


def warm_start_policy(model, tokenizer, settings: Settings, held_out: list[dict[str, str]]) -> None:
    """The warm start, in stages until the check reaches ``warm_start_target`` (or the stages run
    out), printing after each what the model does in greedy episodes on tasks of their own (a seed
    neither the warm start nor the collector draws from); a warning when the last is below the
    usable bar. It never demonstrates a ``held_out`` product."""
    import sys

    from rlhf_pipeline.agents.calculator import evaluate_tool_use, product_tasks, warm_start_until_copying

    n = settings.warm_start_check_tasks
    tasks = product_tasks(n, low=settings.low, high=settings.high, seed=settings.seed + 7_000_000)

    def check(model) -> dict[str, float]:
        return evaluate_tool_use(model, tokenizer, tasks, max_turns=settings.max_turns,
                                 max_new_tokens=settings.max_new_tokens, context_length=settings.context_length)

    def on_stage(result, reached, next_steps: int) -> None:
        line = f"[run] warm start: {int(result['steps'])} steps, loss {result['loss']:.3f}, {result['seconds']:.1f}s"
        if reached is not None:
            line += (f"; greedy on {n} tasks: tool calls {round(reached['tool_calls'] * n)}/{n}, right factors "
                     f"{round(reached['right_factors'] * n)}/{n}, exact answers {round(reached['exact'] * n)}/{n}")
            if next_steps:
                line += f"; below the target {settings.warm_start_target:.0%} right factors: {next_steps} steps more"
        print(line, flush=True)

    _, reached = warm_start_until_copying(
        model, tokenizer, settings.warm_start_steps, check=check if n else None, target=settings.warm_start_target,
        more_stages=settings.warm_start_more_stages, on_stage=on_stage, lr=settings.warm_start_lr,
        tool_fraction=settings.warm_start_tool_fraction, copy_weight=settings.warm_start_copy_weight,
        seed=settings.seed, low=settings.low, high=settings.high, held_out={t["question"] for t in held_out})
    if reached is not None and reached["right_factors"] < USABLE_RIGHT_FACTORS:
        print(f"[run] warning: the warm start called with the question's factors in {reached['right_factors']:.0%} of "
              f"the tasks, below the usable {USABLE_RIGHT_FACTORS:.0%}: calls with wrong factors pay no better than "
              f"guesses, so RL will barely learn; raise warm_start_steps or warm_start_more_stages, or try another "
              f"seed", file=sys.stderr, flush=True)
