"""The vocabulary a buffer's token ids are checked against (``inspect --verify``, ``repair``): the
one given (``--vocab-size``), else a run directory's model's, read from its newest published
weights' header (safetensors, no torch): the rows of its input embedding, which is what a learner
indexes with every stored id. Design: docs/buffer-tools.md#inspect-verify.
"""

from __future__ import annotations

from pathlib import Path

from rlhf_pipeline.cli import CommandRefused


def check_vocab_size(given: int | None) -> None:
    """Refuses a ``--vocab-size`` that is not a size token ids can have: they are stored as int32."""
    if given is None:
        return
    from rlhf_pipeline.schema.fields import TOKEN_ID_MAX  # imports torch: only once there is a size to check

    if not 1 <= given <= TOKEN_ID_MAX + 1:
        raise CommandRefused(f"--vocab-size must be in [1, {TOKEN_ID_MAX + 1}] (token ids are stored as int32), "
                             f"got {given}")


def model_vocabulary(given: int | None, run: str | Path | None) -> tuple[int | None, str]:
    """The vocabulary size token ids are checked against (``given``, else the run's model's when
    ``run`` is a local run directory), and where it came from; or None and why there is none."""
    if given is not None:
        return given, "--vocab-size"
    if run is None:
        return None, "a bare buffer: pass --vocab-size N to check its token ids against the model's vocabulary"
    if "://" in str(run):
        return None, "a run at a URL: pass --vocab-size N to check its token ids against the model's vocabulary"
    from rlhf_pipeline.coordination.weights import latest_version, weights_path

    version = latest_version(run)
    if version is None:
        return None, f"{run} has published no weights to read its model's vocabulary from; pass --vocab-size N"
    path = weights_path(run, version)
    if path.suffix != ".safetensors":
        return None, f"{path} is not a safetensors file; pass --vocab-size N"
    from safetensors import safe_open

    with safe_open(str(path), "np") as weights:
        for key in weights.keys():
            if key.endswith(EMBEDDING_KEYS):
                return int(weights.get_slice(key).get_shape()[0]), f"{key} in {path}"
    return None, f"no input embedding ({', '.join(EMBEDDING_KEYS)}) in {path}; pass --vocab-size N"


EMBEDDING_KEYS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")
"""How transformers' causal LMs name their input embedding in a state dict (Qwen2 and Llama, GPT-2,
BLOOM, GPT-NeoX): its rows are the model's vocabulary."""
