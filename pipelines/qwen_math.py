"""GRPO on grade-school math with a real instruct model, on one GPU.

    rlhf-pipeline run pipelines/qwen_math.py --device cuda \\
        --set model_path=/models/Qwen2.5-0.5B-Instruct --set data_path=/data/gsm8k_train.jsonl
    rlhf-pipeline setup-vllm        # the vLLM environment (the official vllm on a GPU machine), then:
    rlhf-pipeline run pipelines/qwen_math.py --device cuda \\
        --set model_path=/models/Qwen2.5-0.5B-Instruct --set data_path=/data/gsm8k_train.jsonl \\
        --set generation.engine=vllm     # vLLM samples

Both paths are local (nothing is downloaded). The data file is JSONL, one problem a line,
with the question and a final numeric ``answer`` (GSM8K's ``#### 42`` tail is accepted)::

    {"question": "Natalia sold clips to 48 of her friends ...", "answer": "... #### 72"}
    {"messages": [{"role": "user", "content": "..."}], "answer": "72"}

What it wires, top to bottom:

1. model   the instruct model and its tokenizer from ``model_path`` (bf16 on CUDA); the
           initial policy is the model itself (no warm start);
2. task    each question becomes a chat turn asking for the final answer in ``\\boxed{}``;
           reward = ``numeric_match`` (1 for the right number) + ``format_weight`` x a
           ``\\boxed{}`` format reward;
3. buffer  a memmap replay buffer in ``<run>/buffer``; group advantage on the write path,
           and, when ``learner.loss.kl_coef > 0``, reference log-probs under the frozen
           model from ``model_path`` (scored at the sampling temperature);
4. learner GRPO, DAPO-style token-mean loss with clip-higher, bf16 autocast on CUDA; with
           ``learner.loss.kl_coef > 0`` a k3 KL-to-reference penalty in the loss.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from rlhf_pipeline.learn.settings import GRPOLossConfig, LearnerSettings
from rlhf_pipeline.pipeline import Pipeline, PipelineError, RunPaths, preflight_rewards
from rlhf_pipeline.run_settings import RunSettings
from rlhf_pipeline.setting_checks import Bounds


@dataclass
class Settings(RunSettings):
    """The task's settings; the run's (steps, device, seed, group_size, temperature, buffer, learner,
    generation, retention, ray...) come from RunSettings, with this task's defaults below."""

    steps: int = 500
    """Learner steps (optimizer updates); --steps sets it."""
    device: Literal["cpu", "cuda"] = "cuda"
    """Where models run: cuda (intended) or cpu (tests); --device sets it."""
    threads: int | None = None
    """Torch threads per process (none: torch's default)."""
    segment_rows: int = 4096
    """Rows per segment of the replay buffer (the unit of sealing and eviction)."""

    # ---- model and data (local paths only)
    model_path: Path = Path("models/Qwen2.5-0.5B-Instruct")
    """Directory of the instruct model and its tokenizer (save_pretrained layout)."""
    data_path: Path = Path("data/gsm8k_train.jsonl")
    """JSONL of problems: 'question' (or 'messages'/'prompt') and 'answer' on every line."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Weights dtype of the sampler and the reference model: auto (bfloat16 on CUDA, float32 on CPU)."""
    system_prompt: str = "Solve the problem step by step. Put the final answer in \\boxed{}."
    """System message before each question."""

    # ---- task
    prompts_per_round: Annotated[int, Bounds(ge=1)] = 16
    """Problems per collection round; a round writes prompts_per_round * group_size rows."""
    max_new_tokens: Annotated[int, Bounds(ge=1)] = 384
    """Longest sampled solution, in tokens."""
    format_weight: Annotated[float, Bounds(ge=0)] = 0.1
    """Weight of the \\boxed{} format reward added to the correctness reward."""

    learner: LearnerSettings = field(default_factory=lambda: LearnerSettings(
        batch_size=128, sample_window=256, new_rows_per_step=128, micro_batch_tokens=16384, lr=1e-6,
        warmup_steps=10, lr_schedule="cosine", max_grad_norm=1.0, publish_every=1,
        checkpoint_every=50, log_every=10,
        loss=GRPOLossConfig(clip_eps_low=0.2, clip_eps_high=0.28, aggregation="token_mean"),
    ))
    """Learner settings (--set learner.lr=2e-6, --list-settings shows them all)."""

    def model_head_size(self) -> tuple[int, str] | None:
        config = Path(self.model_path) / "config.json"
        if not config.is_file():  # check() refuses it, first
            return None
        config = json.loads(config.read_text())
        return (config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
                " (model_path's config.json); pick a model whose head size vLLM takes")


