"""FSDP2 for the data-parallel learner (``learner.parallelism=fsdp``): parameters, gradients and
optimizer state sharded over the ranks, for models that do not fit one device.

``torch.distributed.fsdp.fully_shard`` is applied to each transformer block (the classes a
``transformers`` model lists in ``_no_split_modules``, e.g. ``Qwen2DecoderLayer``) and then to
the root, which keeps the rest (embeddings, final norm, a tied LM head). The model is loaded
whole on every rank *before* it is sharded, so a checkpoint or published weights load the same
way with any number of ranks.

What leaves the ranks is always whole, so that files do not depend on how a run was sharded:
weights and checkpoints hold the full (unsharded) model state dict, gathered to rank 0 on the
CPU (``get_model_state_dict(..., full_state_dict=True, cpu_offload=True)``), and the full
optimizer state in the layout ``torch.optim.Optimizer.state_dict()`` writes (parameters
numbered in ``model.parameters()`` order). A checkpoint from FSDP ranks resumes on DDP ranks or
one process, and the other way round.

Unlike DDP, whose only collective is the gradient all-reduce after the last backward, FSDP
all-gathers a block's parameters in every forward and backward: every rank must run the same
number of micro-batches (the learner pads a rank's step with weight-0 repeats).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)


def block_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's transformer blocks: modules of the classes it names in ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [module for module in model.modules() if type(module).__name__ in names]


def shard_model(model: torch.nn.Module) -> torch.nn.Module:
    """``fully_shard`` on each block, then the root; in place (the parameters become DTensors)."""
    blocks = block_modules(model)
    if not blocks:
        raise ValueError(f"learner.parallelism=fsdp found no transformer blocks in {type(model).__name__} "
                         f"(it names none in _no_split_modules); use learner.parallelism=ddp for this model")
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict on rank 0's CPU (empty on the other ranks). Every rank must call it."""
    return get_model_state_dict(model, options=_GATHER)


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The whole optimizer state on rank 0 (empty elsewhere), numbered like ``optimizer.state_dict()``
    of an unsharded model. Every rank must call it."""
    by_name = get_optimizer_state_dict(model, optimizer, options=_GATHER)
    if not by_name:
        return {}
    index = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    return {"state": {index[name]: value for name, value in by_name["state"].items()},
            "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                             for group in by_name["param_groups"]]}


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Loads a whole optimizer state (``optimizer.state_dict()`` layout, see
    :func:`full_optimizer_state`) into the sharded optimizer; every rank passes the same state."""
    names = [name for name, _ in model.named_parameters()]
    by_name = {"state": {names[i]: value for i, value in state["state"].items()},
               "param_groups": [{**group, "params": [names[i] for i in group["params"]]}
                                for group in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def set_gradient_sync(model: torch.nn.Module, sync: bool) -> None:
    """FSDP2's ``no_sync``: skip the gradient reduce-scatter while accumulating micro-batches."""
    model.set_requires_gradient_sync(sync)
