"""torchrl glue: a writer that appends, and a factory for a ``ReplayBuffer`` over a store.

torchrl's writers compute where rows go (round robin, by priority...). A trajectory
store is append-only and decides positions itself, so :class:`AppendWriter` hands
the data to ``store.append`` and returns the positions the rows really got. It keeps
no state: the cursor is the store's ``next_row``, which the store persists.

Typical use::

    store = create_store("storage/run/buffer")
    rb = make_replay_buffer(store, batch_size=64, collate_fn=PaddedCollator(...))
    rb.extend(batch)          # a TrajectoryBatch or a TensorDict with torchrl LLM keys
    padded = rb.sample()      # with a PaddedCollator: the store's fused read_padded
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from tensordict import is_tensor_collection
from tensordict.nn.utils import _set_dispatch_td_nn_modules
from torchrl.data import ReplayBuffer
from torchrl.data.replay_buffers.samplers import RandomSampler, Sampler, SamplerWithoutReplacement
from torchrl.data.replay_buffers.writers import Writer

from rlhf_pipeline.schema import Trajectory, TrajectoryBatch
from rlhf_pipeline.storage.base import TrajectoryStore, _as_batch

def _prioritized() -> Sampler:
    from rlhf_pipeline.storage.prioritized import PrioritizedSampler

    return PrioritizedSampler()


SAMPLERS: dict[str, Callable[[], Sampler]] = {
    "random": RandomSampler,
    "without_replacement": SamplerWithoutReplacement,
    "prioritized": _prioritized,  # storage/prioritized.py: torchrl's own needs a compiled extension
}


def adopt_replay_buffer_defaults(buffer: Any) -> None:
    """Our defaults for a torchrl ``ReplayBuffer`` being built over a trajectory store.

    torchrl picks a default ``collate_fn`` by storage class (``_get_default_collate``) and
    knows none for ours, so ``ReplayBuffer(storage=store, sampler=..., batch_size=...)`` used to
    fail with ``Could not find a default collate_fn``. Its constructor calls ``storage.attach``
    before it resolves the collate and the writer, so :meth:`TrajectoryStore.attach` fills what
    the caller left out: ``collate_fn`` = :class:`~rlhf_pipeline.collate.PaddedCollator` (the
    learner's padded batch, pad id 0) and ``writer`` = :class:`AppendWriter` (positions the rows
    really got). What the caller passed is kept. ``tests/storage/test_torchrl_dropin.py`` checks
    this against torchrl itself, so a torchrl release that builds buffers differently fails there.
    """
    from rlhf_pipeline.collate import PaddedCollator

    building = isinstance(buffer, ReplayBuffer) and not hasattr(buffer, "_collate_fn")
    if not building:
        return
    if getattr(buffer, "_init_collate_fn", False) is None:
        buffer._init_collate_fn = PaddedCollator()
    if getattr(buffer, "_init_writer", False) is None:
        buffer._init_writer = AppendWriter()


class AppendWriter(Writer):
    """Appends every write to the end of a :class:`TrajectoryStore`; returns real positions."""

    def add(self, data: Any) -> int:
        if isinstance(data, Trajectory):
            batch = TrajectoryBatch.from_rows([data])
        elif isinstance(data, TrajectoryBatch):
            batch = data
        else:
            batch = _as_batch(data.unsqueeze(0) if getattr(data, "batch_dims", 1) == 0 else data)
        if len(batch) != 1:
            raise ValueError(f"add() takes one row, got {len(batch)}; use extend() for several")
        return int(self._store().append(batch)[0])

    def extend(self, data: Any) -> torch.Tensor:
        return self._store().append(_as_batch(data))

    def _store(self) -> TrajectoryStore:
        if not isinstance(self._storage, TrajectoryStore):
            raise TypeError(
                f"AppendWriter writes to a TrajectoryStore, got {type(self._storage).__name__}; build "
                f"the buffer with make_replay_buffer(store)"
            )
        return self._storage

    # The store holds the write position, so there is nothing of our own to save.
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return None

    def dumps(self, path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "writer.json").write_text(json.dumps({"writer": "AppendWriter", "state": "held by the store"}))

    def loads(self, path) -> None:
        return None

    def _empty(self, empty_write_count: bool = True) -> None:
        raise NotImplementedError("a trajectory store is append-only and is never emptied in place")


class TrajectoryReplayBuffer(ReplayBuffer):
    """torchrl's ``ReplayBuffer``, whose ``sample()`` pads through the store's fused path.

    torchrl's ``sample`` reads ``storage.get(index)`` (for our stores a ``TrajectoryBatch``)
    and hands it to ``collate_fn``. When ``collate_fn`` can read positions itself (it has
    ``read(storage, index)``, as :class:`~rlhf_pipeline.collate.PaddedCollator` does), this
    buffer calls that instead: the sampled rows go straight from the store into the padded
    batch (``store.read_padded``), the same TensorDict at about twice the speed
    (``benchmarks/README.md``). Sampling, locks, transforms and ``pin_memory`` behave as in
    torchrl; any other ``collate_fn``, a sample unit or generation tracking take torchrl's path.
    """

    def _sample(self, batch_size: int) -> tuple[Any, dict]:
        read = getattr(self._collate_fn, "read", None)
        if read is None or self._sample_unit is not None or self._writer.tracks_generations:
            return super()._sample(batch_size)
        with self._replay_lock, self._write_lock:
            index, info = self._sampler.sample(self._storage, batch_size)
            info["index"] = index
            data = self._storage.get(index) if isinstance(index, int) else read(self._storage, index)
        if self._transform is not None and len(self._transform):
            is_td = is_tensor_collection(data)
            with data.unlock_() if is_td else contextlib.nullcontext(), _set_dispatch_td_nn_modules(is_td):
                data = self._transform(data)
        if self._pin_memory:  # what torchrl's pin_memory_output does to a sample
            data = data.pin_memory()
        return data, info


def _identity(batch: TrajectoryBatch) -> TrajectoryBatch:
    return batch


def make_replay_buffer(
    store: TrajectoryStore,
    *,
    batch_size: int | None = None,
    sampler: str | Sampler = "random",
    collate_fn: Callable[[TrajectoryBatch], Any] | None = None,
    transforms: Iterable[Any] = (),
) -> ReplayBuffer:
    """A torchrl ``ReplayBuffer`` (:class:`TrajectoryReplayBuffer`) reading and writing ``store``.

    ``sampler`` is ``"random"`` (with replacement), ``"without_replacement"``, ``"prioritized"``
    (:class:`~rlhf_pipeline.storage.prioritized.PrioritizedSampler` with its defaults) or any
    torchrl ``Sampler``. ``collate_fn`` turns the sampled ``TrajectoryBatch`` into what
    the learner wants (e.g. ``rlhf_pipeline.collate.PaddedCollator``); by default the
    batch is returned as is. ``transforms`` run on the write path in the order given
    (e.g. group advantage, then reference log-probs, then KL reward). torchrl applies
    inverse transforms last-appended-first, so they are appended in reverse.
    """
    if isinstance(sampler, str):
        try:
            sampler = SAMPLERS[sampler]()
        except KeyError:
            raise ValueError(f"unknown sampler {sampler!r}; choose from {sorted(SAMPLERS)} or pass a Sampler") from None
    rb = TrajectoryReplayBuffer(
        storage=store,
        writer=AppendWriter(),
        sampler=sampler,
        collate_fn=collate_fn or _identity,
        batch_size=batch_size,
    )
    for transform in reversed(list(transforms)):
        rb.append_transform(transform, invert=True)
    return rb
