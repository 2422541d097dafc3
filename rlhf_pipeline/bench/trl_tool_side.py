"""TRL's ``GRPOTrainer`` with ``tools=[multiply]`` on ``pipelines/tool_use.py``'s task: the TRL side of
``bench tool-use``, which starts it as ``python -m rlhf_pipeline.bench.trl_tool_side PIPELINE.py
--init WEIGHTS.pt --steps N --out FIGURES.json [--threads N] [--set key=value ...]``.

From the pipeline's own file and settings it builds the model (loaded with ``--init``), the tasks in
the order collector 0 takes them, one optimizer step per generation batch with the learner's
optimizer, schedule and clip, and the same turn and token limits. The one adaptation is the
tokenizer's template (:data:`TRL_TOOL_CHAT_TEMPLATE`, :data:`RESPONSE_TEMPLATE`), so TRL can parse and
render tool calls; :class:`Scorer` pays what ``CalculatorEnv`` pays. What is mapped and what still
differs: docs/benchmarks.md#tool-use-against-trl-rlhf-pipeline-bench-tool-use.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from typing import Any

#: ``TOOL_CHAT_TEMPLATE`` plus the rendering of an assistant message's ``tool_calls``, in the
#: compact Hermes format the warm start teaches (``json.dumps`` with no spaces).
TRL_TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<|system|>Tools:{% for t in tools %} {{ t['function']['name'] }}("
    "{{ t['function']['parameters']['properties'] | list | join(', ') }}){% endfor %}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{\"name\":{{ c['function']['name'] | tojson }},"
    "\"arguments\":{{ c['function']['arguments'] | tojson(separators=(',', ':')) }}}</tool_call>{% endfor %}"
    "<|end|>"
    "{% elif m['role'] in ['system', 'user', 'tool'] %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% else %}{{ raise_exception('unknown chat role: ' + m['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

#: transformers' new-style response parser (>= 5.13) for that template, written like TRL's
#: ``qwen3_template``: tool calls between ``<tool_call>`` tokens, the text up to ``<|end|>``.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|end\|>\s*", "content": "text"},
    },
}

#: the opening prompt's tokens at most (``<|system|>Tools: multiply(a, b)<|user|>What is 99 * 99?<|assistant|>``
#: is 41): the whole completion gets the rest of the context
PROMPT_TOKENS = 48


def trl_tool_tokenizer():
    """``char_tool_tokenizer`` (same vocabulary and ids) with the template and parser TRL's tools need."""
    from rlhf_pipeline.models.tiny import char_tool_tokenizer

    tokenizer = char_tool_tokenizer()
    tokenizer.chat_template = TRL_TOOL_CHAT_TEMPLATE
    tokenizer.response_template = RESPONSE_TEMPLATE
    return tokenizer


def ordered_tasks(settings: Any, count: int) -> list[dict[str, str]]:
    """The first ``count`` tasks collector 0 of ``pipelines/tool_use.py`` takes, in its order: the
    pipeline's own training tasks (its held-out ones left out, as its evaluation needs), from the
    module that declared ``settings``' class."""
    import sys

    from rlhf_pipeline.collect import TaskSource

    pipeline = sys.modules[type(settings).__module__]
    tasks = pipeline.training_tasks(settings, pipeline.held_out_tasks(settings))
    return TaskSource(tasks, seed=settings.seed).next_batch(count)  # the pipeline's collector 0: seed + 0


class Scorer:
    """TRL reward function for the calculator task; records each generation batch's figures."""

    __name__ = "calculator"  # TRL names reward columns after the function

    def __init__(self, partial_credit: bool):
        self.partial_credit = partial_credit
        self.rounds: list[dict[str, float]] = []

    def __call__(self, prompts, completions, answer, **kwargs) -> list[float]:
        from rlhf_pipeline.agents.calculator import digit_credit, final_number

        rewards, called, ended = [], [], []
        for messages, expected in zip(completions, answer, strict=True):
            last = messages[-1] if messages else {"role": "assistant", "content": ""}
            text = str(last.get("content") or "")
            ended_on_call = bool(last.get("tool_calls")) or "<tool_call>" in text
            ended.append(ended_on_call)
            if ended_on_call:
                rewards.append(0.0)
            elif self.partial_credit:
                rewards.append(digit_credit(text, expected))
            else:
                rewards.append(float(final_number(text) == expected))
            called.append(any(m.get("role") == "tool" for m in messages))
        self.rounds.append({"reward_mean": sum(rewards) / len(rewards), "tool_call_rate": sum(called) / len(called),
                            "episodes": len(rewards), "ended_on_call": sum(ended), "time": time.time()})
        return rewards


