"""The storage errors a user can act on, importable without torch.

Every one names what went wrong and where (the store, the file, the chunk). The CLI's
``inspect``, ``repair`` and ``convert`` catch :class:`StoreError` and print its message
as a one-line error, so the messages are written to be read on their own.

Design: docs/guarantees.md#storage-both-backends.
"""

from __future__ import annotations


class StoreError(RuntimeError):
    """Base class of the storage errors a user can act on."""


class StoreLockedError(StoreError):
    """Another process holds the store's writer lock; ``holder`` names it (``"process 4242 on
    node-7"``) when known, for a caller that words its own message (the command line's)."""

    def __init__(self, message: str, holder: str | None = None):
        super().__init__(message)
        self.holder = holder


class NotAStoreError(StoreError):
    """The location holds no trajectory store (or not one this backend can read)."""


class StoreNotFoundError(NotAStoreError):
    """The location does not exist at all."""


class StoreBeingCreatedError(NotAStoreError):
    """A store is being made at the location (or its making was stopped before its first commit
    record): no rows yet. Readers of a run's buffer skip such a shard until it has a record."""


class StoreUnreachableError(StoreError):
    """An object store gave no answer (connections refused, reset, timed out) for a whole retry
    budget; nothing was lost, and the same call works again once the store answers."""


class StoreCorruptedError(StoreError):
    """Published data is missing or damaged; the message names what and where."""


class ReadOnlyStoreError(StoreError):
    """A write was attempted on a store opened for reading."""


class StoreClosedError(StoreError, ValueError):
    """The store object was closed; open the location again to use it.

    Also a ``ValueError``, as operations on a closed file are in Python.
    """


class IncompatibleStoreError(StoreError):
    """The store was written by a different backend or an incompatible format version."""


class LocalOnlyStoreError(StoreError, ValueError):
    """A backend that keeps files on a local or shared file system was given a URL."""


class StoreDamageWarning(UserWarning):
    """A store was opened at an older state than its newest, damaged one (rows rolled back),
    or holds damage that reads do not reach yet; the message names the files and the rows."""


class StorageExtraMissingError(StoreError, ImportError):
    """A location needs an optional package (``s3://`` needs s3fs); the message names the extra."""
