"""Data-parallel learner ranks (:class:`DataParallel`): N processes train one policy over one run and buffer.

Ranks come from ``torchrun`` or from ``run``/``replay`` with ``learner.world_size=N``; with one rank every
method is the identity. Rank 0 alone draws and shares each draw on the prefetch threads' group, with the
commit records it read (:meth:`share_draw`, :class:`SharedView`, :class:`ViewChanges`); every rank reads
its slice (:func:`rank_slice`, :func:`order_by_owner`, :func:`positions_in_view`) and weighs its loss by
its share of the global batch (:meth:`sum_counts`), so N ranks train like one. FSDP2: :func:`shard_model`.
Why one file: every collective a rank takes part in is here, and they must be issued in the same order on
every rank (an order that deadlocks across two files would be easy to write); the slices, views and
FSDP wrapping are what those collectives carry and run on. Design: docs/data-parallel.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from tensordict import TensorDict

from rlhf_pipeline.storage.buffers import is_url

from rlhf_pipeline.learn.loss import MAX_METRICS, aggregates_by_token
from rlhf_pipeline.learn.batch import drop_stale, take_rows
from rlhf_pipeline.learn.errors import DataTimeoutError, TooFewDevices
from rlhf_pipeline.learn.shard_rows import (
    RowNames,
    View,
    adopt_view,
    open_in_view,
    positions_of,
    published_view,
    shard_stores,
)
from rlhf_pipeline.learn.step import MicroBatch, StepPlan, batch_counts, micro_batch_weight, plan_step, split_batch

if TYPE_CHECKING:
    from rlhf_pipeline.learn.samplers import SampledRows
    from rlhf_pipeline.learn.settings import LearnerSettings

#: the per-row flag of a filler batch, which a rank whose slice is empty or all stale trains so
#: that DDP's all-reduce runs on every rank: its rows carry no loss
#: (docs/data-parallel.md#how-the-ranks-share-a-step)
FILLER_KEY = "data_parallel_filler"
#: how long a rank's closing prefetch thread waits for the others before it is left to stop()
DRAW_CLOSE_WAIT_S = 10.0


@dataclass
class MainStopped:
    """What rank 0 shares instead of a draw when it has none to give (stopped, or its draw failed)."""

    interrupted: bool  # a stop request: every rank stops cleanly
    message: str = ""

    def raise_here(self) -> None:
        if self.interrupted:
            raise InterruptedError("rank 0 stopped drawing")
        raise RuntimeError(f"data-parallel rank 0 failed to draw the next batch: {self.message}")


@dataclass
class DataParallel:
    """This process's place among the learner ranks; ``world_size == 1`` is the plain learner."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    parallelism: str = "ddp"  # or "fsdp" (shard_model, below): the learner sets it from learner.parallelism

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size or self.local_rank < 0:
            raise ValueError(f"data-parallel rank {self.rank} of world size {self.world_size} (local rank "
                             f"{self.local_rank}) is impossible: need 0 <= rank < world_size and local_rank >= 0")
        self._started_here = False
        self._shared_view = SharedView()  # rank 0: each shard's record as the other ranks hold it
        self._received = ReceivedRecords()  # the other ranks: the records rank 0 sent
        self._draw_group = None  # open_draw_channel
        self._closing_draws = threading.Event()  # draw_producer's; set by close_draws

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
    def sharded(self) -> bool:
        """FSDP over several ranks: the model, its gradients and optimizer state are sharded."""
        return self.enabled and self.parallelism == "fsdp"

    @property
    def loss_scale(self) -> float:
        """DDP and FSDP average gradients over ranks; the losses here are already global shares, so undo it."""
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
            visible = torch.cuda.device_count()
            if self.local_rank >= visible:  # set_device's own refusal: "invalid device ordinal", a traceback
                raise TooFewDevices(
                    f"learner rank {self.rank} of learner.world_size={self.world_size} trains on its own GPU, "
                    f"cuda:{self.local_rank}, and this machine shows {visible} (CUDA_VISIBLE_DEVICES="
                    f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): set learner.world_size to {visible} or "
                    f"fewer, or spread the ranks over machines (torchrun --nnodes, or --ray)")
            torch.cuda.set_device(self.device_for(device))
        dist.init_process_group(backend, rank=self.rank, world_size=self.world_size)
        self._started_here = True

    def stop(self) -> None:
        if self._started_here and dist.is_initialized():
            dist.destroy_process_group()  # the draw channel with it
            self._started_here = False
            self._draw_group = None

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """The module forward/backward run through: DDP over the ranks, ``model`` sharded in place
        (FSDP2), or ``model`` itself."""
        if not self.enabled:
            return model
        if self.sharded:
            return shard_model(model)
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.device_for(device).index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)

    # ------------------------------------------------------------------ data
    def local_positions(self, positions: torch.Tensor, rank_rows: list[int] | None = None) -> tuple[torch.Tensor, bool]:
        """This rank's contiguous slice of a draw's global positions (or of any per-row values of the
        draw, e.g. importance weights), and whether it is a filler: :func:`rank_slice`."""
        if not self.enabled:
            return positions, False
        return rank_slice(positions, self.rank, self.world_size, rank_rows)

    def order_by_rank(self, sampled: SampledRows, store) -> SampledRows:
        """Rank 0's draw ordered by the rank that owns each row's shard: :func:`order_by_owner`."""
        return order_by_owner(sampled, store, self.world_size) if self.enabled else sampled

    @staticmethod
    def mark_filler(batch: TensorDict, filler: bool) -> TensorDict:
        batch[FILLER_KEY] = torch.full((batch.batch_size[0],), filler, dtype=torch.bool, device=batch.device)
        return batch

    @staticmethod
    def is_filler(batch: TensorDict) -> bool:
        return FILLER_KEY in batch.keys() and bool(batch[FILLER_KEY].all())

    def share_draw(self, item: Any) -> Any:
        """Rank 0's ``item`` on every rank (one ``broadcast_object_list`` on the draw channel, by the
        prefetch threads only): a draw, i.e. what rank 0's sampler decided and the lasting names of
        its rows, or a :class:`MainStopped`."""
        if not self.enabled:
            return item
        box = [item if self.is_main else None]
        dist.broadcast_object_list(box, src=0, group=self._draw_group)
        return box[0]

    def close_draws(self, prefetcher) -> None:
        """Closes this rank's prefetch thread (made from :meth:`draw_producer`). Waits a while for
        the other ranks' threads to finish their part of the last broadcast; a thread still in one
        after that (another rank failed) is woken when :meth:`stop` destroys the process group."""
        self._closing_draws.set()
        prefetcher.close(timeout_s=DRAW_CLOSE_WAIT_S if self.enabled else None)

    def open_draw_channel(self) -> None:
        """The gloo group draws are shared on (:meth:`draw_producer`); every rank calls it, at setup.
        Gloo even beside NCCL: a draw is a few kilobytes of Python objects, and a thread of its own
        needs no CUDA device."""
        if self.enabled and self._draw_group is None:
            self._draw_group = dist.new_group(backend="gloo")

    def open_buffer(self, location: str, saved_state: dict[str, Any] | None = None):
        """The buffer at ``location`` opened for reading on every rank (every rank calls it, at setup);
        ``saved_state``: a checkpoint's state of it, whose rows must still be held (the store's
        ``load_state_dict``).

        At a URL rank 0 alone opens it (one LIST and one GET of each shard's commit record) and checks
        ``saved_state``, then sends the records it read on the draw channel; every other rank opens
        its reader from them (``shard_rows.open_in_view``): no request, and exactly rank 0's view.
        Those readers refresh only when forced (a unit compacted away under a read): their view
        follows rank 0's draws (:meth:`positions_in_view`), so a sampler that refreshes its store on
        another rank (it never draws there) sends nothing. If rank 0 fails to open it, every rank
        raises. A local buffer is opened by every rank, as a local refresh is made by each: a
        directory listing and a read of each shard's manifest."""
        from rlhf_pipeline.storage import open_buffer

        def open_here():
            store = open_buffer(location, mode="r")
            try:
                if saved_state is not None:
                    store.load_state_dict(saved_state)  # refreshes: the rows it saw must still be there
            except BaseException:
                store.close()
                raise
            return store

        if not self.enabled or not is_url(location):
            return open_here()
        self.open_draw_channel()  # the prefetch threads' group: none of them runs yet
        if self.is_main:
            try:
                store = open_here()
            except BaseException as exc:  # the other ranks wait for the records: they raise too
                self.share_draw(MainStopped(interrupted=not isinstance(exc, Exception),
                                            message=f"{type(exc).__name__}: {exc}"))
                raise
            view = published_view(store)
            self.share_draw(None if view is None else self._shared_view.opened(view))
            return store
        shared = self.share_draw(None)
        if isinstance(shared, MainStopped):
            if shared.interrupted:
                raise InterruptedError(f"rank 0 stopped while opening {location}")
            raise RuntimeError(f"data-parallel rank 0 failed to open {location}: {shared.message}")
        if shared is None:  # rank 0's reader has no records to share (not a Zarr store): open it here
            return open_here()
        return open_in_view(location, self.received_records(shared), refresh_interval_s=math.inf)

    def local_names(self, names: RowNames, rank_rows: list[int] | None = None) -> tuple[RowNames, bool]:
        """This rank's contiguous slice of a draw's row names, as :meth:`local_positions` slices positions."""
        index, filler = self.local_positions(torch.arange(names.ids.shape[0]), rank_rows)
        return names.select(index.numpy()), filler

    def view_changes(self, names: RowNames) -> RowNames:
        """Rank 0: ``names`` with only the shard records the other ranks do not hold yet, packed."""
        return self._shared_view.changes(names)

    def received(self, names: RowNames) -> RowNames:
        """Another rank: ``names`` as rank 0 shared them (:meth:`view_changes`), with whole records."""
        if not isinstance(names.view, ViewChanges):
            return names
        return dataclasses.replace(names, view=self.received_records(names.view))

    def received_records(self, changes: ViewChanges) -> dict[str, dict[str, Any]]:
        """Another rank: the whole records rank 0 sent as ``changes`` (at setup, or with a draw)."""
        return self._received.unpack(changes)

    @staticmethod
    def positions_in_view(store, names: RowNames, *, stop: threading.Event, timeout_s: float) -> torch.Tensor:
        """:func:`positions_in_view`: ``names``' positions in this rank's view of the buffer."""
        return positions_in_view(store, names, stop=stop, timeout_s=timeout_s)

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
        """Per-rank weighted metric sums -> global ones (every rank has the same keys, in order); the
        statistics in ``loss.MAX_METRICS`` are maxima, taken over the ranks."""
        if not self.enabled or not sums:
            return sums
        keys = sorted(k for k in sums if k not in MAX_METRICS)
        totals = dict(zip(keys, self.sum_counts(*(sums[k] for k in keys))))
        maxima = sorted(k for k in sums if k in MAX_METRICS)
        if maxima:
            values = torch.tensor([sums[k] for k in maxima], dtype=torch.float64)
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
            totals.update(zip(maxima, values.tolist()))
        return totals

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
        """No gradient sync while ``accumulating`` micro-batches (DDP's ``no_sync``, FSDP's
        ``set_requires_gradient_sync``); the last one reduces gradients over the ranks."""
        if self.sharded:
            set_gradient_sync(model, not accumulating)
            return contextlib.nullcontext()
        if self.enabled and accumulating:
            return model.no_sync()
        return contextlib.nullcontext()

    def micro_batch_count(self, count: int) -> int:
        """How many micro-batches every rank runs this step: FSDP gathers parameters in every
        forward and backward, so all ranks run the most any has (the others repeat one with weight 0)."""
        if not self.sharded:
            return count
        box = torch.tensor([count], dtype=torch.int64)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        return int(box.item())

    # ------------------------------------------------------------------ the layer around one step
    def draw_producer(self, produce_named: Callable[[int], tuple], *,
                      read_slice: Callable[[Any, torch.Tensor, bool], TensorDict | None], store,
                      stop: threading.Event, timeout_s: float) -> tuple[Callable[[int], tuple], Callable[[], None] | None]:
        """``(produce, on_exit)`` for this rank's prefetch thread (``Prefetcher``, ``learn/learner.py``):
        ``produce(draw)`` gives ``(sampled, batch, names, intake)`` of draw ``draw``. With one rank: ``produce_named``.

        Rank 0 draws (``produce_named``: its sampler alone sees the buffer grow, decides staleness drops,
        epochs and pacing), reads its own slice, and shares the draw on the draw channel (a gloo group
        only the prefetch threads use, so the main threads' collectives are never issued concurrently on
        one group). Every other rank's thread takes each draw in order and reads its slice (of
        trajectories when ``sampled.trajectory_steps`` is set) from its view of the buffer, held or
        refreshed until it holds the rows: so each rank's read and packing run ahead, off the training
        thread. The prefetcher keeps every item (``keep_every_item``): a draw rank 0 shared is trained
        by every rank or by none. Each thread stops after a :class:`MainStopped`: rank 0 shares exactly
        one (asked to stop, its draw failed, or closed), and a closing rank takes draws until it comes
        (:meth:`close_draws`), so neither thread is left in a broadcast the other never joins.
        """
        if not self.enabled:
            return produce_named, None
        stopped = threading.Event()  # this thread has shared (rank 0) or taken (others) a MainStopped
        closing = self._closing_draws = threading.Event()  # set by close_draws

        def say_stopped(message: MainStopped) -> None:
            stopped.set()
            self.share_draw(message)

        if self.is_main:
            def produce_and_share(draw: int) -> tuple:
                try:
                    if stop.is_set():  # asked to stop: no more draws, on any rank
                        raise InterruptedError("rank 0 stopped drawing")
                    sampled, batch, names, intake = produce_named(draw)
                except InterruptedError:
                    say_stopped(MainStopped(interrupted=True))
                    raise
                except Exception as exc:
                    say_stopped(MainStopped(interrupted=False, message=f"{type(exc).__name__}: {exc}"))
                    raise
                # the sampler state stays here: only rank 0 checkpoints it
                self.share_draw((draw, dataclasses.replace(sampled, sampler_state={}), self.view_changes(names), intake))
                return sampled, batch, names, intake

            def last_word() -> None:
                if not stopped.is_set():
                    with contextlib.suppress(RuntimeError, OSError):  # the other ranks are gone: nobody to tell
                        say_stopped(MainStopped(interrupted=True))

            return produce_and_share, last_word

        def take_and_read(draw: int) -> tuple:
            shared = self.share_draw(None)
            if isinstance(shared, MainStopped):
                stopped.set()
                shared.raise_here()
            shared_draw, sampled, names, intake = shared
            if shared_draw != draw:
                raise RuntimeError(f"data-parallel rank {self.rank} expected draw {draw} from rank 0 and got "
                                   f"{shared_draw}: do all ranks resume from the same checkpoint?")
            names = self.received(names)
            mine, filler = self.local_names(names, sampled.rank_rows)
            positions = self.positions_in_view(store, mine, stop=stop, timeout_s=timeout_s)
            return sampled, read_slice(sampled, positions, filler), names, intake

        def wait_for_last_word() -> None:
            # only when closed: after its own error this rank fails, and so the run
            while closing.is_set() and not stopped.is_set():
                try:
                    if isinstance(self.share_draw(None), MainStopped):
                        stopped.set()
                except (RuntimeError, OSError):  # rank 0 is gone
                    return

        return take_and_read, wait_for_last_word

    def drop_stale(self, batch: TensorDict, fresh: np.ndarray) -> tuple[TensorDict | None, int, np.ndarray]:
        """:func:`~rlhf_pipeline.learn.batch.drop_stale` over all ranks: stale rows counted
        globally, the step skipped (None) only when no rank has a row left, a rank with none left
        trains on a filler. Also returns the freshness of every row of the global draw, in draw order."""
        if not self.enabled:
            return (*drop_stale(batch, fresh), fresh)
        filler = self.is_filler(batch)
        if filler:
            fresh = np.ones_like(fresh)  # a filler's row is never counted, stale or not
        kept, stale = drop_stale(batch, fresh)
        stale, left = self.sum_counts(stale, 0 if kept is None or filler else kept.batch_size[0])
        fresh_everywhere = self.gather_flags(fresh[:0] if filler else fresh)
        if left == 0:
            return None, int(stale), fresh_everywhere
        if kept is None:
            kept = self.mark_filler(take_rows(batch, torch.arange(1)), True)
        return kept, int(stale), fresh_everywhere

    def plan_step(self, batch: TensorDict, settings: LearnerSettings, forward_model: torch.nn.Module) -> StepPlan:
        """:func:`~rlhf_pipeline.learn.step.plan_step` for this rank among all: weights are shares of
        the global batch (counted with one all-reduce), a filler trains with weight 0, FSDP ranks run
        as many micro-batches as the busiest one (repeating their last with weight 0), gradients are
        reduced over the ranks on the last micro-batch, and the metrics summed over the ranks."""
        if not self.enabled:
            return plan_step(batch, settings)
        filler = self.is_filler(batch)
        rows, response_tokens, attention_tokens = (int(n) for n in self.sum_counts(
            *((0, 0, 0) if filler else batch_counts(batch))))
        token_mean = aggregates_by_token(settings.loss)
        pieces = split_batch(batch, settings)
        count = self.micro_batch_count(len(pieces))
        parts = []
        for i in range(count):
            repeat = i >= len(pieces)  # only to take part in FSDP's gathers
            indices, micro = pieces[min(i, len(pieces) - 1)]
            weight = 0.0 if filler or repeat else micro_batch_weight(
                micro, rows=rows, response_tokens=response_tokens, token_mean=token_mean)
            sync = functools.partial(self.sync_unless, forward_model, accumulating=i < count - 1)
            parts.append(MicroBatch(indices, micro, weight, counts=not repeat, gradient_sync=sync))
        return StepPlan(parts, rows, response_tokens, attention_tokens, loss_scale=self.loss_scale,
                        reduce=self.sum_metrics)

    # ------------------------------------------------------------------ whole states (files)
    def model_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state dict for weights and checkpoints; gathered to rank 0 under FSDP
        (every rank must call it then; the others get an empty dict)."""
        if self.sharded:
            return full_model_state(model)
        return model.state_dict()

    def optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The whole optimizer state in ``optimizer.state_dict()``'s layout (see :meth:`model_state`)."""
        if self.sharded:
            return full_optimizer_state(model, optimizer)
        return optimizer.state_dict()

    def load_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                             state: dict[str, Any]) -> None:
        if self.sharded:
            load_optimizer_state(model, optimizer, state)
        else:
            optimizer.load_state_dict(state)


