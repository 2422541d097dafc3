"""The GPU route for new weights: :class:`NCCLVLLMEngine`, the collector's own ``VLLMEngine`` whose
``load_weights`` broadcasts the tensors from this process to the server's worker over vLLM's NCCL
weight transfer, then re-ties a tied head and resets the prefix cache, as the file route does. A
restart is the file route's (the held version's file). Not covered: a death mid-broadcast (NCCL has
no timeout there). Needs CUDA on both sides and ``vllm`` in the collector's Python.
Design: docs/generation.md#running-a-pipeline-with-it (the NCCL route).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from rlhf_pipeline.generation.vllm_engine import VLLMEngine
from rlhf_pipeline.processes import free_port
from rlhf_pipeline.generation.vllm_setup import check_nccl_device


class NCCLVLLMEngine(VLLMEngine):
    """:class:`VLLMEngine` with weights sent over NCCL; see the module docstring."""

    name = "vllm-nccl"

    def __init__(self, *args: Any, **options: Any) -> None:
        # before the base's start-up, whose first load (the model's weights) goes over NCCL too
        self._sender, self._sender_generation, self._source = None, -1, StateDictSource()
        super().__init__(*args, **options)

    @classmethod
    def from_model(cls, model: Any, **options: Any) -> NCCLVLLMEngine:
        check_nccl_device(options.get("device", "cpu") if torch.cuda.is_available() else "cpu")
        options["weight_transfer_backend"] = "nccl"
        return super().from_model(model, **options)

    def _load(self, weights: Mapping[str, torch.Tensor] | str | os.PathLike[str], version: int) -> None:
        kept = self.weights.keep(weights, version)  # what a restarted server is given: a published file linked
        if not isinstance(weights, Mapping):
            from safetensors.torch import load_file

            weights = load_file(os.fspath(kept), device="cuda")
        self._source.state = {name: tensor.detach().to("cuda") for name, tensor in weights.items()}
        try:
            while True:
                seen = self.server.generation
                try:
                    self._send()
                    break
                except OSError as exc:  # the server went away under the transfer: a new one, then again
                    self._drop_sender()
                    if not self.server.revive(seen, f"{type(exc).__name__}: {exc}", "/update_weights", self.retries):
                        raise
        finally:
            self._source.state = {}
        self.weights.hold(kept, version)

    def _send(self) -> None:
        if self._sender is None or self._sender_generation != self.server.generation:
            self._drop_sender()  # the first version, or the first to a new server: a new group
            self._sender, self._sender_generation = self._rendezvous(), self.server.generation
        self._sender.send_weights()
        self.client.post("/collective_rpc", {"method": "retie_published_head"})
        self.weights.reset_prefix_cache()

    def _rendezvous(self) -> Any:
        """Joins the server's worker in a two-rank NCCL group (this process is rank 0, the sender)."""
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

        info = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=free_port(), world_size=2, rank=0)
        client = HTTPVLLMWeightSyncClient(self.client.base_url, timeout=self.client.retries.reply_timeout_s)
        return NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=self._source)

    def _drop_sender(self) -> None:
        """Ends the sender's side of the NCCL group without waiting on its peer: vLLM's ``shutdown``
        destroys the communicator with ``ncclCommAbort`` (local: it waits on no other rank)."""
        sender, self._sender = self._sender, None
        if sender is not None:
            sender.shutdown()

    def close(self) -> None:
        self._drop_sender()
        super().close()


class StateDictSource:
    """vLLM's ``WeightSource`` over a state dict (checkpoint names), set before each send.

    Duck-typed rather than subclassed so this module imports vllm only when a transfer starts; the
    trainer engine calls ``metadata()``, iterates, and may call ``held_names``/``groups``."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}

    def metadata(self) -> list[Any]:
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in self.state.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.state.items()

    def held_names(self) -> None:
        return None
