"""The vLLM worker extension (``--worker-extension-cls``), called through the server's
``/collective_rpc``, in the vLLM environment (the standard library, torch, safetensors, vllm): it
loads a published version's weights in place (a safetensors path, or its bytes, base64: RPC
arguments arrive as lists), ties a tied ``lm_head`` to the new embedding again and repacks it (on a
CPU vLLM packs weights for oneDNN, and the head would keep the old one), and keeps the shared
server's weights lease (``vllm_lease.py``).
Design: docs/generation.md#a-vllm-server-you-started-generationurl ("The server command").
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
import time

MODEL_SHAPE_KEYS = ("architectures", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "intermediate_size", "tie_word_embeddings")


class PublishedWeightsLoader:
    """Methods added to vLLM's worker; names carry ``published`` so they clash with none of its own."""

    def load_published_weights(self, path: str, lease: str = "") -> dict:
        """Loads the safetensors file at ``path`` (checkpoint names, as ``save_pretrained`` or our
        learner's ``publish_weights`` write them); returns what it loaded, for the caller's checks.
        ``lease``: JSON of the loading round's ``holder``, ``key`` and ``version`` (empty: a load outside
        any lease)."""
        from safetensors.torch import load_file

        return self._reload_published(load_file(path, device="cpu"), lease)

    def load_published_weights_inline(self, encoded: str, lease: str = "") -> dict:
        """The same from the safetensors bytes themselves, base64-encoded (an HTTP ``/collective_rpc``
        passes strings only): for a server that cannot read the client's files."""
        from safetensors.torch import load

        return self._reload_published(load(base64.b64decode(encoded)), lease)

    def _reload_published(self, state: dict, lease: str = "") -> dict:
        self.reload_weights(weights_iterator=iter(state.items()))  # type: ignore[attr-defined]
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        retied = retie_lm_head(model)
        claim = json.loads(lease) if lease else {}
        # every worker loads whatever its lease table says: the weights never differ between workers
        leases = self._published_leases()
        leases.loaded(claim.get("holder"), claim.get("key"), claim.get("version"), float(claim.get("ttl_s", 0.0)),
                      time.monotonic())
        return {"tensors": len(state), "retied_lm_head": retied, "epoch": leases.epoch}

    def published_lease(self, request: str) -> dict:
        """One lease call of a round (JSON: ``op``, ``holder`` and the op's arguments; see
        ``generation/vllm_lease.py``), answered from this server's table."""
        return self._published_leases().call(json.loads(request), time.monotonic())

    def _published_leases(self):
        from rlhf_pipeline.generation.vllm_lease import WeightsLeases

        if getattr(self, "_weights_leases", None) is None:
            self._weights_leases = WeightsLeases()
        return self._weights_leases

    def save_published_adapter(self, name: str, files: str) -> str:
        """Writes a LoRA adapter's PEFT directory sent inline (JSON of ``{file name: base64 bytes}``) under
        this machine's temporary directory, as ``name``; returns its path for ``/v1/load_lora_adapter``,
        which reads a path: for a server that cannot read the client's files."""
        path = _inline_adapter_dir(name)
        os.makedirs(path, exist_ok=True)
        for file_name, encoded in json.loads(files).items():
            with open(os.path.join(path, os.path.basename(file_name)), "wb") as file:
                file.write(base64.b64decode(encoded))
        return path

    def remove_published_adapter(self, name: str) -> None:
        shutil.rmtree(_inline_adapter_dir(name), ignore_errors=True)

    def served_published_lora_modules(self) -> list:
        """The layer names vLLM takes LoRA weights for on this model, as its adapter loader expects them
        (a packed layer by its parts' names: ``q_proj``, not ``qkv_proj``); empty when the server was
        started without ``--enable-lora``. For a client to check a run's targets before any adapter."""
        runner = self.model_runner  # type: ignore[attr-defined]
        if getattr(runner, "lora_manager", None) is None:
            return []
        manager = runner.lora_manager._adapter_manager  # what vLLM's own _load_adapter reads
        served = set()
        for module in manager.supported_lora_modules:
            served.update(manager.packed_modules_mapping.get(module, [module]))
            if module == "experts":  # a MoE layer's adapter is named by it too
                served.add(module)
        return sorted(served)

    def describe_published_model(self) -> dict:
        """The served model's shape, for a client that must check it serves the pipeline's model
        before it sends weights (``generation/vllm_url.py``): what a state dict's keys and shapes
        depend on."""
        config = self.model_runner.get_model().config  # type: ignore[attr-defined]
        return {key: getattr(config, key, None) for key in MODEL_SHAPE_KEYS}

    def retie_published_head(self) -> bool:
        """After vLLM's own weight transfer (the NCCL route): the tied head, as after a file load."""
        return retie_lm_head(self.model_runner.get_model())  # type: ignore[attr-defined]


def _inline_adapter_dir(name: str) -> str:
    return os.path.join(tempfile.gettempdir(), "rlhf-published-adapters", os.path.basename(name))


def retie_lm_head(model) -> bool:
    """Ties ``model.lm_head`` to the embedding again and repacks it; False when the head is not tied."""
    config = getattr(model, "config", None)
    head = getattr(model, "lm_head", None)
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if not getattr(config, "tie_word_embeddings", False) or head is None or embed is None:
        return False
    # the reload may have replaced the embedding's parameter: the head must point at the new one
    head.weight = embed.weight
    method = getattr(head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(head)
    return True