# ====================================================================== which rows are whose, in which view
# Which rows each data-parallel rank reads, and the view of the buffer it reads them in.
#
# Rank 0 draws; every rank reads a contiguous slice of the draw (:func:`rank_slice`) from its own
# reader of the same buffer. Two things keep the buffer's requests from growing with the ranks:
#
# * **One refresh per step, rank 0's.** For a buffer at a URL the names of a draw carry each shard's
#   commit record as rank 0's refresh read it (``RowNames.view``, ``learn/shard_rows.py``). Rank 0
#   sends only the records that changed since the draw it shared before (:class:`SharedView`), and
#   of those only what the other ranks do not hold (:class:`ViewChanges`); they rebuild the records
#   (``DataParallel.received``) and adopt them (:func:`positions_in_view`), so they hold exactly rank
#   0's rows, with no LIST and no record GET of their own: they GET only the units of their slice.
#   Draws are shared in order, so each rank's view follows rank 0's draw by draw, from the view they
#   opened the buffer in: rank 0's records too, sent at setup (``DataParallel.open_buffer``,
#   :meth:`SharedView.opened`). A local buffer's ranks refresh their own view (an ``fstat`` per
#   shard) until it holds the drawn rows.
# * **Shard affinity.** With at least as many shards as ranks, rank 0 orders the draw by owning rank
#   (shard ``k`` belongs to rank ``k mod N``: :func:`order_by_owner`), so a rank reads from the same
#   shards every step and each unit is fetched by one rank. Rank 0 also reads small fields of the
#   whole draw (``done``/``step`` for multi-turn narrowing, ``policy_version`` for the samplers'
#   staleness check); a Zarr shard's commit record answers those where a unit holds one value
#   (``storage/zarr/unit_constants.py``), so it fetches other ranks' units only for multi-turn rows
#   or a unit of mixed versions. The global batch is the draw the sampler made (the exact sampler's
#   even share per shard); only which rank trains which row changes. With fewer shards than ranks
#   the slices are equal, in draw order.


