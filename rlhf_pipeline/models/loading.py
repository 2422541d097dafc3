"""Loading real Hugging Face models and tokenizers from a LOCAL directory (never the Hub).

Every loader passes ``local_files_only=True`` and fails with :class:`ModelLoadError` naming the
path and what was expected there. transformers' progress bars show on a terminal only. Design:
docs/architecture.md#models-and-tokenizers.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


class ModelLoadError(ValueError):
    """A model or tokenizer path does not hold what the loader needs."""


# what from_pretrained raises for a directory that is not a whole model: a config that is not JSON, a
# weights file cut short (safetensors' own error), weights of other sizes than the config's (RuntimeError)
_UNLOADABLE = (OSError, ValueError, KeyError, RuntimeError, SafetensorError)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _check_dir(path: str | Path, what: str) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(
            f"{what} path {str(p)!r} does not exist; pass a local directory written by "
            f"save_pretrained() (models are never downloaded here)"
        )
    if not p.is_dir():
        raise ModelLoadError(f"{what} path {str(p)!r} is a file; pass the directory that holds it")
    return p


@contextmanager
def transformers_bars_off() -> Iterator[None]:
    """No transformers progress bar inside the block (``save_pretrained``'s "Writing model shards",
    ``from_pretrained``'s "Loading weights"); as it was after it. Ours (tqdm's own) are untouched."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


@contextmanager
def _load_progress(what: str, path: Path) -> Iterator[None]:
    """transformers' weight-loading bar on a terminal; a line before and after in a log."""
    if sys.stderr.isatty():
        yield
        return
    print(f"[models] loading {what} from {path}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    with transformers_bars_off():
        yield
    print(f"[models] loaded {what} in {time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype | str:
    """``"auto"`` (the checkpoint's dtype), a torch dtype, or one of float32/bf16/fp16 names."""
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ModelLoadError(f"dtype {dtype!r} is not one of 'auto', {sorted(_DTYPES)}") from None


def load_model(
    path: str | Path, *, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu"
) -> PreTrainedModel:
    """A causal LM from ``path`` (``config.json`` + weights), on ``device``, in eval mode."""
    torch_dtype = resolve_dtype(dtype)
    p = _check_dir(path, "model")
    if not (p / "config.json").is_file():
        raise ModelLoadError(
            f"{str(p)!r} has no config.json, so it is not a Hugging Face model directory "
            f"(found: {sorted(x.name for x in p.iterdir())[:10]})"
        )
    if not any((p / name).is_file() for name in _WEIGHT_FILES):
        raise ModelLoadError(f"{str(p)!r} has a config.json but no weights (expected one of {_WEIGHT_FILES})")
    try:
        with _load_progress("a causal LM", p):
            model = AutoModelForCausalLM.from_pretrained(p, dtype=torch_dtype, local_files_only=True)
    except _UNLOADABLE as exc:
        raise ModelLoadError(f"could not load a causal LM from {str(p)!r}: {_first_line(exc)}") from exc
    return model.to(device).eval()


def load_reward_model(
    path: str | Path, *, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu"
) -> PreTrainedModel:
    """A sequence-classification model (the reward model) from ``path``, in eval mode."""
    torch_dtype = resolve_dtype(dtype)
    p = _check_dir(path, "reward model")
    if not (p / "config.json").is_file():
        raise ModelLoadError(f"{str(p)!r} has no config.json, so it is not a Hugging Face model directory")
    try:
        with _load_progress("a reward model", p):
            model = AutoModelForSequenceClassification.from_pretrained(
                p, dtype=torch_dtype, local_files_only=True
            )
    except _UNLOADABLE as exc:
        raise ModelLoadError(f"could not load a sequence-classification model from {str(p)!r}: "
                             f"{_first_line(exc)}") from exc
    return model.to(device).eval()


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """A tokenizer from ``path``; pads on the left and has a pad token (EOS if it had none)."""
    p = _check_dir(path, "tokenizer")
    if not any((p / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        raise ModelLoadError(
            f"{str(p)!r} holds no tokenizer files (tokenizer.json or tokenizer_config.json); "
            f"save one there with tokenizer.save_pretrained()"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(p, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"could not load a tokenizer from {str(p)!r}: {exc}") from exc
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelLoadError(f"tokenizer at {str(p)!r} has neither a pad nor an EOS token; set one")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def state_dict_misfit(expected: dict, found: dict) -> str | None:
    """How the tensors ``found`` do not fit a model whose state dict is ``expected``, in words, or None."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    shapes = [f"{k}: {tuple(found[k].shape)} vs {tuple(expected[k].shape)}" for k in sorted(set(found) & set(expected))
              if found[k].shape != expected[k].shape]
    problems = [f"{len(missing)} missing weights (e.g. {missing[:3]})" if missing else "",
                f"{len(unexpected)} unexpected weights (e.g. {unexpected[:3]})" if unexpected else "",
                f"shape mismatches (found vs the model): {'; '.join(shapes[:3])}" if shapes else ""]
    return ", ".join(p for p in problems if p) or None


def load_state_dict_file(model: torch.nn.Module, path: str | Path, what: str) -> None:
    """Loads into ``model`` the state dict ``torch.save`` wrote to ``path`` (``what`` names where the path
    came from, e.g. a setting); a file torch cannot read with ``weights_only``, or the weights of
    another model, is one :class:`ModelLoadError` that says which."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle's, zipfile's or torch's own error for a file it did not write
        raise ModelLoadError(f"{what}: {path} is not a file torch.save wrote (torch.load with weights_only "
                             f"refused it: {type(exc).__name__}); give model.state_dict() saved with "
                             f"torch.save") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ModelLoadError(f"{what}: {path} holds a {type(state).__name__}, not a state dict of tensors; give "
                             f"model.state_dict() saved with torch.save")
    if (misfit := state_dict_misfit(model.state_dict(), state)) is not None:
        raise ModelLoadError(f"{what}: {path} holds the weights of another model ({misfit}); give the weights of "
                             f"a model built with the same settings")
    model.load_state_dict(state)
