"""GRPO on grade-school math with a real instruct model, on one GPU.

    rlhf-pipeline run pipelines/qwen_math.py --device cuda \\
        --set model_path=/models/Qwen2.5-0.5B-Instruct --set data_path=/data/gsm8k_train.jsonl
    rlhf-pipeline setup-vllm        # the vLLM environment (the official vllm on a GPU machine), then:
    rlhf-pipeline run pipelines/qwen_math.py --device cuda \\
        --set model_path=/models/Qwen2.5-0.5B-Instruct --set data_path=/data/gsm8k_train.jsonl \\
        --set generation.engine=vllm --set generation.enforce_eager=false     # vLLM samples

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

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from rlhf_pipeline.learn.settings import LearnerSettings
from rlhf_pipeline.learn.settings import GRPOLossConfig
from rlhf_pipeline.pipeline import Pipeline, PipelineError, RunPaths, preflight_rewards
from rlhf_pipeline.storage.retention import RetentionSettings
from rlhf_pipeline.cluster.settings import RaySettings
from rlhf_pipeline.generation.settings import GenerationSettings, check_generation, check_rounds


@dataclass
class Settings:
    steps: int = 500
    """Learner steps (optimizer updates); --steps sets it."""
    device: str = "cuda"
    """Where models run: cuda (intended) or cpu (tests); --device sets it."""
    seed: int = 0
    """Seed of the prompt order, sampling and learner."""

    # ---- model and data (local paths only)
    model_path: Path = Path("models/Qwen2.5-0.5B-Instruct")
    """Directory of the instruct model and its tokenizer (save_pretrained layout)."""
    data_path: Path = Path("data/gsm8k_train.jsonl")
    """JSONL of problems: 'question' (or 'messages'/'prompt') and 'answer' on every line."""
    dtype: str = "auto"
    """Weights dtype: auto (bfloat16 on CUDA, float32 on CPU), float32 or bfloat16."""
    system_prompt: str = "Solve the problem step by step. Put the final answer in \\boxed{}."
    """System message before each question."""

    # ---- collection
    prompts_per_round: int = 16
    """Problems per collection round; a round writes prompts_per_round * group_size rows."""
    group_size: int = 8
    """Completions per problem (GRPO's G)."""
    max_new_tokens: int = 384
    """Longest sampled solution, in tokens."""
    temperature: float = 1.0
    """Sampling temperature; the learner recomputes log-probs at the same temperature."""
    format_weight: float = 0.1
    """Weight of the \\boxed{} format reward added to the correctness reward."""
    rounds_per_version: int = 2
    """The collector writes at most this many rounds per policy version, then waits for new weights
    (rounds the learner's next batch needs are written whatever this says)."""

    # ---- buffer and learner
    segment_rows: int = 4096
    """Rows per memmap segment of the replay buffer."""
    retention: RetentionSettings = field(default_factory=RetentionSettings)
    """How much of its shard each collector keeps on a long run (--set retention.max_rows=200000; also
    max_versions_behind, max_age_s): old whole groups go, never rows a kept checkpoint, a branch or the
    learner still needs (docs/retention.md). Unset: every row is kept."""
    learner: LearnerSettings = field(default_factory=lambda: LearnerSettings(
        batch_size=128, sample_window=256, new_rows_per_step=128, micro_batch_tokens=16384, lr=1e-6,
        warmup_steps=10, lr_schedule="cosine", max_grad_norm=1.0, max_staleness=2, publish_every=1,
        checkpoint_every=50, log_every=10,
        loss=GRPOLossConfig(clip_eps_low=0.2, clip_eps_high=0.28, aggregation="token_mean"),
    ))
    """Learner settings (--set learner.lr=2e-6, --list-settings shows them all)."""
    generation: GenerationSettings = field(default_factory=GenerationSettings)
    """Who samples the solutions: our loop (default) or vLLM (--set generation.engine=vllm, in the vLLM
    environment `rlhf-pipeline setup-vllm` makes; on a GPU also --set generation.enforce_eager=false)."""
    ray: RaySettings = field(default_factory=RaySettings)
    """Resources of each actor under `run --ray` (--set ray.collector_num_gpus=1); ignored without --ray."""


def build(settings: Settings, run: RunPaths) -> Pipeline:
    import torch

    from rlhf_pipeline.collect import Collector, CollectorConfig, PromptSource, SamplingConfig, make_prompt
    from rlhf_pipeline.collect.rewards import extract_number, numeric_match, regex_reward
    from rlhf_pipeline.generation.settings import make_collector_engine
    from rlhf_pipeline.models import load_model, load_tokenizer
    from rlhf_pipeline.schema import StoreSchema
    from rlhf_pipeline.storage import create_store, make_replay_buffer
    from rlhf_pipeline.transforms import GroupAdvantage, ReferenceLogProbs

    # ---------------------------------------------------------------- checks first
    if settings.device == "cuda" and not torch.cuda.is_available():
        raise PipelineError("setting 'device' is 'cuda' but torch sees no GPU; use --device cpu")
    if settings.group_size < 2:
        raise PipelineError("setting 'group_size' must be >= 2: GRPO compares completions within a group")
    tokenizer = load_tokenizer(settings.model_path)  # names the path when it holds no tokenizer
    if not (Path(settings.model_path) / "config.json").is_file():
        raise PipelineError(
            f"setting 'model_path': {str(settings.model_path)!r} has no config.json; point it at a "
            f"local model directory (--set model_path=/path/to/Qwen2.5-0.5B-Instruct)"
        )
    config = json.loads((Path(settings.model_path) / "config.json").read_text())
    head_size = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    try:
        settings.retention.check(settings.segment_rows)
        check_rounds(settings.generation, multi_turn=False)
        check_generation(settings.generation, head_size=head_size, device=settings.device,
                         head_hint=f" (model_path's config.json); pick a model whose head size vLLM takes")
    except ValueError as exc:
        raise PipelineError(str(exc)) from None
    learner = dataclasses.replace(settings.learner, temperature=settings.temperature)
    if settings.generation.engine == "vllm":  # rows wait on the engine's start (or a restart): give up no sooner
        learner = dataclasses.replace(learner, data_timeout_s=learner.data_timeout_s + settings.generation.start_timeout_s)
    try:
        learner.check()
    except ValueError as exc:
        raise PipelineError(str(exc)) from None
    prompts = _load_problems(settings.data_path, settings.system_prompt, make_prompt, extract_number)
    rewards = {"correct": numeric_match, "format": (regex_reward(r".*\\boxed\{.+\}.*"), settings.format_weight)}
    dtype = settings.dtype if settings.dtype != "auto" else ("bfloat16" if settings.device == "cuda" else "float32")

    # ---------------------------------------------------------------- model
    def make_model():
        # the learner keeps float32 master weights; autocast runs the forward in bf16
        return load_model(settings.model_path, dtype="float32")

    def make_policy():
        return make_model()

    # ---------------------------------------------------------------- buffer + write path
    # the KL penalty in the loss reads reference log-probs stored with each row
    with_reference = learner.loss.kl_coef > 0

    def create_buffer(path: Path):
        optional = ("advantage", "ref_log_probs") if with_reference else ("advantage",)
        return create_store(path, "memmap", schema=StoreSchema(optional=optional),
                            segment_rows=settings.segment_rows)

    def make_write_path(store):
        write_path = [GroupAdvantage(settings.group_size)]
        if with_reference:
            reference = load_model(settings.model_path, dtype=dtype, device=settings.device)
            write_path.append(ReferenceLogProbs(reference, temperature=settings.temperature,
                                                device=settings.device, pad_token_id=tokenizer.pad_token_id))
        return write_path

    def make_collector(model, store, collector_index: int = 0):
        buffer = make_replay_buffer(store, batch_size=learner.batch_size, transforms=make_write_path(store))
        config = CollectorConfig(
            prompts_per_batch=settings.prompts_per_round, num_generations=settings.group_size,
            sampling=SamplingConfig(max_new_tokens=settings.max_new_tokens, temperature=settings.temperature),
            seed=settings.seed, collector_index=collector_index, stream_groups=settings.generation.stream_groups,
            overlap_rounds=settings.generation.overlap_rounds,
        )
        # each collector (one buffer shard each) walks the prompts in its own order
        source = PromptSource(prompts, seed=settings.seed + 1_000_003 * collector_index, required_fields=("answer",))
        sampler_model = model.to(device=settings.device, dtype=getattr(torch, dtype))
        try:  # the loop samples with this model; a vLLM engine or a server at generation.url starts from its weights
            engine = make_collector_engine(settings.generation, sampler_model, tokenizer, device=settings.device,
                                           seed=settings.seed, collector_index=collector_index)
        except ValueError as exc:  # one that cannot serve this run: one line, no rows
            raise PipelineError(str(exc)) from None
        return Collector(engine, tokenizer, source, rewards, sink=buffer.extend, config=config)

    return Pipeline(
        settings=settings,
        learner=learner,
        make_policy=make_policy,
        make_model=make_model,
        create_buffer=create_buffer,
        make_collector=make_collector,
        pad_token_id=tokenizer.pad_token_id,
        tokenizer=tokenizer,
        make_write_path=make_write_path,
        preflight=lambda: preflight_rewards(rewards, prompts[:1], settings.group_size),
        collect_rounds_per_version=settings.rounds_per_version,
        retention=settings.retention,
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