def rank_slice(values: torch.Tensor, rank: int, world_size: int,
               rank_rows: list[int] | None = None) -> tuple[torch.Tensor, bool]:
    """Rank ``rank``'s contiguous slice of a draw's per-row ``values`` and whether it is a filler
    (an empty slice replaced by the draw's first row, trained with weight 0). ``rank_rows``: each
    rank's rows in rank order (a draw :func:`order_by_owner` ordered); None: slices of equal size."""
    if rank_rows is None:
        mine = torch.tensor_split(values, world_size)[rank]
    else:
        start = sum(rank_rows[:rank])
        mine = values[start:start + rank_rows[rank]]
    if mine.numel() == 0:
        return values[:1], True
    return mine, False


def order_by_owner(sampled: SampledRows, store, world_size: int) -> SampledRows:
    """``sampled`` with each rank's rows together, in rank order (``rank_rows`` set): rank ``r`` owns
    shard ``k`` when ``k mod world_size == r``. Within a rank the draw's order is kept. Unchanged with
    fewer shards than ranks (some rank would own none) or an empty draw."""
    if len(shard_stores(store)) < world_size or sampled.positions.numel() == 0:
        return sampled
    shard_indices, _ = store.locate(sampled.positions)
    owner = shard_indices % world_size
    order = torch.sort(owner, stable=True).indices
    return dataclasses.replace(
        sampled, positions=sampled.positions[order],
        weights=None if sampled.weights is None else sampled.weights[order],
        trajectory_steps=None if sampled.trajectory_steps is None else sampled.trajectory_steps[order],
        rank_rows=torch.bincount(owner, minlength=world_size).tolist())


