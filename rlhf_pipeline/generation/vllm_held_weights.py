"""The weights a restarted vLLM engine is given: :class:`HeldWeights`, one file per engine.

An engine's process loads the model directory first (version 0, or the version it started with) and
then each version it is sent. When the process dies (``generation/restarts.py``), the new one
starts from the model directory again and must be given the version the dead one held, from a file,
since nothing of the dead process survives. Both weight routes keep that file here, in the engine's
scratch directory:

* a published safetensors file is hard-linked there (no copy: the learner pruning the published
  version does not lose it; on another file system, where no link can be made, the published path
  itself is kept and never removed by the engine);
* a state dict (a colocated learner's, or a legacy ``.pt`` publication) is written there. The files
  route loads every version from such a file anyway; the NCCL route sends a state dict straight
  from the GPU and writes it only when restarts are allowed (``write_state_dict``), since it then
  costs a copy to the CPU and a disk write per version that the transfer itself does not need.

A version's file replaces the previous one only once the engine holds it (:meth:`HeldWeights.hold`):
until then a restart reloads the older one, which is what the engine held. The superseded file is
then removed, as is a new one whose load failed (:meth:`HeldWeights.discard`), so the directory holds
one version's weights at a time. A version held but not kept (the NCCL route with restarts off) makes
a restart refuse, naming the setting, rather than give the new process other weights than the dead one's.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch

from rlhf_pipeline.generation.engine import EngineFailed
from rlhf_pipeline.generation.vllm_process import hard_link


class HeldWeights:
    """The file holding the weights an engine's process holds, past its model directory's; see the module docstring."""

    def __init__(self, work_dir: Path) -> None:
        self.work_dir = Path(work_dir)
        self.path: Path | None = None
        """The file of the version the engine holds; None: its model directory's (or one not kept)."""
        self.unkept_version: int | None = None
        """The version the engine holds when it was not kept as a file (a restart cannot restore it)."""

    def file_for(self, version: int) -> Path:
        return self.work_dir / f"weights-{version:08d}.safetensors"

    def prepare(self, weights: Mapping[str, torch.Tensor] | str | os.PathLike[str], version: int, *,
                write_state_dict: bool = True) -> Path | None:
        """The file ``version``'s weights are kept in (not yet held): a published safetensors file
        hard-linked here, a state dict or a legacy ``.pt`` publication written here; None when a state
        dict is given and ``write_state_dict`` is off."""
        if isinstance(weights, (str, os.PathLike)) and Path(weights).suffix == ".safetensors":
            return hard_link(Path(weights).resolve(), self.file_for(version))
        if isinstance(weights, (str, os.PathLike)):  # a legacy .pt publication: the engine loads safetensors
            weights = torch.load(weights, map_location="cpu", weights_only=True)["state_dict"]
        elif not write_state_dict:
            return None
        return self._write(weights, version)

    def _write(self, state_dict: Mapping[str, torch.Tensor], version: int) -> Path:
        from safetensors.torch import save_file

        path = self.file_for(version)
        partial = path.with_suffix(".partial")
        # own contiguous CPU copies: safetensors refuses tensors that share memory (a tied head); written
        # beside and renamed, so a restart never reads half a file
        save_file({name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in state_dict.items()},
                  str(partial))
        partial.replace(path)
        return path

    def hold(self, path: Path | None, version: int) -> None:
        """The engine now holds ``version``, kept in ``path`` (None: not kept); the file it held before
        is removed when it lies in the scratch directory and is not ``path``."""
        old, self.path = self.path, path
        self.unkept_version = version if path is None else None
        if old is not None and old != path and old.parent == self.work_dir:
            old.unlink(missing_ok=True)

    def discard(self, path: Path | None) -> None:
        """A prepared file whose version the engine did not come to hold: removed (the held one stays)."""
        if path is not None and path != self.path and path.parent == self.work_dir:
            path.unlink(missing_ok=True)

    def restore_path(self, died: Exception) -> Path | None:
        """The file a process started in place of one that ``died`` is given (None: its model directory
        is what it held); EngineFailed, naming the setting and keeping ``died``'s message (the engine's
        log), when the held version was not kept."""
        if self.unkept_version is not None:
            raise EngineFailed(f"the engine died holding version {self.unkept_version}, sent over NCCL and not kept "
                               f"as a file (generation.max_restarts was 0 when it was sent), so a new process cannot "
                               f"be given it: keep generation.max_restarts > 0 from the start, then rerun to resume: "
                               f"{died}") from None
        return self.path