def build_trainer(settings: Any, state_dict: dict, *, steps: int, output_dir: str):
    """A ``GRPOTrainer`` for ``steps`` steps of the pipeline's task from ``state_dict``; returns it and its scorer."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rlhf_pipeline.agents.calculator import multiply
    from rlhf_pipeline.learn.step import make_optimizer
    from rlhf_pipeline.models import tiny_causal_lm

    tokenizer = trl_tool_tokenizer()
    model = tiny_causal_lm(len(tokenizer), hidden_size=settings.hidden_size, num_layers=settings.num_layers,
                           num_heads=settings.num_heads, max_position_embeddings=settings.context_length,
                           pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, seed=settings.seed)
    model.load_state_dict(state_dict)
    learner, loss = settings.learner, settings.learner.loss
    tasks = ordered_tasks(settings, steps * settings.tasks_per_round)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": t["question"]}] for t in tasks],
                                 "answer": [t["answer"] for t in tasks]})
    episodes = settings.tasks_per_round * settings.group_size
    args = GRPOConfig(
        output_dir=output_dir, use_cpu=not torch.cuda.is_available(), bf16=False, fp16=False, report_to=[],
        save_strategy="no", logging_steps=1, seed=settings.seed, data_seed=settings.seed,
        max_steps=steps, per_device_train_batch_size=episodes, gradient_accumulation_steps=1,
        num_generations=settings.group_size, steps_per_generation=1, num_iterations=1, shuffle_dataset=False,
        learning_rate=learner.lr, max_grad_norm=learner.max_grad_norm,
        loss_type="dapo", beta=0.0, epsilon=loss.clip_eps_low, epsilon_high=loss.clip_eps_high,
        temperature=settings.temperature, top_k=0, top_p=1.0,
        max_completion_length=settings.context_length - PROMPT_TOKENS,
        generation_kwargs={"max_new_tokens": settings.max_new_tokens},
        max_tool_calling_iterations=settings.max_turns - 1,
    )
    scorer = Scorer(settings.partial_credit)
    # the learner's own AdamW and schedule (warm-up (s + 1) / warmup_steps from the first step, where
    # transformers' "constant_with_warmup" starts at 0), handed to the trainer
    optimizers = make_optimizer(model, learner, steps)
    trainer = GRPOTrainer(model=model, reward_funcs=[scorer], args=args, train_dataset=dataset,
                          processing_class=tokenizer, tools=[multiply], optimizers=optimizers)
    return trainer, scorer


def run_trl(pipeline_path: str, *, init: str, steps: int, out: str, overrides: list[str],
            threads: int | None) -> dict[str, Any]:
    started = time.time()
    import torch
    from transformers import TrainerCallback

    from rlhf_pipeline.pipeline import load_pipeline_module, make_settings

    if threads is not None:
        torch.set_num_threads(threads)
    settings = make_settings(load_pipeline_module(pipeline_path), [*overrides, f"steps={steps}"])
    with tempfile.TemporaryDirectory(prefix="bench-tool-use-trl-") as output_dir:
        trainer, scorer = build_trainer(settings, torch.load(init, map_location="cpu", weights_only=True),
                                        steps=steps, output_dir=output_dir)
        first_step: list[float] = []

        class FirstStep(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if not first_step:
                    first_step.append(time.time())

        trainer.add_callback(FirstStep())
        train_started = time.time()
        trainer.train()
        train_s = time.time() - train_started
        history = [r for r in trainer.state.log_history if "loss" in r]
    figures = {"steps": trainer.state.global_step, "rounds": scorer.rounds, "train_s": train_s,
               "first_step_time": first_step[0],
               "setup_s": train_started - started,
               "tool_calls_per_episode": [r.get("tools/call_frequency") for r in history],
               "tool_failure_rate": [r.get("tools/failure_frequency") for r in history]}
    with open(out, "w") as f:
        json.dump(figures, f)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlhf_pipeline.bench.trl_tool_side")
    parser.add_argument("pipeline")
    parser.add_argument("--init", required=True, help="initial weights (torch.save'd state dict)")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True, help="where to write the figures (JSON)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    run_trl(args.pipeline, init=args.init, steps=args.steps, out=args.out, overrides=args.overrides,
            threads=args.threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
