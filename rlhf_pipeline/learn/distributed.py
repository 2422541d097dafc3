"""Data-parallel learner ranks: N processes train one policy over one run directory and buffer.

Started by ``torchrun --nproc-per-node N -m rlhf_pipeline.cli.main learn PIPELINE.py``, which
sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (and the rendezvous address) in each
process; :meth:`DataParallel.from_torchrun_env` reads them. Without them there is one rank and
every method here is the identity, so the single-process learner pays nothing.

What makes N ranks train exactly like one:

* **The same draws.** Every rank builds the same sampler from the shared seed, so draw ``d``
  names the same global positions on every rank (``learner.batch_size`` stays the global
  batch). Each rank reads only its own contiguous slice of them (:meth:`local_positions`).
  Before each step the ranks compare a fingerprint of the draw (:meth:`check_same_draw`) and
  stop with an error if they disagree (a sampler that saw a different buffer), rather than
  train on overlapping rows.
* **The same loss.** The loss is normalized by the *global* batch: every rank weighs its
  micro-batches by their share of the global response tokens (``token_mean``) or rows (the
  other aggregations), counted with one all-reduce (:meth:`sum_counts`). The sum over ranks
  of the weighted micro-batch losses is then the 1-rank loss of the whole batch. DDP
  averages gradients over ranks, so each rank scales its loss by ``world_size``
  (:attr:`loss_scale`); gradients are all-reduced once per step, on the last micro-batch
  (:meth:`sync_unless`, DDP's ``no_sync`` before it).
* **Every rank takes part in every step.** A rank whose slice is empty (a global batch
  smaller than the number of ranks, an epoch's short last batch) or whose rows all went
  stale trains on a *filler*: one row of its batch with loss weight 0, so DDP's all-reduce
  still runs on every rank and adds nothing.

Only rank 0 writes: weights, checkpoints, metrics, TensorBoard, ``pacing.json``. Every rank
loads the same newest checkpoint, which holds the global draw count and the unwrapped
model, so a checkpoint resumes with any number of ranks. Backend: gloo on CPU, NCCL on CUDA
(rank ``r`` uses ``cuda:LOCAL_RANK``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from tensordict import TensorDict

#: the per-row flag of a filler batch (see the module docstring): its rows carry no loss
FILLER_KEY = "data_parallel_filler"


@dataclass
class DataParallel:
    """This process's place among the learner ranks; ``world_size == 1`` is the plain learner."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size or self.local_rank < 0:
            raise ValueError(f"data-parallel rank {self.rank} of world size {self.world_size} (local rank "
                             f"{self.local_rank}) is impossible: need 0 <= rank < world_size and local_rank >= 0")
        self._started_here = False

    @classmethod
    def from_torchrun_env(cls, environ: Mapping[str, str] | None = None) -> DataParallel:
        """The ranks torchrun describes in ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``; one rank without them."""
        environ = os.environ if environ is None else environ
        if "WORLD_SIZE" not in environ:
            return cls()
        values = {}
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            raw = environ.get(name, "0" if name == "LOCAL_RANK" else None)
            try:
                values[name] = int(raw)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                raise ValueError(f"environment variable {name}={raw!r} is not an integer; start the data-parallel "
                                 f"learner with torchrun, which sets RANK, WORLD_SIZE and LOCAL_RANK") from None
        return cls(rank=values["RANK"], world_size=values["WORLD_SIZE"], local_rank=values["LOCAL_RANK"])

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the only rank that writes files."""
        return self.rank == 0

    @property
    def loss_scale(self) -> float:
        """DDP averages gradients over ranks; the losses here are already global shares, so undo it."""
        return float(self.world_size)

    # ------------------------------------------------------------------ process group
    def device_for(self, device: torch.device) -> torch.device:
        """``cuda`` becomes this rank's own GPU (``cuda:LOCAL_RANK``); CPU stays CPU."""
        if self.enabled and device.type == "cuda":
            return torch.device("cuda", self.local_rank)
        return device

    def start(self, device: torch.device) -> None:
        """Joins the process group (gloo on CPU, NCCL on CUDA); torchrun's env gives the rendezvous."""
        if not self.enabled or dist.is_initialized():
            return
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(self.device_for(device))
        dist.init_process_group(backend, rank=self.rank, world_size=self.world_size)
        self._started_here = True

    def stop(self) -> None:
        if self._started_here and dist.is_initialized():
            dist.destroy_process_group()
            self._started_here = False

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """The module forward/backward run through: DDP over the ranks, or ``model`` itself."""
        if not self.enabled:
            return model
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.device_for(device).index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)

    # ------------------------------------------------------------------ data
    def local_positions(self, positions: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """This rank's contiguous slice of a draw's global positions (or of any per-row values of the
        draw, e.g. importance weights), and whether it is a filler (an empty slice replaced by the
        draw's first row, to be trained with weight 0)."""
        if not self.enabled:
            return positions, False
        mine = torch.tensor_split(positions, self.world_size)[self.rank]
        if mine.numel() == 0:
            return positions[:1], True
        return mine, False

    @staticmethod
    def mark_filler(batch: TensorDict, filler: bool) -> TensorDict:
        batch[FILLER_KEY] = torch.full((batch.batch_size[0],), filler, dtype=torch.bool, device=batch.device)
        return batch

    @staticmethod
    def is_filler(batch: TensorDict) -> bool:
        return FILLER_KEY in batch.keys() and bool(batch[FILLER_KEY].all())

    def check_same_draw(self, draw: int, positions: torch.Tensor) -> None:
        """Raises on every rank when the ranks drew different global positions for ``draw``."""
        if not self.enabled:
            return
        digest = hashlib.blake2b(positions.to(torch.int64).numpy().tobytes(), digest_size=7).digest()
        mine = torch.tensor([draw, int.from_bytes(digest, "little")], dtype=torch.int64)
        everyone = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(everyone, mine)
        if any(not torch.equal(other, mine) for other in everyone):
            raise RuntimeError(
                f"data-parallel ranks drew different rows for draw {draw}: their samplers saw different "
                f"buffers (a sampler that waits for new rows while collectors write). Train over a recorded "
                f"buffer (learner.sampler=epoch, or window/groups with learner.new_rows_per_step=0), or one rank")

    # ------------------------------------------------------------------ reductions
    def any_rank(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on any: ranks stop at the same step."""
        if not self.enabled:
            return flag
        box = torch.tensor([int(flag)], dtype=torch.int64)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        return bool(box.item())

    def gather_flags(self, flags: np.ndarray) -> np.ndarray:
        """Every rank's per-row flags concatenated in rank order: the global draw's order."""
        if not self.enabled:
            return flags
        gathered: list[np.ndarray | None] = [None] * self.world_size
        dist.all_gather_object(gathered, np.asarray(flags, dtype=bool))
        return np.concatenate(gathered)

    def sum_counts(self, *counts: float) -> list[float]:
        """Each count summed over the ranks (one all-reduce)."""
        if not self.enabled:
            return [float(c) for c in counts]
        values = torch.tensor(counts, dtype=torch.float64)
        dist.all_reduce(values)
        return values.tolist()

    def sum_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """Per-rank weighted metric sums -> global ones (every rank has the same keys, in order)."""
        if not self.enabled or not sums:
            return sums
        keys = sorted(sums)
        totals = self.sum_counts(*(sums[k] for k in keys))
        return dict(zip(keys, totals))

    def gather_rows(self, batch: TensorDict) -> TensorDict:
        """The per-row columns (one value a row: ``(B,)`` or ``(B, 1)``) of every rank's real rows,
        concatenated in rank order: what the learner's batch charts (rewards, lengths, staleness)
        are computed from."""
        if not self.enabled:
            return batch
        real = not self.is_filler(batch)
        rows = {key: value for key, value in batch.items(include_nested=True, leaves_only=True)
                if value.shape[1:].numel() == 1 and key != FILLER_KEY}
        gathered: list[dict | None] = [None] * self.world_size
        dist.all_gather_object(gathered, rows if real else None)
        parts = [p for p in gathered if p is not None]
        merged = {key: torch.cat([p[key] for p in parts]) for key in parts[0]}
        return TensorDict(merged, batch_size=[int(next(iter(merged.values())).shape[0])])

    def sync_unless(self, model: torch.nn.Module, accumulating: bool) -> contextlib.AbstractContextManager:
        """DDP's ``no_sync`` while ``accumulating`` micro-batches; the last one all-reduces gradients."""
        if self.enabled and accumulating:
            return model.no_sync()
        return contextlib.nullcontext()

    def from_main(self, value: int) -> int:
        """Rank 0's ``value`` on every rank (a published weight version: only rank 0 reads the disk)."""
        if not self.enabled:
            return value
        box = torch.tensor([value], dtype=torch.int64)
        dist.broadcast(box, src=0)
        return int(box.item())
