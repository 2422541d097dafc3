"""TRL's ``GRPOTrainer`` loss-and-backward on the learner benchmark's rows: the third side of ``bench learner``.

What runs, and what of TRL is timed. A real ``trl.GRPOTrainer`` is built offline (a model
object, a local tokenizer, a one-column in-memory dataset, a reward function that is never
called; nothing is downloaded). Generation, rewards and ``_prepare_inputs`` are not run:
the benchmark's rows are already sampled. Each step then does what TRL's training step does
with one generation batch, on TRL's own layout of it:

* the batch padded as ``_generate_and_score_completions`` pads it: prompts left-padded and
  completions right-padded to the longest of the WHOLE batch (``prompt_ids``,
  ``completion_ids``, masks), the stored sampling log-probs as ``old_per_token_logps``, the
  rows' advantages;
* split, in row order, into ``steps_per_generation`` chunks of ``per_device_train_batch_size``
  rows (TRL shuffles the rows first; with every chunk padded to the batch's widths the order
  changes no cost), as many rows per chunk as fit ``micro_batch_tokens`` padded tokens;
* per chunk ``trainer.compute_loss(model, chunk)`` (TRL's log-prob forward through its fused,
  chunked LM head, entropies included, then its loss) and ``backward()``; then the same
  gradient clip and AdamW step as the other two sides.

Timed: those forwards, losses, backwards and the optimizer step. The loss is
``loss_type="dapo"`` (a token mean over the whole generation batch: our ``token_mean``),
``epsilon=0.2`` both sides, ``beta=0``: the objective the padded and packed sides train, so
the three report the same first-step loss. ``current_gradient_accumulation_steps`` is set to
the chunk count, as ``transformers.Trainer``'s loop sets it.
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
