"""How the learner's prefetch thread turns a sampler's draw into the batch a step trains on.

The positions the sampler chose (``learn/samplers/``) are read on the prefetch thread
(``learn/prefetch.py``): with ``packing`` (the default) read ragged and packed there into the
step's micro-batches (``learn/packed_batch.py``: no padded batch at all), else read into a padded
batch; a ``batch_transform`` (replay's re-scoring) edits padded batches, so with one the rows are
read padded, transformed, and packed after.

Multi-turn rows train as whole trajectories, one sequence each (``learn/trajectories.py``): a
draw's rows that end a trajectory are read with their earlier turns and joined (ragged, with
packing), the loss mask 0 on the environment's tokens; a drawn row that does not end its
trajectory waits for the draw of its trajectory's last row. Single-turn draws are untouched. With
several data-parallel ranks rank 0 narrows the whole draw to the rows that end a trajectory, and
each rank reads its slice of those trajectories whole (``learn/distributed.py``).

Each draw also carries what outlives the store's next refresh: each row's shard and global id, and
the rows taken in per shard (what the learner publishes to ``pacing.json``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlhf_pipeline.coordination.pacing import LearnerIntake
from rlhf_pipeline.learn.distributed import DataParallel
from rlhf_pipeline.learn.packed_batch import PackedBatch
from rlhf_pipeline.learn.settings import LearnerSettings
from rlhf_pipeline.learn.shard_rows import next_rows, row_names
from rlhf_pipeline.learn.stale_rows import DrawVersions
from rlhf_pipeline.learn.trajectories import (
    is_single_turn,
    joined_trajectory_draw,
    narrow_to_trajectory_ends,
    read_joined,
    read_trajectories,
    rows_are_single_turn,
    trajectory_draw,
    trajectory_ends,
)


def draw_readers(store, sampler, settings: LearnerSettings, data_parallel: DataParallel, *, device: torch.device,
                 pad_token_id: int, batch_transform: Callable[[torch.Tensor, Any], Any] | None,
                 masked_codes: torch.Tensor, draw_versions: DrawVersions
                 ) -> tuple[Callable[[int], tuple[Any, ...]], Callable[..., Any]]:
    """``(produce, read_slice)`` for ``DataParallel.draw_producer``: ``produce(draw)`` draws from
    ``sampler`` and reads the batch, returning ``(sampled, batch, row names, intake)``;
    ``read_slice(sampled, positions, filler)`` reads one rank's slice of a shared draw.
    ``masked_codes``: the termination reasons left out of the step (their reasons are read only then);
    ``draw_versions``: the version each draw's staleness is checked against (``learn/stale_rows.py``)."""
    from rlhf_pipeline.schema.padding import PaddedCollator

    pin = device.type == "cuda"
    # int32 token and position ids: half their bytes, nothing widened (collate.py, "Index dtype")
    collator = PaddedCollator(pad_token_id=pad_token_id, pin_memory=pin and batch_transform is None,
                              index_dtype=torch.int32)
    packing = settings.packing
    # with packing the prefetch thread reads rows ragged and packs them (learn/packed_batch.py); a
    # batch_transform edits padded batches, so then it reads padded, transforms, and packs after
    ragged = packing and batch_transform is None
    budget = settings.micro_batch_tokens
    pin_packed = pin and torch.cuda.is_available()

    def transformed(positions: torch.Tensor, batch):
        batch = batch_transform(positions, batch)
        if packing:  # the packed micro-batches are pinned, not the padded batch
            return PackedBatch.from_padded(batch, budget, pin=pin_packed)
        return batch.pin_memory() if pin and torch.cuda.is_available() else batch

    # single-turn rows carry no termination reason in the padded batch: read it only when asked to mask
    read_reasons = masked_codes.numel() > 0 and "termination_reason" in store.schema.field_names

    def finish(positions: torch.Tensor, batch, filler: bool = False):
        """A read batch as it trains: re-scored (named by ``positions``), marked filler or not."""
        if batch_transform is not None:
            batch = transformed(positions, batch)
        if data_parallel.enabled:
            batch = data_parallel.mark_filler(batch, filler)
        return batch

    def reasons(positions: torch.Tensor) -> torch.Tensor | None:
        if not read_reasons:
            return None
        return store.read(positions, fields=("termination_reason",))["termination_reason"]

    def with_reasons(positions: torch.Tensor, batch):
        if read_reasons:
            batch["termination_reason"] = reasons(positions)
        return batch

    def packed_rows(positions: torch.Tensor, stored=None) -> PackedBatch:
        """Single-turn rows at ``positions`` (``stored``: already read ragged), planned and packed."""
        stored = store.read_ragged(positions) if stored is None else stored
        return PackedBatch.from_stored(stored, budget, termination_reason=reasons(positions), pin=pin_packed)

    def read_slice(sampled, positions: torch.Tensor, filler: bool):
        """This rank's slice of a draw (``positions``): the rows as drawn, or, when rank 0
        narrowed the draw to trajectory ends, the slice's trajectories read whole (None when
        the draw ended none: every rank skips it)."""
        if sampled.trajectory_steps is None:
            if ragged:
                return finish(positions, packed_rows(positions), filler)
            return finish(positions, with_reasons(positions, collator.read(store, positions)), filler)
        if sampled.positions.numel() == 0:
            return None
        steps, _ = data_parallel.local_positions(sampled.trajectory_steps, sampled.rank_rows)
        if ragged:
            joined = read_joined(store, positions, steps, turn_advantage=settings.turn_advantage,
                                 turn_advantage_weight=settings.turn_advantage_weight)
            return finish(positions, PackedBatch.from_joined(joined, budget, pin=pin_packed), filler)
        joined = read_trajectories(store, positions, steps, pad_token_id=pad_token_id,
                                   turn_advantage=settings.turn_advantage,
                                   turn_advantage_weight=settings.turn_advantage_weight)
        if pin and batch_transform is None and torch.cuda.is_available():
            joined = joined.pin_memory()
        return finish(positions, joined, filler)

    def narrow_whole_draw(sampled):
        """Rank 0 alone sees the whole draw: from its rows' ``done`` and ``step`` it decides, as one
        rank would from the rows it read, whether they are multi-turn and which of them end a whole
        trajectory; every rank then trains its slice of those trajectories."""
        flags = store.read(sampled.positions, fields=("done", "step"))
        if rows_are_single_turn(flags["done"], flags["step"]):  # as drawn
            return sampled
        return narrow_to_trajectory_ends(sampled, trajectory_ends(store, sampled.positions,
                                                                  flags["done"], flags["step"]))

    def produce(draw: int):
        sampled = sampler.draw(draw)  # positions, read before the store refreshes again
        if data_parallel.enabled:
            sampled = data_parallel.order_by_rank(narrow_whole_draw(sampled), store)  # shard affinity
            positions, filler = data_parallel.local_positions(sampled.positions, sampled.rank_rows)
            return sampled, read_slice(sampled, positions, filler)
        if ragged:
            return produce_packed(sampled)
        batch = collator.read(store, sampled.positions)  # re-scored below, once it is known what trains
        if not is_single_turn(batch):  # multi-turn rows: the whole trajectories they end
            sampled, joined = trajectory_draw(store, sampled, batch, pad_token_id=pad_token_id,
                                              turn_advantage=settings.turn_advantage,
                                              turn_advantage_weight=settings.turn_advantage_weight,
                                              pin=pin and batch_transform is None)
            return sampled, None if joined is None else finish(sampled.positions, joined)  # named by last rows
        return sampled, finish(sampled.positions, with_reasons(sampled.positions, batch))

    def produce_packed(sampled):
        """One rank's draw with packing: read ragged, trajectories joined ragged, planned, packed."""
        stored = store.read_ragged(sampled.positions)
        if not rows_are_single_turn(stored["done"], stored["step"]):  # the whole trajectories they end
            sampled, joined = joined_trajectory_draw(store, sampled, stored["done"], stored["step"],
                                                     turn_advantage=settings.turn_advantage,
                                                     turn_advantage_weight=settings.turn_advantage_weight)
            if joined is None:
                return sampled, None
            return sampled, finish(sampled.positions, PackedBatch.from_joined(joined, budget, pin=pin_packed))
        return sampled, finish(sampled.positions, packed_rows(sampled.positions, stored))

    # what outlives the store's next refresh, taken right after the draw: each row's shard and
    # global id, and the rows taken in per shard
    default_need = settings.new_rows_per_step or settings.batch_size
    checks_staleness = getattr(sampler, "max_staleness", None) is not None

    def produce_named(draw: int):
        # the version this draw trains with, not the one held right now (learn/stale_rows.py)
        versions = draw_versions
        sampler.current_version = versions.wait(draw) if checks_staleness else versions.latest()
        sampled, batch = produce(draw)
        consumed = sampled.consumed if sampled.consumed is not None else next_rows(store)
        need = default_need if sampled.next_draw_rows is None else sampled.next_draw_rows
        return sampled, batch, row_names(store, sampled.positions), LearnerIntake(consumed=consumed,
                                                                                  next_draw_rows=need)

    return produce_named, read_slice