class SharedView:
    """Rank 0's record of what it has shared: each shard's commit record as the other ranks hold it."""

    def __init__(self) -> None:
        self._shared: View = {}

    def changes(self, names: RowNames) -> RowNames:
        """``names`` carrying only the records of the shards that changed since the last draw shared
        (or since the opening shared: :meth:`opened`), packed (:class:`ViewChanges`): the other ranks
        keep the rest, and the parts of these they hold. They unpack it with
        :meth:`DataParallel.received <rlhf_pipeline.learn.distributed.DataParallel.received>`."""
        if names.view is None:
            return names
        # a refresh replaces a record, so an unchanged one is often the same object: compared first
        changed = {key: record for key, record in names.view.items() if self._shared.get(key) != record}
        packed = pack_changes(changed, self._shared)
        self._shared.update(changed)
        return dataclasses.replace(names, view=packed)

    def opened(self, view: View) -> ViewChanges:
        """What to send the other ranks so they open the buffer in ``view`` (every shard's record)."""
        self._shared = dict(view)
        return pack_changes(view, {})


def positions_in_view(store, names: RowNames, *, stop: threading.Event, timeout_s: float) -> torch.Tensor:
    """Positions of ``names`` in this rank's view of the buffer. With the records rank 0 drew them in
    (``names.view``) the view adopts those: no request. Otherwise it is refreshed until it holds
    every one of them: rank 0 may have drawn rows published after this rank's last refresh."""
    if isinstance(names.view, ViewChanges):
        raise TypeError("these names carry rank 0's records packed: unpack them first (DataParallel.received)")
    if names.view is not None:
        adopt_view(store, names.view)
        positions = positions_of(store, names)
        if positions is None:
            raise RuntimeError(f"this data-parallel rank's view of {store.location} lacks rows rank 0 drew even "
                               f"with rank 0's commit records: do all ranks read the same buffer?")
        return positions
    deadline = time.monotonic() + timeout_s
    while True:
        store.refresh()
        positions = positions_of(store, names)
        if positions is not None:
            return positions
        if stop.is_set():
            raise InterruptedError("data-parallel rank stopped while waiting for rank 0's rows")
        if time.monotonic() > deadline:
            raise DataTimeoutError(f"this data-parallel rank's view of {store.location} lacked rows rank 0 "
                                   f"drew for {timeout_s:.0f}s (learner.data_timeout_s): is the buffer on a "
                                   f"file system every rank sees the same way?")
        time.sleep(0.01)