def check(settings: Settings) -> None:
    """What the settings point at: ``run`` calls this before it starts any process."""
    model = Path(settings.model_path)
    if not (model / "config.json").is_file():
        missing = "does not exist" if not model.exists() else "has no config.json"
        raise ValueError(f"setting 'model_path': {str(model)!r} {missing}; point it at a local model directory "
                         f"(--set model_path=/path/to/Qwen2.5-0.5B-Instruct)")
    if not Path(settings.data_path).is_file():
        raise ValueError(f"setting 'data_path': {str(settings.data_path)!r} does not exist; point it at a local "
                         f"JSONL of problems")


def build(settings: Settings, run: RunPaths) -> Pipeline:
    from rlhf_pipeline.collect import make_prompt
    from rlhf_pipeline.collect.rewards import extract_number, numeric_match, regex_reward
    from rlhf_pipeline.models import load_model, load_tokenizer
    from rlhf_pipeline.transforms import GroupAdvantage, ReferenceLogProbs

    tokenizer = load_tokenizer(settings.model_path)  # names the path when it holds no tokenizer
    prompts = _load_problems(settings.data_path, settings.system_prompt, make_prompt, extract_number)
    rewards = {"correct": numeric_match, "format": (regex_reward(r".*\\boxed\{.+\}.*"), settings.format_weight)}
    dtype = settings.dtype if settings.dtype != "auto" else ("bfloat16" if settings.device == "cuda" else "float32")

    # ---------------------------------------------------------------- model
    def make_model():
        # the learner keeps float32 master weights; autocast runs the forward in bf16
        return load_model(settings.model_path, dtype="float32")

    # ---------------------------------------------------------------- write path
    # the KL penalty in the loss reads reference log-probs stored with each row
    with_reference = settings.learner.loss.kl_coef > 0

    def make_write_path(store):
        write_path = [GroupAdvantage(settings.group_size)]
        if with_reference:
            reference = load_model(settings.model_path, dtype=dtype, device=settings.device)
            write_path.append(ReferenceLogProbs(reference, temperature=settings.temperature,
                                                device=settings.device, pad_token_id=tokenizer.pad_token_id))
        return write_path

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
        make_policy=make_model,  # no warm start: the instruct model itself
        make_model=make_model,
        tokenizer=tokenizer,
        make_write_path=make_write_path,
        row_fields=("advantage", "ref_log_probs") if with_reference else ("advantage",),
        sampler_dtype=dtype,
        collector=collector,
        preflight=lambda: preflight_rewards(rewards, prompts[:1], settings.group_size),
    )


def _load_problems(path: Path, system_prompt: str, make_prompt, extract_number) -> list:
    """GSM8K-style JSONL -> chat prompt records with a numeric ``answer``; errors name the line."""
    path = Path(path)
    if not path.is_file():
        raise PipelineError(
            f"setting 'data_path': {str(path)!r} does not exist; point it at a local JSONL of problems"
        )
    records = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PipelineError(f"{where}: not valid JSON ({exc.msg})") from None
        if "answer" not in data:
            raise PipelineError(f"{where}: missing field 'answer' (the final number the reward checks)")
        number = extract_number(str(data["answer"]))
        if number is None:
            raise PipelineError(f"{where}: 'answer' holds no number: {data['answer']!r}")
        question = data.pop("question", None)
        if question is not None:
            data["messages"] = [{"role": "user", "content": question}]
        if "messages" in data and system_prompt:
            data["messages"] = [{"role": "system", "content": system_prompt}, *data["messages"]]
        data["answer"] = f"{number:g}"
        records.append(make_prompt(data, required_fields=("answer",), where=where))
    if not records:
        raise PipelineError(f"setting 'data_path': {str(path)!r} holds no problems")
    return records
