"""The contract every trajectory store keeps (``TrajectoryStore``), and its glue to torchrl's replay buffer.

Why one file: it is one class whose torchrl ``Storage`` methods are written in terms of its own contract;
a backend reads the two together to know what it must implement.

A store is a durable, append-only, ragged, columnar table of rows at one location. Rows have global ids
that never repeat; samplers draw positions ``[0, len(store))`` over the rows held. An append (with an
optional ``writer_state``) becomes visible in one atomic publish; one writer (``mode="a"``, locked), any
number of readers, which see new rows on ``refresh()``. Design: docs/storage.md#the-contract.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict
from torchrl.data.replay_buffers.storages import Storage

from rlhf_pipeline.schema.padding import check_index_dtype, pad_batch, padded_fields, place_padded
from rlhf_pipeline.schema import StoreSchema, TrajectoryBatch, validate_batch
from rlhf_pipeline.storage.errors import (  # noqa: F401 - re-exported: the contract's errors
    IncompatibleStoreError,
    NotAStoreError,
    ReadOnlyStoreError,
    StoreClosedError,
    StoreCorruptedError,
    StoreError,
    StoreLockedError,
    StoreNotFoundError,
)
from rlhf_pipeline.storage.padded_rows import LocatedRows, fill_padded, fill_ragged, located_fields
from rlhf_pipeline.storage.summary import StoreStats  # noqa: F401 - re-exported

UNBOUNDED_ROWS = 2**62


class TrajectoryStore(Storage, abc.ABC):
    """Durable ragged trajectory store: our contract plus torchrl's ``Storage`` methods.

    Subclasses implement the abstract methods below; everything torchrl calls is
    implemented here in terms of them, so every backend behaves the same way inside
    a ``ReplayBuffer``. The shared contract suite in ``tests/storage/contract.py``
    checks it for each backend.
    """

    backend_name: str = "abstract"
    refresh_interval_s: float = 0.0
    """At most how often :meth:`refresh` re-reads the published state: 0, at every call; a Zarr
    reader at a URL, 1 s by default; inf, a data-parallel rank's view, which follows rank 0's
    refreshes. A store with a throttle (> 0) also takes ``refresh(force=True)``: re-read now."""

    def __init__(self, *, max_size: int | None = None) -> None:
        # compilable: torchrl's bookkeeping counters as plain tensors, not multiprocessing.Values.
        # Processes share a store through its files, never by inheriting the object; each Value
        # is a named semaphore that Python reports as leaked when a process ends with os._exit
        super().__init__(max_size=max_size or UNBOUNDED_ROWS, compilable=True)

    # ================================================================ contract
    @property
    @abc.abstractmethod
    def schema(self) -> StoreSchema:
        """The fields this store holds, fixed at creation."""

    @property
    @abc.abstractmethod
    def location(self) -> str:
        """Where the store lives (a path or URL); ``open(location)`` reopens it."""

    @property
    @abc.abstractmethod
    def writable(self) -> bool:
        """True when opened with the writer lock (``mode="a"``)."""

    @property
    @abc.abstractmethod
    def first_row(self) -> int:
        """Global id of the oldest row held (rows before it were evicted)."""

    @property
    @abc.abstractmethod
    def next_row(self) -> int:
        """Global id the next appended row will get; equals the number of rows ever published."""

    @property
    def supports_eviction(self) -> bool:
        """True when a row capacity bounds the store (oldest segments are dropped)."""
        return False

    @property
    def closed(self) -> bool:
        """True after :meth:`close`; reading or appending then raises :class:`StoreClosedError`."""
        return bool(getattr(self, "_closed", False))

    @property
    def writer_lease_s(self) -> float | None:
        """The lease of this writer's lock on an object store; None for a reader or a lock that
        needs no lease (a local store's)."""
        return None

    @property
    def writer_state(self) -> bytes | None:
        """The ``writer_state`` of the last published append that carried one (as of the last
        refresh), or None: never given, or a store that takes no appends (a view of several)."""
        return None

    @abc.abstractmethod
    def _append_validated(self, batch: TrajectoryBatch | None, writer_state: bytes | None) -> None:
        """Writes an already validated batch (None: no rows) and publishes it atomically with
        ``writer_state`` (None: the last one stays): all rows and the state, or nothing."""

    @abc.abstractmethod
    def _read_global(self, global_ids: torch.Tensor) -> TrajectoryBatch:
        """Rows with the given global ids (all within ``[first_row, next_row)``), in that order."""

    @abc.abstractmethod
    def refresh(self) -> int:
        """Re-reads the published state (readers see new rows and evictions); returns ``len``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Releases files and the writer lock. Idempotent."""

    @abc.abstractmethod
    def stats(self) -> StoreStats:
        """Summary for ``inspect``: rows, groups, tokens, rewards, bytes, versions."""

    @abc.abstractmethod
    def snapshot_to(self, path: str) -> None:
        """Copies the published rows to a new store of the same backend at ``path``."""

    # ================================================================ shared behaviour
    def append(self, batch: TrajectoryBatch | None, *, writer_state: bytes | None = None) -> torch.Tensor:
        """Validates ``batch`` and stores it atomically with ``writer_state`` (docs/storage.md#the-writers-state);
        returns the new rows' positions. ``batch`` None or empty with a ``writer_state``: the state
        alone is published.

        On any validation error nothing is stored and the store is unchanged.
        """
        if self.closed:
            raise StoreClosedError(f"{self.location} was closed; open it again with mode='a' to append")
        if not self.writable:
            raise ReadOnlyStoreError(
                f"{self.location} was opened read-only; open it with mode='a' to append"
            )
        if writer_state is not None and not isinstance(writer_state, bytes):
            raise TypeError(f"writer_state must be bytes (the writer encodes its own state), "
                            f"got {type(writer_state).__name__}")
        if batch is not None and len(batch) == 0:
            batch = None
        if batch is None and writer_state is None:
            return torch.zeros(0, dtype=torch.int64)
        if batch is not None:
            batch = validate_batch(batch, self.schema)
        first_new = self.next_row
        self._append_validated(batch, writer_state)
        rows = 0 if batch is None else len(batch)
        return torch.arange(first_new, first_new + rows, dtype=torch.int64) - self.first_row

    def read(
        self, positions: torch.Tensor | list[int] | int, *, fields: Sequence[str] | None = None
    ) -> TrajectoryBatch:
        """Rows at ``positions`` in ``[0, len)`` (any order, repeats allowed).

        ``fields`` reads only those fields (skipping text makes sampling much cheaper).
        """
        return self._read_fields(self._checked_positions(positions) + self.first_row, fields)

    def _checked_positions(self, positions: torch.Tensor | Sequence[int] | int) -> torch.Tensor:
        """``positions`` as a flat int64 tensor; IndexError unless every one lies in ``[0, len)``."""
        positions = torch.as_tensor(positions, dtype=torch.int64).reshape(-1)
        n = self._published_len()
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= n):
            raise IndexError(
                f"positions must lie in [0, {n}) for this store; got min {int(positions.min())}, "
                f"max {int(positions.max())}"
            )
        return positions

    def _checked_fields(self, fields: Sequence[str] | None) -> tuple[str, ...] | None:
        """``fields`` as a tuple (None stays None); KeyError naming any field not stored here."""
        if fields is None:
            return None
        fields = tuple(fields)
        unknown = [f for f in fields if f not in self.schema.field_names]
        if unknown:
            raise KeyError(f"field(s) {unknown} are not stored here; this store holds {list(self.schema.field_names)}")
        return fields

    def read_global(
        self, global_ids: torch.Tensor | list[int], *, fields: Sequence[str] | None = None
    ) -> TrajectoryBatch:
        """Rows by global id; a clear error for evicted or not-yet-published ids."""
        global_ids = torch.as_tensor(global_ids, dtype=torch.int64).reshape(-1)
        lo, hi = self.first_row, self.next_row
        if global_ids.numel() and (int(global_ids.min()) < lo or int(global_ids.max()) >= hi):
            raise IndexError(
                f"global row ids must lie in [{lo}, {hi}) (older rows were evicted or dropped by retention, newer are "
                f"not published); got [{int(global_ids.min())}, {int(global_ids.max())}]"
            )
        return self._read_fields(global_ids, fields)

    #: True when ``_read_global`` takes ``fields=`` and reads only those; otherwise the
    #: base class reads every field and drops the others.
    supports_field_subset: bool = False

    #: True when the backend implements ``_locate_rows``, so :meth:`read_padded` copies each
    #: sampled row from storage straight into the padded tensors.
    supports_fused_padding: bool = False

    def read_padded(self, positions: torch.Tensor | Sequence[int], *, pad_token_id: int = 0,
                    pin_memory: bool = False, device: torch.device | str | None = None,
                    index_dtype: torch.dtype = torch.int64) -> TensorDict:
        """The learner's padded batch of the rows at ``positions``: exactly
        ``pad_batch(self.read(positions, fields=padded_fields(self.schema)), ...)``.

        Backends with ``supports_fused_padding`` skip the intermediate ``TrajectoryBatch``:
        they locate the rows, and each row's slices are copied straight from storage into
        the padded tensors (:mod:`rlhf_pipeline.storage.padded_rows`).
        """
        check_index_dtype(index_dtype)
        if not self.supports_fused_padding:
            return pad_batch(self.read(positions, fields=padded_fields(self.schema)), pad_token_id=pad_token_id,
                             pin_memory=pin_memory, device=device, index_dtype=index_dtype)
        global_ids = self._checked_positions(positions) + self.first_row
        if global_ids.numel() == 0:
            raise ValueError("pad_batch got an empty batch; sample at least one row")
        padded = fill_padded(self._locate_rows(global_ids), pad_token_id, index_dtype)
        return place_padded(padded, pin_memory=pin_memory, device=device)

    def read_ragged(self, positions: torch.Tensor | Sequence[int]) -> TrajectoryBatch:
        """The learner's rows at ``positions`` without padding (the packed learner's input): exactly
        ``self.read(positions, fields=located_fields(self.schema))``, the tokens, response-aligned
        floats and row fields of the padded batch.

        Backends with ``supports_fused_padding`` locate the rows as :meth:`read_padded` does and
        copy each row's slices end to end (:func:`~rlhf_pipeline.storage.padded_rows.fill_ragged`).
        """
        global_ids = self._checked_positions(positions) + self.first_row
        if not self.supports_fused_padding or global_ids.numel() == 0:
            return self._read_fields(global_ids, located_fields(self.schema))
        return fill_ragged(self._locate_rows(global_ids))

    def _locate_rows(self, global_ids: torch.Tensor) -> LocatedRows:
        """Where the rows with these global ids are (all within ``[first_row, next_row)``),
        for :meth:`read_padded`; backends with ``supports_fused_padding`` implement it."""
        raise NotImplementedError(f"{type(self).__name__} does not locate rows; read_padded uses read + pad_batch")

    def _read_fields(self, global_ids: torch.Tensor, fields: Sequence[str] | None) -> TrajectoryBatch:
        fields = self._checked_fields(fields)
        if fields is None:
            return self._read_global(global_ids)
        if self.supports_field_subset:
            return self._read_global(global_ids, fields=fields)
        full = self._read_global(global_ids)
        return TrajectoryBatch({name: full[name] for name in fields})

    def newest_positions(self, count: int) -> torch.Tensor:
        """Positions of the newest ``count`` rows (as of the last refresh), ascending.

        A single store's newest rows are its last positions; a union of shards
        (:class:`~rlhf_pipeline.storage.sharded.ShardedStoreReader`) takes some from each.
        """
        n = self._published_len()
        return torch.arange(max(0, n - max(count, 0)), n, dtype=torch.int64)

    def unit_bounds(self) -> list[tuple[int, int]]:
        """Position ranges ``[start, stop)`` of the store's storage units (as of the last
        refresh), in position order, covering ``[0, len)`` without overlap.

        A unit is what the backend reads as a whole (a memmap segment, a Zarr unit), so a
        reader that walks rows unit by unit touches each once (epoch replay does,
        ``learn/samplers/epoch.py``). Backends without such units are one unit.
        """
        n = self._published_len()
        return [(0, n)] if n else []

    def _published_len(self) -> int:
        return self.next_row - self.first_row

    def __len__(self) -> int:
        if not self.writable:
            return self.refresh()
        return self._published_len()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "a" if self.writable else "r"
        return (
            f"{type(self).__name__}({self.location!r}, mode={mode!r}, rows={self._published_len()}, "
            f"first_row={self.first_row})"
        )

    # ================================================================ torchrl Storage
    def attach(self, buffer: Any) -> None:
        """torchrl's hook when a ``ReplayBuffer`` takes this storage: a plain
        ``ReplayBuffer(storage=store, ...)`` gets our defaults (padded batches, appends)."""
        super().attach(buffer)
        from rlhf_pipeline.storage.torchrl_glue import adopt_replay_buffer_defaults

        adopt_replay_buffer_defaults(buffer)

    def set(self, cursor, data: Any, *, set_cursor: bool = True):
        """torchrl's write-at-a-position entry point, which an append-only store refuses.

        torchrl calls it from ``rb[i] = row`` and from writers that choose positions
        (round robin, max value). Rows can only be appended here, at positions the store
        decides; honouring the call would store the rows somewhere other than ``cursor``.
        """
        raise TypeError(
            f"{type(self).__name__} is append-only and does not write rows at chosen positions "
            f"(rb[i] = row, or a torchrl writer other than AppendWriter): append with rb.extend(rows) "
            f"on a buffer whose writer is AppendWriter (the default), or store.append(rows)"
        )

    def get(self, index) -> TrajectoryBatch:
        """torchrl's read entry point (``rb[index]``, sampling): an int, a slice or positions.

        Slices and negative positions count from the end of the live window, as a Python
        sequence's do; the store's own :meth:`read` takes positions in ``[0, len)`` only.
        """
        if isinstance(index, tuple):
            index = index[0]
        return self.read(self._sequence_positions(index))

    def _sequence_positions(self, index) -> torch.Tensor | int:
        """``index`` (an int, a slice, positions) as positions in ``[0, len)``, Python style."""
        n = self._published_len()
        if isinstance(index, slice):
            window = range(n)[index]  # Python's own slice rules, negative steps included
            return torch.arange(window.start, window.stop, window.step, dtype=torch.int64)
        if isinstance(index, int) or (hasattr(index, "ndim") and index.ndim == 0):
            position = int(index)
            if not -n <= position < n:
                raise IndexError(f"position {position} is out of range for a buffer of {n} rows")
            return position % n
        positions = torch.as_tensor(index)
        if positions.dtype == torch.bool:
            if positions.shape != (n,):
                raise IndexError(f"a boolean mask needs one entry per row ({n}), got shape {tuple(positions.shape)}")
            return torch.nonzero(positions).reshape(-1)
        positions = positions.to(torch.int64)
        if positions.numel() and (int(positions.min()) < -n or int(positions.max()) >= n):
            raise IndexError(f"positions must lie in [-{n}, {n}) for a buffer of {n} rows; got "
                             f"min {int(positions.min())}, max {int(positions.max())}")
        return torch.where(positions < 0, positions + n, positions)

    def contains(self, item) -> bool:
        if isinstance(item, int):
            return 0 <= item < self._published_len()
        item = torch.as_tensor(item)
        return (item >= 0) & (item < self._published_len())

    def state_dict(self) -> dict[str, Any]:
        """The rows live at ``location``; the state records which ones this object saw."""
        return {
            "backend": self.backend_name,
            "location": self.location,
            "first_row": self.first_row,
            "next_row": self.next_row,
            "schema": self.schema.to_json(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Checks that this store holds at least the rows a saved state saw (resume safety)."""
        self.refresh()
        saved_next = int(state_dict["next_row"])
        if self.next_row < saved_next:
            raise StoreCorruptedError(
                f"{self.location} has {self.next_row} published rows but the saved state saw "
                f"{saved_next}: the store was truncated or replaced since that checkpoint"
            )
        if StoreSchema.from_json(state_dict["schema"]) != self.schema:
            raise StoreCorruptedError(
                f"{self.location} stores fields {self.schema.field_names}, the saved state expected "
                f"{StoreSchema.from_json(state_dict['schema']).field_names}"
            )

    def dumps(self, path) -> None:
        """torchrl's checkpoint hook: writes a full copy of the published rows to ``path``."""
        self.snapshot_to(str(path))

    def loads(self, path) -> None:
        raise NotImplementedError(
            f"{type(self).__name__} is reopened, not loaded in place: use "
            f"{type(self).__name__}.open({str(path)!r}) on a snapshot written by dumps()"
        )

    def _empty(self) -> None:
        raise NotImplementedError(
            "a trajectory store is durable and is never emptied in place; create a new one "
            "(or rely on its row capacity to evict old segments)"
        )

    def _max_size_along_dim0(self, *, single_data=None, batched_data=None) -> int:
        return self.max_size

    def __getstate__(self):
        raise TypeError(
            f"{type(self).__name__} holds open files and a lock and is not pickled; pass its "
            f"location to the other process and open it there with mode='r'"
        )
