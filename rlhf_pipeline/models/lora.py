"""LoRA adapters as policy versions: what one is, how the learner makes one, how an engine applies it.

In a LoRA run (``learner.lora.rank > 0``) every version after 0 (the frozen base) is a :class:`PolicyAdapter`:
peft's ``adapter_model.safetensors`` tensors and ``adapter_config.json``, the digest of the base they were
trained on, and the *canary*, the learner's own log-probs of fixed tokens under that version. An engine
merges it (:class:`AdapterMerger`: ``W = W0 + (alpha / r) * B @ A`` on each target layer), then scores the
canary with the model it samples with (:func:`canary_difference`): a stale adapter, the base sampled, or
another base is refused naming the version (:func:`served_policy_failure`), before any row of it exists.
Merging needs torch only; the trainable model needs ``peft`` (the ``[lora]`` extra).
Design: docs/lora.md#how-the-loop-engine-samples-an-adapter-version.
"""

from __future__ import annotations

import enum
import hashlib
import json
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

ADAPTER_KIND = "lora_adapter"
"""The ``kind`` in a published adapter's safetensors metadata (full weights have none)."""
_PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"
CANARY_SEED = 44
CANARY_SHAPE = (2, 16)  # two sequences of 16 tokens: 30 scored log-probs
CANARY_PROMPT_TOKENS = 144
"""A served canary prompt's length: more than one KV-cache block (128 tokens on vLLM's CPU, 16 on a
GPU), so a server that reuses blocks cached under another version's adapter scores it wrong."""
CANARY_NEW_TOKENS = 8


def peft_or_explain():
    """``peft``, or an ImportError that says how to install it."""
    try:
        import peft
    except ImportError:
        raise ImportError("learner.lora.rank > 0 needs peft: pip install -e '.[lora]'") from None
    return peft


class PolicyAdapter(dict):
    """One published adapter version: ``{peft tensor name: tensor}`` plus what goes with it.

    ``base``: the base's whole state dict, attached by a weights poller to the first adapter it hands
    an engine that has not loaded the base yet (a collector resumed past version 0)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], *, config: Mapping[str, Any], base_digest: str,
                 canary: Mapping[str, Any] | None = None, base: Mapping[str, torch.Tensor] | None = None) -> None:
        super().__init__(tensors)
        self.config = dict(config)
        self.base_digest = base_digest
        self.canary = dict(canary) if canary is not None else None
        self.base = base

    @property
    def scaling(self) -> float:
        return float(self.config["lora_alpha"]) / float(self.config["r"])

    @property
    def layer_names(self) -> list[str]:
        """The names of the layers it adapts, as ``learner.lora.target_modules`` names them (``q_proj``)."""
        return sorted({layer.rsplit(".", 1)[-1] for _, layer in _adapted_weights(self)})

    def metadata(self) -> dict[str, str]:
        """The safetensors metadata a published version carries (strings only)."""
        meta = {"kind": ADAPTER_KIND, "adapter_config": json.dumps(self.config, sort_keys=True),
                "base_digest": self.base_digest}
        if self.canary is not None:
            meta["canary"] = json.dumps(self.canary)
        return meta

    @classmethod
    def from_metadata(cls, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> PolicyAdapter:
        canary = metadata.get("canary")
        return cls(tensors, config=json.loads(metadata["adapter_config"]), base_digest=metadata["base_digest"],
                   canary=json.loads(canary) if canary else None)

    def save_peft_directory(self, directory) -> None:
        """Writes ``adapter_model.safetensors`` and ``adapter_config.json``: what ``PeftModel.from_pretrained``
        and vLLM's ``LoRARequest`` read."""
        from pathlib import Path

        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.items()}, str(directory / "adapter_model.safetensors"),
                  metadata={"format": "pt"})
        (directory / "adapter_config.json").write_text(json.dumps(self.config, indent=2, sort_keys=True) + "\n")


def is_adapter_metadata(metadata: Mapping[str, str] | None) -> bool:
    return bool(metadata) and metadata.get("kind") == ADAPTER_KIND


# ====================================================================== the learner's side
def lora_config(rank: int, alpha: float, dropout: float, target_modules: Sequence[str]):
    return peft_or_explain().LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout,
                                        target_modules=list(target_modules), bias="none")


def check_target_modules(model: torch.nn.Module, target_modules: Sequence[str]) -> None:
    """One ValueError naming the setting when a target names no linear layer of ``model``."""
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    missing = [t for t in target_modules if t not in names]
    if missing:
        raise ValueError(f"setting 'learner.lora.target_modules' names {missing}, which no linear layer of the "
                         f"model is called; its linear layers: {sorted(names)}: name some of those (comma-separated)")


