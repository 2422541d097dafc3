"""torchrl glue: a writer that appends, and a factory for a ``ReplayBuffer`` over a store.

:class:`AppendWriter` hands rows to ``store.append`` (an append-only store decides positions itself) and
keeps no state. :func:`make_replay_buffer` builds a ``TrajectoryReplayBuffer`` whose ``extend`` also takes
``writer_state=`` (published with the rows) and whose ``sample`` with a ``PaddedCollator`` reads through
the store's fused ``read_padded``: ``make_replay_buffer(store, batch_size=64, collate_fn=PaddedCollator())``.

Design: docs/torchrl.md.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tensordict import is_tensor_collection
from tensordict.nn.utils import _set_dispatch_td_nn_modules
from torchrl.data import ReplayBuffer, TensorDictReplayBuffer
from torchrl.data.replay_buffers.samplers import RandomSampler, Sampler, SamplerWithoutReplacement
from torchrl.data.replay_buffers.writers import ImmutableDatasetWriter, TensorDictRoundRobinWriter, Writer

from rlhf_pipeline.schema import TrajectoryBatch
from rlhf_pipeline.schema.batch import as_trajectory_batch
from rlhf_pipeline.storage import writer_state as writer_states
from rlhf_pipeline.storage.capabilities import is_trajectory_store
from rlhf_pipeline.storage.writer_state import stateful_transforms

if TYPE_CHECKING:
    from rlhf_pipeline.storage.base import TrajectoryStore

def _prioritized() -> Sampler:
    from rlhf_pipeline.storage.prioritized import PrioritizedSampler

    return PrioritizedSampler()


SAMPLERS: dict[str, Callable[[], Sampler]] = {
    "random": RandomSampler,
    "without_replacement": SamplerWithoutReplacement,
    "prioritized": _prioritized,  # storage/prioritized.py: torchrl's own needs a compiled extension
}


def adopt_replay_buffer_defaults(buffer: Any) -> None:
    """Our defaults and checks for a torchrl ``ReplayBuffer`` being built over a trajectory store.

    torchrl picks a default ``collate_fn`` by storage class (``_get_default_collate``) and
    knows none for ours, so ``ReplayBuffer(storage=store, sampler=..., batch_size=...)`` used to
    fail with ``Could not find a default collate_fn``. Its constructor calls ``storage.attach``
    before it resolves the collate and the writer, so :meth:`TrajectoryStore.attach` fills what
    the caller left out: ``collate_fn`` = :class:`~rlhf_pipeline.schema.padding.PaddedCollator` (the
    learner's padded batch, pad id 0) and ``writer`` = :class:`AppendWriter` (positions the rows
    really got; also in place of ``TensorDictReplayBuffer``'s default round-robin writer). A writer
    that chooses positions itself is refused here, at construction (:func:`writer_for_store`).
    ``tests/storage/test_torchrl_dropin.py`` checks this against torchrl itself, so a torchrl
    release that builds buffers differently fails there.
    """
    from rlhf_pipeline.schema.padding import PaddedCollator

    building = isinstance(buffer, ReplayBuffer) and not hasattr(buffer, "_collate_fn")
    if not building:
        return
    if getattr(buffer, "_init_collate_fn", False) is None:
        buffer._init_collate_fn = PaddedCollator()
    if hasattr(buffer, "_init_writer"):
        buffer._init_writer = writer_for_store(buffer._init_writer)
    if isinstance(buffer, TensorDictReplayBuffer):
        # torchrl's method returns early unless the sampler is an instance of its own
        # PrioritizedSampler, which cannot load here; this buffer's instance gets one that
        # also recognizes ours (trainers call it through the attribute, so they get it too)
        buffer.update_tensordict_priority = functools.partial(_update_tensordict_priority, buffer)


def writer_for_store(writer: Any) -> Any:
    """The writer a buffer over a trajectory store gets in place of ``writer`` (what the caller passed).

    None, and ``TensorDictReplayBuffer``'s default (a round-robin writer it makes itself), become
    :class:`AppendWriter`. Any other writer (instance, class or factory) must append: torchrl's
    round-robin and max-value writers compute the positions rows go to and return those, but the
    store appends at positions it decides, so their indices would name other rows (or none);
    they are refused with a ``TypeError`` naming :class:`AppendWriter`.
    """
    if writer is None or _is_tensordict_buffer_default(writer):
        return AppendWriter()
    if isinstance(writer, Writer) or isinstance(writer, type):
        return _checked_writer(writer)
    if callable(writer):  # a factory: torchrl calls it once, right after attach
        return lambda: _checked_writer(writer())
    return writer  # torchrl's own check rejects what is neither a Writer nor a callable


def _is_tensordict_buffer_default(writer: Any) -> bool:
    return (isinstance(writer, functools.partial) and writer.func is TensorDictRoundRobinWriter
            and not writer.args and set(writer.keywords) <= {"compilable"})


def _checked_writer(writer: Any) -> Any:
    kind = writer if isinstance(writer, type) else type(writer)
    if not issubclass(kind, APPENDING_WRITERS):
        raise TypeError(
            f"{kind.__name__} chooses the positions rows are written at, but a trajectory store only "
            f"appends (at positions it decides), so the indices it returns would name other rows: use "
            f"writer=AppendWriter() from rlhf_pipeline.storage.torchrl_glue (the default when no writer "
            f"is passed)"
        )
    return writer


def _update_tensordict_priority(buffer: Any, data: Any) -> None:
    """``TensorDictReplayBuffer.update_tensordict_priority`` that also serves our sampler:
    each row of ``data`` (a sample, with its ``"index"``) takes the priority under the buffer's
    ``priority_key`` (reduced over any extra dims by the sampler's ``reduction``)."""
    from rlhf_pipeline.storage.prioritized import PrioritizedSampler

    if not isinstance(buffer._sampler, PrioritizedSampler):
        return type(buffer).update_tensordict_priority(buffer, data)
    if data.ndim:
        priority = buffer._get_priority_vector(data)
    else:
        priority = torch.as_tensor(buffer._get_priority_item(data))
    index = data.get("index")
    while index.shape != priority.shape:
        index = index[..., 0]
    buffer.update_priority(index, priority)


class AppendWriter(Writer):
    """Appends every write to the end of a :class:`TrajectoryStore`; returns real positions.

    Positions are logical: position ``p`` is the ``p``-th row of the store's live window
    (global row ``store.first_row + p``), what ``rb[p]`` and ``store.read(p)`` read now.
    """

    def add(self, data: Any) -> int:
        batch = as_trajectory_batch(data)
        if len(batch) != 1:
            raise ValueError(f"add() takes one row, got {len(batch)}; use extend() for several")
        return int(self._store().append(batch)[0])

    writer_state: bytes | None = None
    """Published with the next ``extend``'s rows (:meth:`TrajectoryReplayBuffer.extend` sets it)."""

    def extend(self, data: Any) -> torch.Tensor:
        state, self.writer_state = self.writer_state, None
        return self._store().append(as_trajectory_batch(data), writer_state=state)

    @property
    def _write_count(self) -> int:
        """Rows ever published to the store (``rb.write_count``, ``rb.stats()``): durable, and
        counting rows written by earlier runs too, as the store's positions do."""
        return self._storage.next_row if is_trajectory_store(self._storage) else 0

    def _store(self) -> TrajectoryStore:
        if not is_trajectory_store(self._storage):
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


#: Writers that never choose positions: ours appends, torchrl's ImmutableDatasetWriter writes nothing.
APPENDING_WRITERS: tuple[type[Writer], ...] = (AppendWriter, ImmutableDatasetWriter)


class TrajectoryReplayBuffer(ReplayBuffer):
    """torchrl's ``ReplayBuffer``, whose ``sample()`` pads through the store's fused path.

    torchrl's ``sample`` reads ``storage.get(index)`` (for our stores a ``TrajectoryBatch``)
    and hands it to ``collate_fn``. When ``collate_fn`` can read positions itself (it has
    ``read(storage, index)``, as :class:`~rlhf_pipeline.schema.padding.PaddedCollator` does), this
    buffer calls that instead: the sampled rows go straight from the store into the padded
    batch (``store.read_padded``), the same TensorDict at about twice the speed
    (``docs/benchmarks.md``). Sampling, locks, transforms and ``pin_memory`` behave as in
    torchrl; any other ``collate_fn``, a sample unit or generation tracking take torchrl's path.
    """

    _published_writer: dict[str, Any] | None = None  # the writer part of the store's last writer_state

    def extend(self, data: Any, *, writer_state: dict[str, Any] | None = None,
               update_priority: bool | None = None) -> torch.Tensor:
        """torchrl's ``extend``, publishing with the rows the store's ``writer_state``: ``writer_state``
        (None: the last one) and the write path's state after these rows (``storage/writer_state.py``).
        ``data`` None with a ``writer_state``: the state alone. A write that raises leaves the write
        path's state as it was before it."""
        transforms = stateful_transforms(self)
        if writer_state is None and not transforms:
            return super().extend(data, update_priority=update_priority)
        before = [t.get_extra_state() for t in transforms]
        try:
            if data is not None and self._transform is not None and len(self._transform):
                with _set_dispatch_td_nn_modules(is_tensor_collection(data)):
                    data = self._transform.inv(data)
            writer = self._published_writer if writer_state is None else writer_state
            state = writer_states.encode(writer, [t.get_extra_state() for t in transforms])
            if data is None:
                self._storage.append(None, writer_state=state)
                index = torch.zeros((0, self._storage.ndim), dtype=torch.long)
            else:
                self._writer.writer_state = state
                index = self._extend(data, update_priority=update_priority)
        except BaseException:
            self._writer.writer_state = None
            for transform, state in zip(transforms, before):
                transform.set_extra_state(state)
            raise
        self._published_writer = writer
        return index

    def resume_writer(self) -> dict[str, Any] | None:
        """The ``writer_state`` the store's last publish carried (None: none), its write path's part
        loaded into this buffer's transforms."""
        published = writer_states.decode(self._storage.writer_state, self._storage.location)
        writer_states.load_write_path(self, published, self._storage.location)
        self._published_writer = None if published is None else published["writer"]
        return self._published_writer

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
    the learner wants (e.g. ``rlhf_pipeline.schema.padding.PaddedCollator``); by default the
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
    transforms = list(transforms)
    for transform in reversed(transforms):
        rb.append_transform(transform, invert=True)
    if transforms and store.writable:  # a restarted writer: its write path's state, as published
        rb.resume_writer()
    return rb
