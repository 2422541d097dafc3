"""The GPU route for new weights: vLLM's NCCL weight transfer, behind the same engine interface.

On a GPU, reading each published version from disk in the engine (``vllm_engine.py``) costs a copy
through the file system per version; vLLM's native weight-transfer API broadcasts the tensors from
a "trainer" process's GPU straight into the engine's GPU over NCCL. :class:`NCCLVLLMEngine` is a
:class:`~rlhf_pipeline.generation.vllm_engine.VLLMEngine` whose :meth:`update_weights` does that:
the collector's process is the trainer side (NCCL rank 0, vLLM's ``NCCLTrainerWeightTransferEngine``),
the engine's worker is rank 1, and the four phases of vLLM's protocol --
``init_weight_transfer_engine`` once, then per version ``start_weight_update`` ->
``update_weights`` (run on a side thread while this process broadcasts: both sides meet inside the
same NCCL calls) -> ``finish_weight_update`` -- travel over the engine's socket
(``vllm_server.py``'s ``nccl_*`` operations). After the finish the engine re-ties a tied ``lm_head``
and resets its prefix cache, as the file route does. The state dict given to ``update_weights``
(the learner's, on the GPU, in a colocated loop; or a published version loaded to the GPU) is
what is sent, under its checkpoint names; a path is loaded to the GPU first.

A restart (``generation/restarts.py``) works as the file route's, through the same file: a process
started in place of a dead one cannot join the dead one's NCCL group, so it is given the version the
dead one held by the file route's ``load_weights`` (``vllm_held_weights.py`` keeps that file: a
published path hard-linked, a state dict written -- a CPU copy and a disk write per version, made only
while restarts are allowed). This side of the dead group is dropped first, waiting on no peer, and the
next version rendezvouses with the new process in a new group. An engine that dies during a version's
control calls is restarted and sent that version again. Not covered: a death in the middle of the
broadcast itself, where this side can wait in NCCL for the dead peer (vLLM's communicator has no timeout).

What it needs, and why it is not tested here: CUDA on both sides (vLLM's NCCL and IPC transfer
engines are CUDA-only; no upstream CPU engine exists: the GLOO one, vLLM #39097, was closed), and
``vllm`` importable in the collector's own Python (the trainer side is vLLM's code, and the wire
format -- packed buffers -- must match the engine's). ``tests/generation/test_vllm_nccl.py`` runs it
where both hold and is skipped, saying so, elsewhere.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from rlhf_pipeline.generation.engine import EngineDied, UnsupportedSetting
from rlhf_pipeline.generation.vllm_engine import VLLMEngine


class NCCLVLLMEngine(VLLMEngine):
    """:class:`VLLMEngine` with weights sent over NCCL; see the module docstring."""

    name = "vllm-nccl"

    def __init__(self, *args: Any, **options: Any) -> None:
        if options.get("device", "cpu") == "cpu" or not torch.cuda.is_available():
            raise UnsupportedSetting("generation.weight_transfer=nccl needs CUDA here and in the engine (vLLM's NCCL "
                                     "weight transfer is CUDA-only); use generation.weight_transfer=files")
        options["weight_transfer_backend"] = "nccl"
        super().__init__(*args, **options)
        self._sender: Any = None
        self._source = StateDictSource()

    def _load_weights(self, weights: Mapping[str, torch.Tensor] | str | os.PathLike[str], version: int) -> None:
        self.check_no_requests_in_flight(version)
        # what a restarted process is given (vllm_held_weights.py): a published file is linked, at no
        # cost; a state dict costs a CPU copy and a disk write, made only when restarts are allowed
        kept = self.held_weights.prepare(weights, version, write_state_dict=self.restarts.max_restarts > 0)
        try:
            if isinstance(weights, (str, os.PathLike)):
                from safetensors.torch import load_file

                weights = load_file(os.fspath(kept or weights), device="cuda")
            state = {name: tensor.detach().to("cuda") for name, tensor in weights.items()}
            while True:
                try:
                    self._send(state)
                    break
                except EngineDied as died:  # a new process, given the version held before; this one sent again
                    self._restart(died)
            self.restarts.answered()
        except BaseException:
            self.held_weights.discard(kept)
            raise
        self.held_weights.hold(kept, version)

    def _send(self, state: dict[str, torch.Tensor]) -> None:
        self._source.state = state
        try:
            if self._sender is None:  # the first version, or the first after a restart: a new group
                self._sender = self._rendezvous()
            self._sender.send_weights()
        finally:
            self._source.state = {}

    def _rendezvous(self) -> Any:
        """Joins the engine's worker in a two-rank NCCL group (this process is rank 0, the sender)."""
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

        info = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=free_port(), world_size=2, rank=0)
        return NCCLTrainerWeightTransferEngine.trainer_init(info, client=SocketWeightSyncClient(self),
                                                            source=self._source)

    def _restart(self, died: EngineDied) -> None:
        """The group's peer is dead: the sender is dropped before the new process starts (which is
        given the held version from its file, as the files route's), and the next version rendezvouses
        with the new process in a new group."""
        self._drop_sender()
        super()._restart(died)

    def _drop_sender(self) -> None:
        """Ends the sender's side of the NCCL group without waiting on its peer: vLLM's ``shutdown``
        destroys the communicator with ``ncclCommAbort`` (local: it waits on no other rank, unlike
        ``ncclCommDestroy``; run on a thread joined for at most 5 s), and the rendezvous store this
        process served goes with the sender."""
        sender, self._sender = getattr(self, "_sender", None), None
        if sender is not None:
            sender.shutdown()

    def close(self) -> None:
        self._drop_sender()
        super().close()


class SocketWeightSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over the engine's socket: the four control calls of its
    weight transfer. ``update_weights`` is called on vLLM's side thread while this process
    broadcasts; the socket then carries nothing else, so one lock keeps calls whole."""

    def __init__(self, engine: VLLMEngine) -> None:
        self.engine = engine
        self.lock = threading.Lock()

    def _call(self, op: str, **message: Any) -> None:
        with self.lock:  # a hang (restarts.hung_after_s) is killed and restarted as a death, as the files route's
            self.engine.call(op, timeout_s=self.engine.restarts.hung_after_s, hung_is_dead=True, **message)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("nccl_init", init_info=init_info)

    def start_weight_update(self) -> None:
        self._call("nccl_start")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._call("nccl_update", update_info=update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("nccl_finish")


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


def free_port() -> int:
    """A TCP port free on the loopback now (the NCCL rendezvous' store listens on it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])