# ====================================================================== commit records sent once
# Rank 0 sends the commit records its refresh read: at setup every shard's, then with each draw those
# that changed. A record is mostly what its shard was made with (schema, codecs, the units' layout:
# ~1.8 KB, the same in every shard a run makes) and a small part its writer changes. Sent whole, 640
# changed shards are ~1.2 MB a step (docs/scaling.md, section 5). :class:`ViewChanges` carries each
# shard's changing keys, and a fixed part only where the receiving ranks do not hold it. Rank 0
# (:func:`pack_changes`, against the records it sent before) and each other rank
# (:class:`ReceivedRecords`) keep the same records draw after draw, since draws are shared in
# order; so a rank rebuilds exactly rank 0's records, as if they had been sent whole.

#: what a shard's writers change in its commit record (an object store's records name the writer that
#: published them); the rest is fixed when the shard is made
CHANGING_KEYS = frozenset({"first_row", "next_row", "units", "unit_constants", "writer"})
#: in :attr:`ViewChanges.records`: the receiver holds this shard's fixed part already
AS_HELD = -1

Records = dict[str, dict[str, Any]]


@dataclass
class ViewChanges:
    """Changed commit records by shard key, as sent to the other ranks."""

    fixed: list[dict[str, Any]]  # each distinct fixed part not held by the receivers, once
    records: dict[str, tuple[int, dict[str, Any]]]  # key -> (index into fixed, or AS_HELD; the changing keys)

    def __len__(self) -> int:
        return len(self.records)


