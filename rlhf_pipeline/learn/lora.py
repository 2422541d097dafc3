"""The learner's side of a LoRA run (``learner.lora.rank > 0``).

The base is the run's initial policy, weights version 0, kept for the whole run. The learner wraps it
with a fresh peft adapter (B = 0: at first the base's function), trains the adapter alone, publishes
each version as the adapter (``models/lora.py``'s ``PolicyAdapter``, with this learner's canary) and
checkpoints it with its settings and the base's digest. A checkpoint resumes only as the kind of
training that made it (:func:`check_resumable` refuses the others by name).
Design: docs/lora.md#what-the-learner-trains-publishes-and-checkpoints.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhf_pipeline.learn.errors import AdapterRefused, CheckpointRefused
from rlhf_pipeline.learn.settings import LoraSettings
from rlhf_pipeline.models.lora import (
    PolicyAdapter,
    adapter_config_of,
    adapter_tensors,
    canary_of,
    check_target_modules,
    load_adapter_tensors,
    state_digest,
    with_lora,
)

CHECKPOINT_KEY = "lora"
"""What a LoRA checkpoint holds beside the adapter (``"model"``): its settings and the base's digest."""


def lora_record(settings: LoraSettings, base_digest: str, adapter_config: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint keeps of its adapter beside the tensors: the settings resumes are checked
    against, the base's digest, and peft's adapter_config (``export-model --adapter`` of a checkpoint)."""
    return {"rank": settings.rank, "alpha": float(settings.alpha), "dropout": float(settings.dropout),
            "target_modules": list(settings.target_modules), "base_digest": base_digest,
            "adapter_config": adapter_config}


def check_resumable(checkpoint: dict[str, Any], settings: LoraSettings, step: int,
                    base_digest: str | None) -> None:
    """Raises :class:`CheckpointRefused` naming the setting when ``checkpoint`` (of ``step``) cannot be resumed with
    ``settings``; ``base_digest``: version 0's, for a LoRA run."""
    record = checkpoint.get(CHECKPOINT_KEY)
    if record is None and settings.enabled:
        raise CheckpointRefused(f"the checkpoint of step {step} trained every weight (learner.lora.rank=0), and this run "
                         f"sets learner.lora.rank={settings.rank}: resume it with learner.lora.rank=0, or start a "
                         f"LoRA run of its own")
    if record is not None and not settings.enabled:
        raise CheckpointRefused(f"the checkpoint of step {step} trained a LoRA adapter (learner.lora.rank="
                         f"{record['rank']}), and this run sets learner.lora.rank=0: resume it with "
                         f"learner.lora.rank={record['rank']}")
    if record is None:
        return
    for name, value in (("rank", settings.rank), ("alpha", float(settings.alpha)),
                        ("target_modules", list(settings.target_modules))):
        if record[name] != value:
            raise CheckpointRefused(f"the checkpoint of step {step} trained an adapter with learner.lora.{name}="
                             f"{_shown(record[name])}, and this run sets {_shown(value)}: resume it with "
                             f"learner.lora.{name}={_shown(record[name])}")
    if base_digest is not None and record["base_digest"] != base_digest:
        raise CheckpointRefused(f"the checkpoint of step {step} trained an adapter on another base than this run's weights "
                         f"version 0 (digest {record['base_digest'][:12]}, version 0's {base_digest[:12]}): the "
                         f"base was replaced; restore it, or start a new run")


def _shown(value: Any) -> str:
    return ",".join(value) if isinstance(value, list) else f"{value:g}" if isinstance(value, float) else str(value)


class LoraPolicy:
    """The adapter the learner trains on its frozen base: built, checkpointed, published."""

    def __init__(self, settings: LoraSettings, base_state: dict[str, torch.Tensor]) -> None:
        """``base_state``: weights version 0 as published (its digest names the base)."""
        self.settings = settings
        self.base_digest = state_digest(base_state)

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` (holding the base) with a fresh adapter; only the adapter trains."""
        s = self.settings
        try:  # a run's start checked them (Pipeline.initial_policy); a resume may have changed them since
            check_target_modules(model, s.target_modules)
        except ValueError as exc:
            raise AdapterRefused(str(exc)) from None
        return with_lora(model, s.rank, s.alpha, s.dropout, s.target_modules)

    def checkpoint_state(self, model: torch.nn.Module) -> dict[str, Any]:
        """What a checkpoint holds for the model: the adapter (``"model"``) and its record."""
        return {"model": adapter_tensors(model),
                CHECKPOINT_KEY: lora_record(self.settings, self.base_digest, adapter_config_of(model))}

    def load(self, model: torch.nn.Module, checkpoint: dict[str, Any]) -> None:
        load_adapter_tensors(model, checkpoint["model"])

    def publication(self, model: torch.nn.Module, version: int) -> PolicyAdapter:
        """``version`` to publish: the adapter, with this learner's canary log-probs under it."""
        vocab = model.get_output_embeddings().weight.shape[0]
        return PolicyAdapter(adapter_tensors(model), config=adapter_config_of(model), base_digest=self.base_digest,
                             canary=canary_of(model, vocab, version))
