"""TRL's ``GRPOTrainer`` loss-and-backward on the learner benchmark's rows: the third side of ``bench learner``.

A real ``trl.GRPOTrainer`` built offline; generation, rewards and ``_prepare_inputs`` are not run.
Timed: ``compute_loss`` and backward on TRL's own layout (the whole batch padded as
``_generate_and_score_completions`` pads it, split into chunks that fit the token budget), then the
same clip and AdamW step; ``loss_type="dapo"``, ``epsilon=0.2``, ``beta=0``, so the three sides report
the same first-step loss. Figures: docs/benchmarks.md#learner-rlhf-pipeline-bench-learner.
"""

from __future__ import annotations

import math
import tempfile
from typing import Any

import torch


def trl_version() -> str | None:
    """The installed TRL's version, or None when TRL is not installed (``pip install -e .[bench-trl]``)."""
    try:
        import trl
    except ImportError:
        return None
    return trl.__version__


class TrlGrpoSide:
    """One TRL ``GRPOTrainer`` around ``model`` (which TRL patches: pass a copy)."""

    def __init__(self, model: torch.nn.Module, *, rows_per_step: int, widest_row: int, micro_batch_tokens: int):
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer

        from rlhf_pipeline.models.tiny import char_tokenizer

        # as many rows per chunk as fit the token budget at the batch's padded width, like the
        # padded learner's budget; at least one
        self.rows_per_chunk = max(1, min(rows_per_step, micro_batch_tokens // max(widest_row, 1)))
        self.chunks = math.ceil(rows_per_step / self.rows_per_chunk)
        generation_rows = self.rows_per_chunk * self.chunks
        # TRL checks that its generation batch holds whole groups; no group structure is used here
        group = next((d for d in range(2, generation_rows + 1) if generation_rows % d == 0), 2)
        self._tmp = tempfile.TemporaryDirectory(prefix="bench-learner-trl-")
        args = GRPOConfig(
            output_dir=self._tmp.name, use_cpu=not torch.cuda.is_available(), bf16=False, fp16=False,
            report_to=[], save_strategy="no", logging_steps=1, loss_type="dapo", beta=0.0,
            epsilon=0.2, epsilon_high=0.2, per_device_train_batch_size=self.rows_per_chunk,
            gradient_accumulation_steps=self.chunks, num_generations=group,
        )
        tokenizer = char_tokenizer()  # only for the trainer's construction: no text is tokenized
        self.trainer = GRPOTrainer(model=model, reward_funcs=[_never_called], args=args,
                                   train_dataset=Dataset.from_dict({"prompt": ["unused"] * generation_rows}),
                                   processing_class=tokenizer)
        self.trainer.current_gradient_accumulation_steps = self.chunks
        self.model = self.trainer.model

    def inputs(self, padded_batch) -> list[dict[str, Any]]:
        """TRL's chunks of one padded batch (``pad_batch``'s prompt/response views are TRL's layout)."""
        prompt_mask = padded_batch["masks", "prompt"].long()
        completion_mask = padded_batch["masks", "response"].long()
        whole = {
            "prompt_ids": padded_batch["tokens", "prompt"].long(),
            "prompt_mask": prompt_mask,
            "completion_ids": padded_batch["tokens", "response"].long(),
            "completion_mask": completion_mask,
            "advantages": padded_batch["sequence_advantage"].float(),
            "old_per_token_logps": padded_batch["log_probs", "response"].float(),
        }
        items = completion_mask.sum()
        return [{**{k: v[start:start + self.rows_per_chunk].contiguous() for k, v in whole.items()},
                 "num_items_in_batch": items}
                for start in range(0, prompt_mask.shape[0], self.rows_per_chunk)]

    def loss_and_backward(self, chunks: list[dict[str, Any]]) -> float:
        """Sum of the chunks' losses (the batch's loss) after their backward passes."""
        total = 0.0
        for chunk in chunks:
            loss = self.trainer.compute_loss(self.model, chunk)
            loss.backward()
            total += float(loss.detach())
        return total

    def close(self) -> None:
        self._tmp.cleanup()


def _never_called(completions, **kwargs):
    raise AssertionError("the benchmark runs no generation, so no reward is computed")