def split_record(record: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(fixed part, changing part)`` of a commit record."""
    fixed, changing = {}, {}
    for key, value in record.items():
        (changing if key in CHANGING_KEYS else fixed)[key] = value
    return fixed, changing


def pack_changes(changed: Records, held: Records) -> ViewChanges:
    """``changed`` records for receivers that hold ``held`` (the records sent to them before)."""
    fixed_parts: list[dict[str, Any]] = []
    records: dict[str, tuple[int, dict[str, Any]]] = {}
    for key, record in changed.items():
        fixed, changing = split_record(record)
        before = held.get(key)
        if before is not None and split_record(before)[0] == fixed:
            records[key] = (AS_HELD, changing)
            continue
        index = next((i for i, part in enumerate(fixed_parts) if part == fixed), None)
        if index is None:
            fixed_parts.append(fixed)
            index = len(fixed_parts) - 1
        records[key] = (index, changing)
    return ViewChanges(fixed_parts, records)


class ReceivedRecords:
    """Another rank's copy of the records rank 0 has sent it; turns :class:`ViewChanges` into records."""

    def __init__(self) -> None:
        self._held: Records = {}

    def unpack(self, changes: ViewChanges) -> Records:
        """The whole records ``changes`` stands for, now held."""
        out: Records = {}
        for key, (index, changing) in changes.records.items():
            if index == AS_HELD:
                before = self._held.get(key)
                if before is None:
                    raise RuntimeError(f"rank 0 sent the changes of shard {key}'s commit record, whose fixed part "
                                       f"this rank was never sent: were draws shared out of order?")
                fixed = split_record(before)[0]
            else:
                fixed = changes.fixed[index]
            out[key] = {**fixed, **changing}
        self._held.update(out)
        return out


# ====================================================================== FSDP2 (learner.parallelism=fsdp)
# ``fully_shard`` on each transformer block (the classes a transformers model lists in
# ``_no_split_modules``), then on the root. The model is loaded whole on every rank before it is
# sharded, and what leaves the ranks is always whole (the full state dict and the optimizer state
# in ``Optimizer.state_dict()``'s layout, gathered to rank 0's CPU), so weights and checkpoints do
# not depend on how a run was sharded: a checkpoint from FSDP ranks resumes on DDP ranks or one
# process, and the other way round. FSDP all-gathers a block's parameters in every forward and
# backward, so every rank runs the same number of micro-batches (:meth:`DataParallel.plan_step`).
def block_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's transformer blocks: modules of the classes it names in ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [module for module in model.modules() if type(module).__name__ in names]


def shard_model(model: torch.nn.Module) -> torch.nn.Module:
    """``fully_shard`` on each block, then the root; in place (the parameters become DTensors)."""
    from torch.distributed.fsdp import fully_shard

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
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_gather_whole())


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The whole optimizer state on rank 0 (empty elsewhere), numbered like ``optimizer.state_dict()``
    of an unsharded model. Every rank must call it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    by_name = get_optimizer_state_dict(model, optimizer, options=_gather_whole())
    if not by_name:
        return {}
    index = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    return {"state": {index[name]: value for name, value in by_name["state"].items()},
            "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                             for group in by_name["param_groups"]]}


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Loads a whole optimizer state (``optimizer.state_dict()`` layout, see
    :func:`full_optimizer_state`) into the sharded optimizer; every rank passes the same state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = [name for name, _ in model.named_parameters()]
    by_name = {"state": {names[i]: value for i, value in state["state"].items()},
               "param_groups": [{**group, "params": [names[i] for i in group["params"]]}
                                for group in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def set_gradient_sync(model: torch.nn.Module, sync: bool) -> None:
    """FSDP2's ``no_sync``: skip the gradient reduce-scatter while accumulating micro-batches."""
    model.set_requires_gradient_sync(sync)


def _gather_whole():
    """Whole states gathered to rank 0's CPU (imported here: a single-rank learner never needs FSDP)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)