def with_lora(model: torch.nn.Module, rank: int, alpha: float, dropout: float,
              target_modules: Sequence[str]) -> torch.nn.Module:
    """``model`` (its weights frozen) with a fresh adapter (B = 0: the same function as ``model``); its
    targets checked first (:func:`check_target_modules`: the learner's ``LoraPolicy.wrap``)."""
    peft = peft_or_explain()
    with warnings.catch_warnings():  # transformers' deprecation notice for an attribute peft reads
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return peft.get_peft_model(model, lora_config(rank, alpha, dropout, target_modules))


def adapter_tensors(peft_model) -> dict[str, torch.Tensor]:
    """The adapter's tensors under peft's saved names (CPU copies)."""
    state = peft_or_explain().get_peft_model_state_dict(peft_model)
    return {name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in state.items()}


def load_adapter_tensors(peft_model, tensors: Mapping[str, torch.Tensor]) -> None:
    result = peft_or_explain().set_peft_model_state_dict(peft_model, dict(tensors))
    unexpected = getattr(result, "unexpected_keys", None) or []
    if unexpected:
        raise ValueError(f"the adapter does not fit the model: unexpected tensors {unexpected[:3]}")


def adapter_config_of(peft_model) -> dict[str, Any]:
    """``adapter_config.json``'s content (JSON types only: sets become sorted lists)."""
    config = peft_model.peft_config["default"].to_dict()

    def plain(value):
        if isinstance(value, enum.Enum):  # PeftType.LORA (a str enum) -> "LORA": checkpoints hold plain values
            return value.value
        if isinstance(value, (set, frozenset)):
            return sorted(value)
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    return {key: plain(value) for key, value in config.items()}


def base_model_of(peft_model) -> torch.nn.Module:
    """The transformers model inside a peft model (its layers carry the adapters)."""
    return peft_model.base_model.model


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 over the names, dtypes, shapes and bytes of ``state``: which base an adapter belongs to."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


# ====================================================================== the canary
def canary_tokens(vocab_size: int) -> list[list[int]]:
    """Fixed token ids, the same for every version of every run with this vocabulary."""
    generator = torch.Generator().manual_seed(CANARY_SEED)
    return torch.randint(0, vocab_size, CANARY_SHAPE, generator=generator).tolist()


@torch.no_grad()
def canary_log_probs(model: torch.nn.Module, tokens: Sequence[Sequence[int]]) -> list[list[float]]:
    """``log p(tokens[i, t] | tokens[i, :t])`` for t >= 1, temperature 1, in float32; ``model`` in
    eval mode for the call (no dropout), left as it was."""
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        ids = torch.tensor(tokens, dtype=torch.long, device=device)  # (S, T)
        logits = model(input_ids=ids).logits.float()[:, :-1]  # (S, T-1, V)
        scored = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (S, T-1)
        return scored.cpu().tolist()
    finally:
        model.train(was_training)


def canary_of(model: torch.nn.Module, vocab_size: int, version: int) -> dict[str, Any]:
    """The learner's canary of ``version``: the version it belongs to, the tokens and their log-probs."""
    tokens = canary_tokens(vocab_size)
    return {"version": int(version), "tokens": tokens, "log_probs": canary_log_probs(model, tokens)}


def canary_prompts(vocab_size: int, length: int = CANARY_PROMPT_TOKENS) -> list[list[int]]:
    """Fixed prompts a server samples from under each version (the canary through its sampling path):
    the same for every version, so each version's prompt meets the previous version's cached blocks."""
    generator = torch.Generator().manual_seed(CANARY_SEED + 1)
    return torch.randint(0, vocab_size, (CANARY_SHAPE[0], length), generator=generator).tolist()


def served_policy_failure(version: int, difference: float, tolerance: float, scored: str) -> str:
    """The one line that refuses a version the engine does not serve as the learner published it;
    ``scored``: whose log-probs of which tokens were compared."""
    return (f"served-policy check failed for weights version {version}: {scored} differ from the learner's by up "
            f"to {difference:.4g} (tolerance {tolerance:g}); it does not sample the adapter the learner published "
            f"as version {version}, so no row of it is stored")


def zero_adapter(model: torch.nn.Module, rank: int, alpha: float, target_modules: Sequence[str]) -> PolicyAdapter:
    """An adapter of ``rank`` on ``model``'s layers named in ``target_modules`` whose update is zero
    (B = 0): what an engine loads before any row to learn it serves this run's adapters, and whose
    log-probs must be the base's. Built without peft, in peft's names and config."""
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in target_modules:
            tensors[_PREFIX + name + _A] = torch.zeros(rank, module.in_features)
            tensors[_PREFIX + name + _B] = torch.zeros(module.out_features, rank)
    config = {"peft_type": "LORA", "r": int(rank), "lora_alpha": float(alpha), "lora_dropout": 0.0,
              "target_modules": sorted(target_modules), "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "use_dora": False, "modules_to_save": None}
    return PolicyAdapter(tensors, config=config, base_digest="")


def canary_tolerance(dtype: torch.dtype) -> float:
    """Largest |difference| of one log-prob between learner (peft, float32) and engine (merged, ``dtype``)."""
    return 1e-3 if dtype in (torch.float32, torch.float64) else 0.15


def canary_difference(model: torch.nn.Module, adapter: PolicyAdapter, version: int) -> tuple[float, float]:
    """``(difference, tolerance)``: the largest |log-prob difference| between ``model`` (as an engine
    samples with it) and the learner's canary published with ``adapter`` as ``version``, and the most
    allowed. ValueError when the adapter carries no canary, or another version's."""
    if adapter.canary is None:
        raise ValueError("an adapter without the learner's canary log-probs: the served policy cannot be checked")
    if adapter.canary["version"] != version:  # a file of another version under this number (a stale copy)
        raise ValueError(f"it holds the adapter the learner published as version {adapter.canary['version']}")
    served = torch.tensor(canary_log_probs(model, adapter.canary["tokens"]))
    expected = torch.tensor(adapter.canary["log_probs"])
    return float((served - expected).abs().max()), canary_tolerance(next(model.parameters()).dtype)


# ====================================================================== the engine's side
@dataclass
class _Target:
    weight: torch.nn.Parameter
    base: torch.Tensor  # W0, the base's weight, kept to merge each new version from


class AdapterMerger:
    """Applies adapter versions to a model that holds the base: ``W = W0 + scaling * B @ A`` on each
    target layer (from the base's weights, kept here: the target layers' weights only). Which base it
    is, the canary tells (:func:`canary_difference`): an adapter merged into another base gives other
    log-probs than the learner's."""

    def __init__(self) -> None:
        self._targets: dict[str, _Target] = {}
        self._has_base = False

    def set_base(self) -> None:
        """The engine's model holds whole weights now (just loaded): they are the base of what follows."""
        self._targets = {}
        self._has_base = True

    def apply(self, model: torch.nn.Module, adapter: PolicyAdapter, version: int) -> None:
        if not self._has_base:
            raise ValueError(f"weights version {version} is an adapter, and this engine holds no base to apply it "
                             f"to (the base, version 0, never reached it)")
        parameters = dict(model.named_parameters())
        with torch.no_grad():
            for key, layer in _adapted_weights(adapter):
                if key not in parameters or layer + _B not in adapter:
                    raise ValueError(f"weights version {version}: adapter tensor {layer + _A} names no layer of the "
                                     f"engine's model ({key})")
                target = self._targets.get(key)
                if target is None:
                    weight = parameters[key]
                    target = self._targets[key] = _Target(weight, weight.detach().clone())
                merged = target.base.float() + _delta(adapter, layer, target.base.device)
                target.weight.copy_(merged.to(target.weight.dtype))


def merged_state(base: Mapping[str, torch.Tensor], adapter: PolicyAdapter) -> dict[str, torch.Tensor]:
    """The whole policy of an adapter version: ``base`` (version 0's state dict) with the adapter merged."""
    state = dict(base)
    for key, layer in _adapted_weights(adapter):
        if key not in state:
            raise ValueError(f"adapter tensor {layer + _A} names no weight of the base ({key})")
        w0 = state[key]
        state[key] = (w0.float() + _delta(adapter, layer, w0.device)).to(w0.dtype)
    return state


def _adapted_weights(adapter: PolicyAdapter) -> Iterator[tuple[str, str]]:
    """(the weight's key in a model's state dict, the adapter's name of its layer) of each layer the
    adapter changes."""
    for name in adapter:
        if name.endswith(_A):
            layer = name[:-len(_A)]
            yield (layer[len(_PREFIX):] if layer.startswith(_PREFIX) else layer) + ".weight", layer


def _delta(adapter: PolicyAdapter, layer: str, device: torch.device) -> torch.Tensor:
    """``scaling * B @ A`` of one adapted layer, in float32 on ``device``: what merging adds to its weight."""
    a = adapter[layer + _A].to(device=device, dtype=torch.float32)
    b = adapter[layer + _B].to(device=device, dtype=torch.float32)
    return adapter.scaling * (b @ a)
